"""Properties of the per-token KL estimators (refppo/core/kl.py).

The expectation tests are exact: for a categorical π and π_ref over K outcomes, E_π[f] = Σ_i π_i·f_i
is a finite sum, so unbiasedness is checked as an identity in float64, not by sampling.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st
from strategies import Ragged, assert_exactly_equal, assert_twin_close, ragged_batches

from refppo.conventions import KLEstimator
from refppo.core.kl import token_kl, token_kl_naive

pytestmark = pytest.mark.property

estimators = st.sampled_from(list(KLEstimator))
clamps = st.sampled_from(
    [(None, None), ((-2.0, 2.0), None), (None, 1.5), ((None, 1.0), 3.0), ((-1.0, None), None)]
)


@given(ragged_batches(), estimators, clamps)
def test_token_kl_matches_naive(b: Ragged, est: KLEstimator, clamp: tuple[object, float | None]) -> None:
    lrc, vc = clamp
    lp, lr = b.floats(-8.0, -0.01), b.floats(-8.0, -0.01)
    got = token_kl(lp, lr, b.mask, est, log_ratio_clamp=lrc, value_clamp=vc)  # type: ignore[arg-type]  # drawn clamp tuples
    want = token_kl_naive(lp, lr, b.mask, est, log_ratio_clamp=lrc, value_clamp=vc)  # type: ignore[arg-type]  # same
    assert_twin_close(got, want, b.dtype, est.value)


@given(ragged_batches(), estimators, st.sampled_from(["nan", "inf", "-inf", "huge", "mixed"]))
def test_token_kl_padding_invariant(b: Ragged, est: KLEstimator, other_junk: str) -> None:
    lp, lr = b.valid(-8.0, -0.01), b.valid(-8.0, -0.01)
    k1 = token_kl(b.with_junk(lp), b.with_junk(lr), b.mask, est)
    k2 = token_kl(b.with_junk(lp, other_junk), b.with_junk(lr, other_junk), b.mask, est)
    assert_exactly_equal(k1, k2, what=est.value)
    assert bool((k1[~b.mask] == 0).all())


@given(ragged_batches(), estimators)
def test_token_kl_batch_permutation_equivariant(b: Ragged, est: KLEstimator) -> None:
    lp, lr = b.floats(-8.0, -0.01), b.floats(-8.0, -0.01)
    perm = torch.randperm(b.B, generator=b.gen)
    assert_exactly_equal(
        token_kl(lp[perm], lr[perm], b.mask[perm], est), token_kl(lp, lr, b.mask, est)[perm], what=est.value
    )


@given(ragged_batches(dtypes=(torch.float64,)), estimators)
def test_kl_zero_iff_logp_equals_ref(b: Ragged, est: KLEstimator) -> None:
    lp = b.floats(-8.0, -0.01)
    # Half of the valid positions get logp_ref == logp exactly; the others differ by |d| >= 1e-3.
    same = torch.rand(b.B, b.T, generator=b.gen) < 0.5
    offset = (torch.rand(b.B, b.T, generator=b.gen, dtype=torch.float64) * 2 + 1e-3) * torch.where(
        torch.rand(b.B, b.T, generator=b.gen) < 0.5, -1.0, 1.0
    ).double()
    lr = torch.where(same, lp, lp + offset)
    kl = token_kl(lp, lr, b.mask, est)
    assert bool((kl[b.mask & same] == 0).all()), "KL must be exactly 0 where logp == logp_ref"
    assert bool((kl[b.mask & ~same] != 0).all()), "KL must be non-zero where logp != logp_ref"


@given(ragged_batches(), st.sampled_from([KLEstimator.K2, KLEstimator.K3, KLEstimator.ABS]))
def test_kl_k2_k3_abs_nonnegative(b: Ragged, est: KLEstimator) -> None:
    lp, lr = b.floats(-30.0, 0.0), b.floats(-30.0, 0.0)
    kl = token_kl(lp, lr, b.mask, est)
    assert bool((kl >= 0).all()), f"{est.value} must be >= 0"


@st.composite
def categorical_pairs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """Two strictly positive categorical distributions over K in 2..8 outcomes, float64."""
    K = draw(st.integers(2, 8))
    weights = st.lists(st.floats(1e-3, 1.0), min_size=K, max_size=K)
    p = torch.tensor(draw(weights), dtype=torch.float64)
    q = torch.tensor(draw(weights), dtype=torch.float64)
    return p / p.sum(), q / q.sum()


def _expectation(p: torch.Tensor, q: torch.Tensor, est: KLEstimator) -> float:
    """E_{y~p}[k(y)]: one "token" per outcome, logp = log p(y), logp_ref = log q(y), weighted by p(y)."""
    lp, lq = p.log().unsqueeze(0), q.log().unsqueeze(0)
    k = token_kl(lp, lq, torch.ones_like(lp, dtype=torch.bool), est)[0]
    return float((p * k).sum())


def _exact_kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return math.fsum(float(pi) * math.log(float(pi) / float(qi)) for pi, qi in zip(p, q, strict=True))


@given(categorical_pairs())
def test_kl_k1_k3_expectations_equal_exact_kl(pq: tuple[torch.Tensor, torch.Tensor]) -> None:
    p, q = pq
    kl = _exact_kl(p, q)
    assert abs(_expectation(p, q, KLEstimator.K1) - kl) < 1e-12
    # E_p[k3] = Σ p(q/p − 1 − log(q/p)) = Σq − Σp + KL = KL.
    assert abs(_expectation(p, q, KLEstimator.K3) - kl) < 1e-12


def test_kl_k2_expectation_differs_from_kl_concrete_case() -> None:
    # π = (1/2, 1/2), π_ref = (9/10, 1/10), worked by hand:
    #   d_1 = ln(0.5/0.9) = −0.5877867, d_2 = ln(0.5/0.1) = ln 5 = 1.6094379
    #   KL   = ½(−0.5877867) + ½(1.6094379)              = 0.5108256   (= ½ ln(25/9))
    #   E[k2] = ½·[½(0.5877867²) + ½(1.6094379²)] = ½·[½·0.3454931 + ½·2.5902904] = ½·1.4678918 = 0.7339459
    p = torch.tensor([0.5, 0.5], dtype=torch.float64)
    q = torch.tensor([0.9, 0.1], dtype=torch.float64)
    assert _expectation(p, q, KLEstimator.K1) == pytest.approx(0.5108256, abs=1e-7)
    assert _expectation(p, q, KLEstimator.K3) == pytest.approx(0.5108256, abs=1e-7)
    assert _expectation(p, q, KLEstimator.K2) == pytest.approx(0.7339459, abs=1e-7)


def test_kl_k2_expectation_is_biased_for_some_distributions() -> None:
    # Existence, searched by Hypothesis: some pair has |E[k2] − KL| > 0.01 (k2 is biased).
    # `find` raises NoSuchExample if no generated pair satisfies the condition.
    p, q = find(
        categorical_pairs(),
        lambda pq: abs(_expectation(pq[0], pq[1], KLEstimator.K2) - _exact_kl(pq[0], pq[1])) > 0.01,
        settings=settings(max_examples=200, derandomize=True, database=None),
    )
    assert abs(_expectation(p, q, KLEstimator.K2) - _exact_kl(p, q)) > 0.01
    # ... while k1 and k3 stay exact on that same pair.
    assert abs(_expectation(p, q, KLEstimator.K1) - _exact_kl(p, q)) < 1e-12
    assert abs(_expectation(p, q, KLEstimator.K3) - _exact_kl(p, q)) < 1e-12
