"""Properties of the ratio and the clipped surrogate (refppo/core/policy.py), incl. the clip truth table."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import Ragged, assert_exactly_equal, assert_twin_close, ragged_batches

from refppo.agg_conventions import MASK_AGGS
from refppo.conventions import LossAgg
from refppo.core.policy import clipped_policy_loss, clipped_policy_loss_naive, policy_ratio

pytestmark = pytest.mark.property

aggs = st.sampled_from(list(MASK_AGGS))
duals = st.sampled_from([None, 3.0, 1.5])
clip_ranges = st.sampled_from([(0.2, None), (0.1, 0.3), (0.0, None), (0.28, 0.2)])


def _inputs(b: Ragged) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lp_old = b.floats(-5.0, -0.01)
    lp = b.with_junk(lp_old + b.valid(-1.0, 1.0))  # ratios in [e^-1, e^1]: every clip region occurs
    adv = b.floats(-2.0, 2.0)
    return lp, lp_old, adv


@given(ragged_batches(), clip_ranges, duals, aggs, st.sampled_from([None, 0.5, 20.0]))
def test_clipped_policy_loss_matches_naive(
    b: Ragged, clip: tuple[float, float | None], dual: float | None, agg: LossAgg, lrc: float | None
) -> None:
    lp, lp_old, adv = _inputs(b)
    kw = {"clip_low": clip[0], "clip_high": clip[1], "dual_clip": dual, "agg": agg, "log_ratio_clamp": lrc}
    got = clipped_policy_loss(lp, lp_old, adv, b.mask, **kw)  # type: ignore[arg-type]  # heterogeneous kwargs dict
    want = clipped_policy_loss_naive(lp, lp_old, adv, b.mask, **kw)  # type: ignore[arg-type]  # same
    like = torch.zeros((), dtype=torch.float64)
    assert_twin_close(got.loss, like + want.loss, b.dtype, "loss")
    assert_twin_close(got.per_token, torch.tensor(want.per_token, dtype=torch.float64), b.dtype, "per_token")
    assert_twin_close(got.ratio, torch.tensor(want.ratio, dtype=torch.float64), b.dtype, "ratio")
    assert_twin_close(got.approx_kl, like + want.approx_kl, b.dtype, "approx_kl")
    assert_twin_close(got.approx_kl_k2, like + want.approx_kl_k2, b.dtype, "approx_kl_k2")
    if b.dtype == torch.float64:  # counts of strict comparisons: exact in float64 (no ties drawn)
        assert float(got.clipfrac) == pytest.approx(want.clipfrac, abs=1e-12)
        assert float(got.clipfrac_lower) == pytest.approx(want.clipfrac_lower, abs=1e-12)


@given(ragged_batches(), duals, aggs, st.sampled_from(["nan", "inf", "-inf", "huge", "mixed"]))
def test_policy_loss_padding_invariant(b: Ragged, dual: float | None, agg: LossAgg, other_junk: str) -> None:
    lp_old, adv = b.valid(-5.0, -0.01), b.valid(-2.0, 2.0)
    lp = lp_old + b.valid(-1.0, 1.0)
    outs, grads = [], []
    for junk in (None, other_junk):
        x = b.with_junk(lp, junk).requires_grad_(True)
        res = clipped_policy_loss(
            x, b.with_junk(lp_old, junk), b.with_junk(adv, junk), b.mask, dual_clip=dual, agg=agg
        )
        res.loss.backward()
        outs.append(res)
        assert x.grad is not None
        grads.append(x.grad)
    a, c = outs
    for name in ("loss", "per_token", "ratio", "clipfrac", "clipfrac_lower", "approx_kl", "approx_kl_k2"):
        assert_exactly_equal(getattr(a, name), getattr(c, name), what=name)
    assert_exactly_equal(grads[0], grads[1], what="grad")
    assert bool((grads[0][~b.mask] == 0).all()), "no gradient reaches padded log-probs"


@given(ragged_batches(), duals)
def test_policy_loss_batch_permutation_equivariant(b: Ragged, dual: float | None) -> None:
    lp, lp_old, adv = _inputs(b)
    perm = torch.randperm(b.B, generator=b.gen)
    a = clipped_policy_loss(lp, lp_old, adv, b.mask, dual_clip=dual)
    p = clipped_policy_loss(lp[perm], lp_old[perm], adv[perm], b.mask[perm], dual_clip=dual)
    assert_exactly_equal(p.per_token, a.per_token[perm], what="per_token")
    assert_exactly_equal(p.ratio, a.ratio[perm], what="ratio")
    assert_twin_close(p.loss, a.loss, b.dtype, "loss (summation order only)")


@given(ragged_batches(), st.sampled_from([None, 0.3]))
def test_policy_ratio_is_exp_of_log_ratio(b: Ragged, lrc: float | None) -> None:
    lp, lp_old, _ = _inputs(b)
    d = lp - lp_old
    if lrc is not None:
        d = d.clamp(-lrc, lrc)
    expected = torch.where(b.mask, torch.exp(d), torch.zeros((), dtype=b.dtype))
    assert_exactly_equal(policy_ratio(lp, lp_old, b.mask, log_ratio_clamp=lrc), expected, what="ratio")


# ----------------------------------------------------------------------------------------------
# The clip truth table (spec/ppo.md, "clipped_policy_loss"): ε = 0.2, dual-clip constant c = 3.
# ----------------------------------------------------------------------------------------------

EPS, C = 0.2, 3.0


@dataclass(frozen=True)
class Region:
    name: str
    adv: float
    ratios: tuple[float, ...]
    clipped_value: float | None  # None: ℓ = −A·ρ (unclipped branch, gradient −A·ρ/N); else ℓ = this, grad 0


REGIONS = [
    Region("A>0,r<1-eps", 2.0, (0.5, 0.7, 0.79), None),
    Region("A>0,inside", 2.0, (0.81, 1.0, 1.19), None),
    Region("A>0,r>1+eps", 2.0, (1.21, 1.5, 4.0), -2.0 * (1 + EPS)),
    Region("A<0,r<1-eps", -2.0, (0.3, 0.5, 0.79), 2.0 * (1 - EPS)),
    Region("A<0,inside", -2.0, (0.81, 1.0, 1.19), None),
    Region("A<0,1+eps<r<c", -2.0, (1.21, 2.0, 2.9), None),
    Region("A<0,r>c", -2.0, (3.1, 5.0, 10.0), None),  # dual-clip changes this one (see below)
    Region("A=0", 0.0, (0.5, 1.0, 1.5), 0.0),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("dual", [False, True], ids=["no_dual", "dual_clip"])
@pytest.mark.parametrize("region", REGIONS, ids=[r.name for r in REGIONS])
def test_clip_truth_table(region: Region, dual: bool, dtype: torch.dtype) -> None:
    # One row of 3 tokens in the region plus 2 padded junk positions; token-mean, N = 3.
    n = len(region.ratios)
    mask = torch.tensor([[True] * n + [False, False]])
    lp_old = torch.tensor([[-1.0] * n + [float("nan"), 7.0]], dtype=dtype)
    lp = (
        lp_old + torch.tensor([[*(torch.tensor(region.ratios).log().tolist()), 0.0, 0.0]], dtype=dtype)
    ).detach()
    lp[0, n:] = float("inf")
    lp.requires_grad_(True)
    adv = torch.tensor([[region.adv] * n + [float("nan"), float("nan")]], dtype=dtype)
    res = clipped_policy_loss(lp, lp_old, adv, mask, clip_low=EPS, dual_clip=C if dual else None)
    res.loss.backward()
    assert lp.grad is not None
    r = torch.exp(lp.detach() - lp_old)[0, :n]  # the ratio as the formula defines it
    A = region.adv
    clipped_value = region.clipped_value
    if dual and region.name == "A<0,r>c":
        clipped_value = -A * C  # dual-clip: ℓ = −c·A, gradient 0
    if clipped_value is None:
        want_value, want_grad = -A * r, -A * r / n
    else:
        want_value, want_grad = torch.full_like(r, clipped_value), torch.zeros_like(r)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(res.per_token[0, :n].detach(), want_value, rtol=tol, atol=tol)
    torch.testing.assert_close(res.loss.detach(), want_value.sum() / n, rtol=tol, atol=tol)
    if clipped_value is not None:
        assert bool((lp.grad[0, :n] == 0).all()), f"gradient must vanish exactly in {region.name}"
    else:
        torch.testing.assert_close(lp.grad[0, :n], want_grad, rtol=tol, atol=tol)
        assert bool((lp.grad[0, :n] != 0).all())
    assert bool((lp.grad[0, n:] == 0).all())


@st.composite
def _region_token(draw: st.DrawFn) -> tuple[float, float]:
    """(A, ρ) with ρ strictly inside one of the regions (never on a boundary 1±ε or c)."""
    A = draw(st.one_of(st.just(0.0), st.floats(0.05, 5.0), st.floats(-5.0, -0.05)))
    r = draw(
        st.one_of(
            st.floats(0.05, 1 - EPS - 1e-3),
            st.floats(1 - EPS + 1e-3, 1 + EPS - 1e-3),
            st.floats(1 + EPS + 1e-3, C - 1e-3),
            st.floats(C + 1e-3, 20.0),
        )
    )
    return A, r


@given(st.lists(_region_token(), min_size=1, max_size=24), st.booleans())
def test_clip_truth_table_random_regions(tokens: list[tuple[float, float]], dual: bool) -> None:
    n = len(tokens)
    A = torch.tensor([[a for a, _ in tokens]], dtype=torch.float64)
    lp_old = torch.zeros(1, n, dtype=torch.float64)
    lp = torch.tensor([[r for _, r in tokens]], dtype=torch.float64).log().requires_grad_(True)
    mask = torch.ones(1, n, dtype=torch.bool)
    res = clipped_policy_loss(lp, lp_old, A, mask, clip_low=EPS, dual_clip=C if dual else None)
    res.loss.backward()
    assert lp.grad is not None
    rho, per_token = torch.exp(lp.detach()), res.per_token.detach()
    for t, (a, _) in enumerate(tokens):
        r = float(rho[0, t])
        if a == 0:
            value, grad = 0.0, 0.0
        elif a > 0 and r > 1 + EPS:
            value, grad = -a * (1 + EPS), 0.0
        elif a < 0 and r < 1 - EPS:
            value, grad = -a * (1 - EPS), 0.0
        elif dual and a < 0 and r > C:
            value, grad = -a * C, 0.0
        else:
            value, grad = -a * r, -a * r / n
        assert float(per_token[0, t]) == pytest.approx(value, rel=1e-12, abs=1e-12)
        if grad == 0.0:
            assert float(lp.grad[0, t]) == 0.0
        else:
            assert float(lp.grad[0, t]) == pytest.approx(grad, rel=1e-12, abs=1e-15)
