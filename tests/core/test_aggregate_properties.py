"""Properties of loss aggregation (refppo/core/aggregate.py), incl. micro-batch exactness."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import Ragged, assert_exactly_equal, assert_twin_close, ragged_batches

from refppo.agg_conventions import MASK_AGGS
from refppo.conventions import LossAgg
from refppo.core.aggregate import aggregate_loss, aggregate_loss_naive
from refppo.core.policy import clipped_policy_loss
from refppo.core.value import value_loss

pytestmark = pytest.mark.property

aggs = st.sampled_from(list(MASK_AGGS))


@given(ragged_batches(), aggs, st.booleans())
def test_aggregate_loss_matches_naive(b: Ragged, agg: LossAgg, global_counts: bool) -> None:
    x = b.floats(-3.0, 3.0)
    kw = {"token_count": 1000.0, "seq_count": 37.0, "horizon": 128.0} if global_counts else {}
    assert_twin_close(
        aggregate_loss(x, b.mask, agg, **kw), aggregate_loss_naive(x, b.mask, agg, **kw), b.dtype, agg.value
    )


@given(ragged_batches(), aggs, st.sampled_from(["nan", "inf", "-inf", "huge", "mixed"]))
def test_aggregate_loss_padding_invariant(b: Ragged, agg: LossAgg, other_junk: str) -> None:
    x = b.valid(-3.0, 3.0)
    assert_exactly_equal(
        aggregate_loss(b.with_junk(x), b.mask, agg), aggregate_loss(b.with_junk(x, other_junk), b.mask, agg)
    )


@given(ragged_batches(), aggs)
def test_aggregate_loss_batch_permutation_invariant(b: Ragged, agg: LossAgg) -> None:
    x = b.floats(-3.0, 3.0)
    perm = torch.randperm(b.B, generator=b.gen)
    assert_twin_close(
        aggregate_loss(x[perm], b.mask[perm], agg), aggregate_loss(x, b.mask, agg), b.dtype, agg.value
    )


def _splits(b: Ragged, n_micro: int) -> list[torch.Tensor]:
    """Row index sets of a random split of the batch into n_micro non-empty micro-batches."""
    perm = torch.randperm(b.B, generator=b.gen)
    n = min(n_micro, b.B)
    cuts = sorted(torch.randperm(b.B - 1, generator=b.gen)[: n - 1].add(1).tolist())
    return [perm[s:e] for s, e in zip([0, *cuts], [*cuts, b.B], strict=True)]


@given(ragged_batches(min_B=2, dtypes=(torch.float64,)), aggs, st.integers(2, 6))
def test_micro_batch_sum_equals_full_batch_loss(b: Ragged, agg: LossAgg, n_micro: int) -> None:
    # Passing the GLOBAL token/sequence counts (and the full-batch horizon) to every micro-batch
    # makes Σ_micro loss == full-batch loss, for every LossAgg mode (verl issue #5625).
    lp_old, adv = b.floats(-5.0, -0.01), b.floats(-2.0, 2.0)
    lp = b.with_junk(lp_old + b.valid(-0.5, 0.5))
    v_old, ret = b.floats(-2.0, 2.0), b.floats(-2.0, 2.0)
    v = b.with_junk(v_old + b.valid(-0.5, 0.5))
    x = b.floats(-3.0, 3.0)
    n_tok, n_seq, horizon = float(b.n_valid), float(b.B), float(b.T)
    full_agg = aggregate_loss(x, b.mask, agg)
    full_pg = clipped_policy_loss(lp, lp_old, adv, b.mask, agg=agg, dual_clip=3.0).loss
    full_vf = value_loss(v, v_old, ret, b.mask, agg=agg).loss
    sum_agg = sum_pg = sum_vf = torch.zeros((), dtype=b.dtype)
    for rows in _splits(b, n_micro):
        m = b.mask[rows]
        sum_agg = sum_agg + aggregate_loss(
            x[rows], m, agg, token_count=n_tok, seq_count=n_seq, horizon=horizon
        )
        sum_pg = (
            sum_pg
            + clipped_policy_loss(
                lp[rows],
                lp_old[rows],
                adv[rows],
                m,
                agg=agg,
                dual_clip=3.0,
                token_count=n_tok,
                seq_count=n_seq,
                horizon=horizon,
            ).loss
        )
        sum_vf = (
            sum_vf
            + value_loss(
                v[rows],
                v_old[rows],
                ret[rows],
                m,
                agg=agg,
                token_count=n_tok,
                seq_count=n_seq,
                horizon=horizon,
            ).loss
        )
    assert_twin_close(sum_agg, full_agg, b.dtype, "aggregate_loss")
    assert_twin_close(sum_pg, full_pg, b.dtype, "clipped_policy_loss")
    assert_twin_close(sum_vf, full_vf, b.dtype, "value_loss")
