"""Properties of GAE advantages and returns (refppo/core/gae.py).

Closed forms are computed here from their definitions with plain per-row Python loops over the
valid prefix (rows are right-padded, so the valid positions are 0..L−1).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import Ragged, assert_exactly_equal, assert_twin_close, ragged_batches

from refppo.core.gae import gae, gae_naive

pytestmark = pytest.mark.property

unit = st.one_of(st.sampled_from([0.0, 0.5, 0.9, 0.95, 0.99, 1.0]), st.floats(0.0, 1.0))


def _closed_form(b: Ragged, per_row: list[list[float]]) -> torch.Tensor:
    out = torch.zeros(b.B, b.T, dtype=torch.float64)
    for i, row in enumerate(per_row):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float64)
    return out.to(b.dtype)


@given(ragged_batches(), unit, unit)
def test_gae_matches_naive(b: Ragged, gamma: float, lam: float) -> None:
    r, v = b.floats(-1.0, 1.0), b.floats(-2.0, 2.0)
    adv, ret = gae(r, v, b.mask, gamma=gamma, lam=lam)
    adv_n, ret_n = gae_naive(r, v, b.mask, gamma=gamma, lam=lam)
    assert_twin_close(adv, adv_n, b.dtype, "advantages")
    assert_twin_close(ret, ret_n, b.dtype, "returns")


@given(ragged_batches(), unit, unit, st.sampled_from(["nan", "inf", "-inf", "huge", "mixed"]))
def test_gae_padding_invariant(b: Ragged, gamma: float, lam: float, other_junk: str) -> None:
    r, v = b.valid(-1.0, 1.0), b.valid(-2.0, 2.0)
    a1, r1 = gae(b.with_junk(r), b.with_junk(v), b.mask, gamma=gamma, lam=lam)
    a2, r2 = gae(b.with_junk(r, other_junk), b.with_junk(v, other_junk), b.mask, gamma=gamma, lam=lam)
    assert_exactly_equal(a1, a2, what="advantages")
    assert_exactly_equal(r1, r2, what="returns")
    assert bool((a1[~b.mask] == 0).all() and (r1[~b.mask] == 0).all())


@given(ragged_batches(), unit, unit)
def test_gae_batch_permutation_equivariant(b: Ragged, gamma: float, lam: float) -> None:
    r, v = b.floats(-1.0, 1.0), b.floats(-2.0, 2.0)
    perm = torch.randperm(b.B, generator=b.gen)
    a, ret = gae(r, v, b.mask, gamma=gamma, lam=lam)
    ap, retp = gae(r[perm], v[perm], b.mask[perm], gamma=gamma, lam=lam)
    assert_exactly_equal(ap, a[perm], what="advantages")
    assert_exactly_equal(retp, ret[perm], what="returns")


@given(ragged_batches(), unit)
def test_gae_lambda_one_is_discounted_return_minus_value(b: Ragged, gamma: float) -> None:
    r, v = b.floats(-1.0, 1.0), b.floats(-2.0, 2.0)
    adv, _ = gae(r, v, b.mask, gamma=gamma, lam=1.0)
    rows = []
    for i, L in enumerate(b.lengths):
        rr, vv = r[i].tolist(), v[i].tolist()
        rows.append([sum(gamma ** (k - t) * rr[k] for k in range(t, L)) - vv[t] for t in range(L)])
    assert_twin_close(adv, _closed_form(b, rows), b.dtype, "λ=1")


@given(ragged_batches(), unit)
def test_gae_lambda_zero_is_td_residual(b: Ragged, gamma: float) -> None:
    r, v = b.floats(-1.0, 1.0), b.floats(-2.0, 2.0)
    adv, _ = gae(r, v, b.mask, gamma=gamma, lam=0.0)
    rows = []
    for i, L in enumerate(b.lengths):
        rr, vv = r[i].tolist(), v[i].tolist()
        rows.append([rr[t] + gamma * (vv[t + 1] if t + 1 < L else 0.0) - vv[t] for t in range(L)])
    assert_twin_close(adv, _closed_form(b, rows), b.dtype, "λ=0")


@given(ragged_batches(), unit, unit)
def test_gae_returns_equal_advantages_plus_values(b: Ragged, gamma: float, lam: float) -> None:
    r, v = b.floats(-1.0, 1.0), b.floats(-2.0, 2.0)
    adv, ret = gae(r, v, b.mask, gamma=gamma, lam=lam)
    assert_exactly_equal(ret, adv + v, b.mask, what="returns")
    assert bool((ret[~b.mask] == 0).all())


@given(ragged_batches())
def test_gae_gamma_lambda_one_zero_values_is_reward_to_go(b: Ragged) -> None:
    r = b.floats(-1.0, 1.0)
    zeros = b.with_junk(torch.zeros(b.B, b.T, dtype=b.dtype))
    adv, ret = gae(r, zeros, b.mask, gamma=1.0, lam=1.0)
    rows = [[sum(r[i, t:L].tolist()) for t in range(L)] for i, L in enumerate(b.lengths)]
    assert_twin_close(adv, _closed_form(b, rows), b.dtype, "reward-to-go")
    assert_exactly_equal(ret, adv, what="returns with V=0")


@given(ragged_batches(max_B=8, max_T=32), unit, unit)
def test_gae_interior_mask_holes_are_skipped(b: Ragged, gamma: float, lam: float) -> None:
    # Inserting masked (junk) positions inside a row changes nothing at the valid positions:
    # holes are transparent (verl PR #2337 semantics), compared with the compacted batch.
    r, v = b.floats(-1.0, 1.0), b.floats(-2.0, 2.0)
    holes = torch.rand(b.B, b.T, generator=b.gen) < 0.3
    T2 = 2 * b.T
    spread_mask = torch.zeros(b.B, T2, dtype=torch.bool)
    spread_r = torch.full((b.B, T2), float("nan"), dtype=b.dtype)
    spread_v = torch.full((b.B, T2), float("inf"), dtype=b.dtype)
    idx = torch.arange(b.T) * 2 + holes.long()  # valid token t sits at 2t or 2t+1
    spread_mask.scatter_(1, idx.expand(b.B, -1), b.mask)
    spread_r.scatter_(1, idx.expand(b.B, -1), r)
    spread_v.scatter_(1, idx.expand(b.B, -1), v)
    a, ret = gae(r, v, b.mask, gamma=gamma, lam=lam)
    a2, ret2 = gae(spread_r, spread_v, spread_mask, gamma=gamma, lam=lam)
    assert_exactly_equal(a2.gather(1, idx.expand(b.B, -1)), a, b.mask, what="advantages")
    assert_exactly_equal(ret2.gather(1, idx.expand(b.B, -1)), ret, b.mask, what="returns")
    assert_twin_close(
        a2, gae_naive(spread_r, spread_v, spread_mask, gamma=gamma, lam=lam)[0], b.dtype, "holes"
    )
