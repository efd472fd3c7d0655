"""Properties of the rollout-correction weights and gates (refppo/core/rollout_correction.py).

- ``is_weights`` and ``rejection_mask`` equal their naive twins on ragged batches with junk padding
  (float64 to 1e-12; float32 truncation within the twin tolerance), under every level, aggregation,
  mode, statistic, order and reduction;
- product and geometric aggregation agree on one-token rows, and differ on a longer row by the log
  of its length (``log w_prod = L_b·log w_geo``);
- truncation never increases a weight above ``C_high`` nor lowers it below ``C_low``, and is the
  clamp; masking drops exactly the tokens whose weight is outside the closed band and keeps the
  others' weight unchanged;
- a gate's veto (``ratio``, ``behaviour``, ``max``, ``high = 1/τ``) rejects a row iff one of its
  tokens has ``w_t < τ``; the ``proximal`` and ``behaviour`` orders are mirror images;
- junk on the padding changes nothing; a weight's gradient never reaches the padding.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import Ragged, assert_exactly_equal, assert_twin_close, ragged_batches

from refppo.core.rollout_correction import is_weights, is_weights_naive, rejection_mask, rejection_mask_naive
from refppo.rollout_conventions import ISAgg, ISLevel, ISMode, RSOrder, RSReduce, RSStat

pytestmark = pytest.mark.property

F64 = torch.float64
levels, aggs, modes = (
    st.sampled_from(list(ISLevel)),
    st.sampled_from(list(ISAgg)),
    st.sampled_from(list(ISMode)),
)
bounds = st.sampled_from([(None, None), (None, 1.5), (0.7, None), (0.8, 1.25), (0.5, 2.0), (1.0, 1.0)])
kappas = st.sampled_from([None, 0.2, 20.0])


def _pair(b: Ragged, spread: float = 0.6) -> tuple[torch.Tensor, torch.Tensor]:
    """``(l^prox, l^beh)``: per-row offsets and per-token noise put weights on every side of the bounds."""
    beh = b.valid(-5.0, -0.1)
    d = b.normal(b.B, 1, scale=0.3) + b.valid(-spread, spread)
    return b.with_junk(beh + d), b.with_junk(beh)


def _close64(got: torch.Tensor, want: list[list[float]], what: str) -> None:
    torch.testing.assert_close(got.to(F64), torch.tensor(want, dtype=F64), rtol=1e-12, atol=1e-12, msg=what)


@given(ragged_batches(dtypes=(F64,)), levels, aggs, modes, bounds, kappas)
def test_is_weights_match_naive(
    b: Ragged,
    level: ISLevel,
    agg: ISAgg,
    mode: ISMode,
    lohi: tuple[float | None, float | None],
    kappa: float | None,
) -> None:
    prox, beh = _pair(b)
    kw = {"level": level, "agg": agg, "mode": mode, "low": lohi[0], "high": lohi[1], "log_ratio_clamp": kappa}
    got = is_weights(prox, beh, b.mask, **kw)  # type: ignore[arg-type]  # kwargs dict
    weight, raw, keep = is_weights_naive(prox, beh, b.mask, **kw)  # type: ignore[arg-type]  # same
    _close64(got.weight, weight, "weight")
    _close64(got.raw, raw, "raw")
    assert got.keep.tolist() == keep


@given(ragged_batches(dtypes=(torch.float32,)), levels, aggs, bounds, kappas)
def test_truncated_weights_match_naive_in_float32(
    b: Ragged, level: ISLevel, agg: ISAgg, lohi: tuple[float | None, float | None], kappa: float | None
) -> None:
    prox, beh = _pair(b)
    kw = {"level": level, "agg": agg, "low": lohi[0], "high": lohi[1], "log_ratio_clamp": kappa}
    got = is_weights(prox, beh, b.mask, **kw)  # type: ignore[arg-type]  # kwargs dict
    weight, raw, _ = is_weights_naive(prox, beh, b.mask, **kw)  # type: ignore[arg-type]  # same
    assert_twin_close(got.weight, torch.tensor(weight, dtype=F64), b.dtype, "weight")
    assert_twin_close(got.raw, torch.tensor(raw, dtype=F64), b.dtype, "raw")


stats, orders = st.sampled_from(list(RSStat)), st.sampled_from(list(RSOrder))
reduces = st.sampled_from(list(RSReduce))


def _gate_bounds(stat: RSStat, level: ISLevel, reduce: RSReduce) -> tuple[float | None, float]:
    """Bounds that split the drawn statistics: ratio band, k1 band, k2/k3 upper bounds."""
    if stat is RSStat.RATIO:
        return (0.7, 1.4) if level is ISLevel.TOKEN or reduce is not RSReduce.SUM else (0.3, 3.0)
    wide = level is ISLevel.SEQUENCE and reduce is RSReduce.SUM
    if stat is RSStat.K1:
        return (-1.0, 1.0) if wide else (-0.3, 0.3)
    return None, (0.3 if wide else 0.04)


@given(ragged_batches(dtypes=(F64,)), stats, orders, levels, reduces, kappas)
def test_rejection_mask_matches_naive(
    b: Ragged, stat: RSStat, order: RSOrder, level: ISLevel, reduce: RSReduce, kappa: float | None
) -> None:
    prox, beh = _pair(b)
    lo, hi = _gate_bounds(stat, level, reduce)
    kw = {"stat": stat, "order": order, "level": level, "reduce": reduce, "low": lo, "high": hi}
    got = rejection_mask(prox, beh, b.mask, log_ratio_clamp=kappa, **kw)  # type: ignore[arg-type]  # kwargs
    assert got.tolist() == rejection_mask_naive(prox, beh, b.mask, log_ratio_clamp=kappa, **kw)  # type: ignore[arg-type]  # same
    assert not bool(got[~b.mask].any()), "a padded position is never kept"


@given(ragged_batches(dtypes=(F64,)), modes, bounds)
def test_product_and_geometric_agree_on_one_token_rows_and_scale_by_length(
    b: Ragged, mode: ISMode, lohi: tuple[float | None, float | None]
) -> None:
    prox, beh = _pair(b)
    kw = {"level": ISLevel.SEQUENCE, "mode": mode, "low": lohi[0], "high": lohi[1]}
    prod = is_weights(prox, beh, b.mask, agg=ISAgg.PRODUCT, **kw)  # type: ignore[arg-type]  # kwargs
    geo = is_weights(prox, beh, b.mask, agg=ISAgg.GEOMETRIC, **kw)  # type: ignore[arg-type]  # kwargs
    lengths = b.mask.sum(1)
    one = (lengths == 1).unsqueeze(1) & b.mask
    assert torch.equal(prod.raw[one], geo.raw[one]) and torch.equal(prod.weight[one], geo.weight[one])
    # log w_prod = L_b·log w_geo on every valid token (the sum is L_b times the mean)
    lp, lg = prod.raw.log()[b.mask], geo.raw.log()[b.mask]
    L = lengths.unsqueeze(1).expand_as(b.mask)[b.mask].to(F64)
    torch.testing.assert_close(lp, L * lg, rtol=1e-12, atol=1e-12)


@given(ragged_batches(), levels, aggs, bounds)
def test_truncation_is_the_clamp_and_never_leaves_the_band(
    b: Ragged, level: ISLevel, agg: ISAgg, lohi: tuple[float | None, float | None]
) -> None:
    prox, beh = _pair(b)
    lo, hi = lohi
    w = is_weights(prox, beh, b.mask, level=level, agg=agg, mode=ISMode.TRUNCATE, low=lo, high=hi)
    v, r = w.weight[b.mask], w.raw[b.mask]
    if hi is not None:
        assert bool((v <= hi).all()), "a truncated weight above C_high"
        assert bool((v <= torch.maximum(r, torch.tensor(lo or 0.0, dtype=r.dtype))).all()), (
            "truncation raised w"
        )
    if lo is not None:
        assert bool((v >= lo).all()), "a truncated weight below C_low"
    assert torch.equal(v, r if lo is None and hi is None else r.clamp(min=lo, max=hi))
    assert bool(w.keep.eq(b.mask).all()), "truncation keeps every valid token"


@given(ragged_batches(), levels, aggs, bounds)
def test_masking_drops_exactly_the_tokens_outside_the_band(
    b: Ragged, level: ISLevel, agg: ISAgg, lohi: tuple[float | None, float | None]
) -> None:
    prox, beh = _pair(b)
    lo, hi = lohi
    w = is_weights(prox, beh, b.mask, level=level, agg=agg, mode=ISMode.MASK, low=lo, high=hi)
    inside = torch.ones_like(b.mask)
    if lo is not None:
        inside &= w.raw >= lo
    if hi is not None:
        inside &= w.raw <= hi
    assert torch.equal(w.keep, b.mask & inside)
    assert torch.equal(w.weight[w.keep], w.raw[w.keep]), "a kept weight is unchanged"
    assert bool((w.weight[~w.keep] == 0).all()), "a dropped (or padded) weight is 0"


@given(ragged_batches(dtypes=(F64,)), st.sampled_from([0.5, 0.8, 1.0]))
def test_the_veto_rejects_a_row_iff_one_token_ratio_is_below_tau(b: Ragged, tau: float) -> None:
    prox, beh = _pair(b)
    keep = rejection_mask(
        prox, beh, b.mask, stat="ratio", order="behaviour", level="sequence", reduce="max", high=1 / tau
    )
    w = is_weights(prox, beh, b.mask).raw
    for row in range(b.B):
        any_below = bool((w[row][b.mask[row]] < tau).any())
        assert bool(keep[row][b.mask[row]].all()) is not any_below, f"row {row}: veto wrong"
        assert bool(keep[row][b.mask[row]].all()) or not bool(keep[row].any()), (
            "a row is kept or dropped whole"
        )


@given(ragged_batches(dtypes=(F64,)), stats, levels, reduces)
def test_the_orders_are_mirror_images(b: Ragged, stat: RSStat, level: ISLevel, reduce: RSReduce) -> None:
    prox, beh = _pair(b)
    lo, hi = _gate_bounds(stat, level, reduce)
    kw = {"stat": stat, "level": level, "reduce": reduce, "low": lo, "high": hi}
    a = rejection_mask(prox, beh, b.mask, order="behaviour", **kw)  # type: ignore[arg-type]  # kwargs
    c = rejection_mask(beh, prox, b.mask, order="proximal", **kw)  # type: ignore[arg-type]  # kwargs
    assert torch.equal(a, c)


@given(ragged_batches(), levels, aggs, modes, st.sampled_from(["nan", "inf", "-inf", "huge", "mixed"]))
def test_weights_and_gates_padding_invariant(
    b: Ragged, level: ISLevel, agg: ISAgg, mode: ISMode, junk: str
) -> None:
    beh = b.valid(-5.0, -0.1)
    prox = beh + b.valid(-0.6, 0.6)
    outs, grads = [], []
    for kind in (None, junk):
        x = b.with_junk(prox, kind).requires_grad_(True)
        w = is_weights(
            x,
            b.with_junk(beh, kind),
            b.mask,
            level=level,
            agg=agg,
            mode=mode,
            low=0.8,
            high=1.25,
            detach=False,
        )
        w.weight.sum().backward()
        assert x.grad is not None
        gate = rejection_mask(x.detach(), b.with_junk(beh, kind), b.mask, level=level, reduce="max", high=1.3)
        outs.append((w.weight.detach(), w.raw.detach(), w.keep, gate))
        grads.append(x.grad)
    for first, second, what in zip(outs[0], outs[1], ("weight", "raw", "keep", "gate"), strict=True):
        assert_exactly_equal(first, second, what=what)
    assert_exactly_equal(grads[0], grads[1], what="grad")
    assert bool((grads[0][~b.mask] == 0).all()), "no gradient reaches padded log-probs"
    assert math.isfinite(float(grads[0].abs().sum()))
