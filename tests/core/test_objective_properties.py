"""Properties of the objective terms (refppo/core/objective.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import Ragged, assert_exactly_equal, assert_twin_close, ragged_batches

from refppo.agg_conventions import MASK_AGGS
from refppo.conventions import KLEstimator, LossAgg
from refppo.core.aggregate import aggregate_loss
from refppo.core.kl import token_kl
from refppo.core.objective import (
    entropy_bonus,
    entropy_bonus_naive,
    kl_loss,
    kl_loss_naive,
    total_loss,
    total_loss_naive,
)

pytestmark = pytest.mark.property

aggs = st.sampled_from(list(MASK_AGGS))
coef = st.floats(0.0, 2.0)


@given(ragged_batches(), aggs)
def test_entropy_bonus_matches_naive(b: Ragged, agg: LossAgg) -> None:
    ent = b.floats(0.0, 4.0)
    assert_twin_close(
        entropy_bonus(ent, b.mask, agg), entropy_bonus_naive(ent, b.mask, agg), b.dtype, agg.value
    )


@given(ragged_batches(), st.sampled_from(list(KLEstimator)), aggs)
def test_kl_loss_matches_naive(b: Ragged, est: KLEstimator, agg: LossAgg) -> None:
    lp, lr = b.floats(-6.0, -0.01), b.floats(-6.0, -0.01)
    got = kl_loss(lp, lr, b.mask, est, agg, value_clamp=10.0)
    assert_twin_close(got, kl_loss_naive(lp, lr, b.mask, est, agg, value_clamp=10.0), b.dtype, est.value)
    # kl_loss is exactly agg(token_kl): the composition, not a re-derivation.
    assert_exactly_equal(got, aggregate_loss(token_kl(lp, lr, b.mask, est, value_clamp=10.0), b.mask, agg))


@given(
    st.lists(st.one_of(st.none(), st.floats(-10.0, 10.0)), min_size=4, max_size=4),
    st.floats(-10.0, 10.0),
    coef,
    coef,
    coef,
    coef,
    st.sampled_from([torch.float32, torch.float64]),
)
def test_total_loss_matches_naive(
    terms: list[float | None],
    pg: float,
    vf_coef: float,
    ent_coef: float,
    kl_coef: float,
    ptx_coef: float,
    dtype: torch.dtype,
) -> None:
    coefs = {"vf_coef": vf_coef, "ent_coef": ent_coef, "kl_coef": kl_coef, "ptx_coef": ptx_coef}
    tensors = [None if t is None else torch.tensor(t, dtype=dtype) for t in terms]
    got = total_loss(torch.tensor(pg, dtype=dtype), *tensors, **coefs)
    want = total_loss_naive(
        float(torch.tensor(pg, dtype=dtype)), *[None if t is None else float(t) for t in tensors], **coefs
    )
    assert_twin_close(got, torch.tensor(want, dtype=torch.float64), dtype, "total_loss")
