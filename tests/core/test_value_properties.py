"""Properties of the value loss (refppo/core/value.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import Ragged, assert_exactly_equal, assert_twin_close, ragged_batches

from refppo.agg_conventions import MASK_AGGS
from refppo.conventions import LossAgg, ValueClipForm, ValueLoss
from refppo.core.value import value_loss, value_loss_naive

pytestmark = pytest.mark.property

kinds = st.sampled_from(list(ValueLoss))
aggs = st.sampled_from(list(MASK_AGGS))
clips = st.sampled_from([0.2, 0.5, 0.0, 10.0])


def _inputs(b: Ragged) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    v_old = b.floats(-2.0, 2.0)
    v = b.with_junk(v_old + b.valid(-1.0, 1.0))
    return v, v_old, b.floats(-3.0, 3.0)


@given(ragged_batches(), kinds, aggs, clips)
def test_value_loss_matches_naive(b: Ragged, kind: ValueLoss, agg: LossAgg, clip: float) -> None:
    v, v_old, ret = _inputs(b)
    got = value_loss(v, v_old, ret, b.mask, clip=clip, kind=kind, agg=agg)
    want = value_loss_naive(v, v_old, ret, b.mask, clip=clip, kind=kind, agg=agg)
    assert_twin_close(got.loss, torch.tensor(want.loss, dtype=torch.float64), b.dtype, "loss")
    assert_twin_close(got.per_token, torch.tensor(want.per_token, dtype=torch.float64), b.dtype, "per_token")
    if b.dtype == torch.float64:
        assert abs(float(got.clipfrac) - want.clipfrac) < 1e-12


@given(ragged_batches(), aggs, clips, st.sampled_from(list(ValueClipForm)))
def test_value_loss_matches_naive_for_each_clip_form(
    b: Ragged, agg: LossAgg, clip: float, form: ValueClipForm
) -> None:
    v, v_old, ret = _inputs(b)
    got = value_loss(v, v_old, ret, b.mask, clip=clip, agg=agg, clip_form=form)
    want = value_loss_naive(v, v_old, ret, b.mask, clip=clip, agg=agg, clip_form=form)
    assert_twin_close(got.loss, torch.tensor(want.loss, dtype=torch.float64), b.dtype, "loss")
    assert_twin_close(got.per_token, torch.tensor(want.per_token, dtype=torch.float64), b.dtype, "per_token")
    if b.dtype == torch.float64:  # the twin computes in float64: the same roundings only there
        assert abs(float(got.clipfrac) - want.clipfrac) < 1e-12


@given(ragged_batches(), kinds, aggs, st.sampled_from(["nan", "inf", "-inf", "huge", "mixed"]))
def test_value_loss_padding_invariant(b: Ragged, kind: ValueLoss, agg: LossAgg, other_junk: str) -> None:
    v_old, ret = b.valid(-2.0, 2.0), b.valid(-3.0, 3.0)
    v = v_old + b.valid(-1.0, 1.0)
    outs, grads = [], []
    for junk in (None, other_junk):
        x = b.with_junk(v, junk).requires_grad_(True)
        res = value_loss(x, b.with_junk(v_old, junk), b.with_junk(ret, junk), b.mask, kind=kind, agg=agg)
        res.loss.backward()
        assert x.grad is not None
        outs.append(res)
        grads.append(x.grad)
    for name in ("loss", "per_token", "clipfrac"):
        assert_exactly_equal(getattr(outs[0], name), getattr(outs[1], name), what=name)
    assert_exactly_equal(grads[0], grads[1], what="grad")
    assert bool((grads[0][~b.mask] == 0).all())


@given(ragged_batches(), kinds)
def test_value_loss_batch_permutation_equivariant(b: Ragged, kind: ValueLoss) -> None:
    v, v_old, ret = _inputs(b)
    perm = torch.randperm(b.B, generator=b.gen)
    a = value_loss(v, v_old, ret, b.mask, kind=kind)
    p = value_loss(v[perm], v_old[perm], ret[perm], b.mask[perm], kind=kind)
    assert_exactly_equal(p.per_token, a.per_token[perm], what="per_token")
    assert_twin_close(p.loss, a.loss, b.dtype, "loss (summation order only)")


@given(ragged_batches(dtypes=(torch.float64,)))
def test_clipped_value_loss_is_at_least_unclipped_and_equal_without_movement(b: Ragged) -> None:
    v, v_old, ret = _inputs(b)
    clipped = value_loss(v, v_old, ret, b.mask, clip=0.2).per_token
    unclipped = value_loss(v, v_old, ret, b.mask, kind="unclipped").per_token
    assert bool((clipped >= unclipped).all()), "½·max(e1, e2) ≥ ½·e1"
    # With V == V_old the clip is inactive: clipped == unclipped == ½(V_old − R)² exactly.
    same = value_loss(v_old, v_old, ret, b.mask, clip=0.2).per_token
    expected = torch.where(b.mask, 0.5 * (v_old - ret) ** 2, torch.zeros((), dtype=b.dtype))
    assert_exactly_equal(same, expected, what="no movement")
