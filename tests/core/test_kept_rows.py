"""Rows masked out of the loss but kept in the row count (issue #23 item 5; TRL 1.16.0
``mask_truncated_completions``): :func:`refppo.core.masked.kept_rows_aggregate` against a hand-worked
vector, its naive twin, its gradient twin, TRL's formulas written out here, and ``aggregate_loss``
when every row is in the loss."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import Ragged, assert_twin_close, ragged_batches

from refppo.agg_conventions import MASK_AGGS
from refppo.conventions import LossAgg
from refppo.core.aggregate import aggregate_loss
from refppo.core.masked import kept_rows_aggregate, kept_rows_aggregate_naive, kept_rows_weights_naive
from refppo.errors import MaskError, ShapeError

M = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
L = torch.tensor([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
IN = torch.tensor([True, False, True])
# row 1 out of the loss: kept tokens (1, 2) and (1, 1, 1), row sums 3 and 3, B = 3 (2 when dropped)
HAND = {
    "token-mean": (6 / 5, 6 / 5),
    "seq-mean-token-mean": ((1.5 + 0 + 1) / 3, (1.5 + 1) / 2),
    "seq-mean-token-sum": (6 / 3, 6 / 2),
    "seq-mean-token-sum-norm": (6 / 3 / 3, 6 / 2 / 3),
    "token-sum": (6.0, 6.0),
}


@pytest.mark.parametrize("mode", sorted(HAND))
def test_hand_worked_vector(mode: str) -> None:
    counted, dropped = HAND[mode]
    assert float(kept_rows_aggregate(L, M, IN, mode)) == pytest.approx(counted, rel=1e-15)
    assert float(kept_rows_aggregate(L, M, IN, mode, count_rows=False)) == pytest.approx(dropped, rel=1e-15)


def _in_loss(b: Ragged, bits: list[bool]) -> torch.Tensor:
    return torch.tensor((bits * b.B)[: b.B], dtype=torch.bool)


@settings(deadline=None)
@given(
    ragged_batches(),
    st.sampled_from(list(MASK_AGGS)),
    st.lists(st.booleans(), min_size=1, max_size=5),
    st.booleans(),
)
def test_matches_naive_twin(b: Ragged, agg: LossAgg, bits: list[bool], count_rows: bool) -> None:
    x, keep = b.floats(-3.0, 3.0), _in_loss(b, bits)
    assert_twin_close(
        kept_rows_aggregate(x, b.mask, keep, agg, count_rows=count_rows),
        kept_rows_aggregate_naive(x, b.mask, keep, agg, count_rows=count_rows),
        b.dtype,
        agg.value,
    )


@settings(deadline=None)
@given(
    ragged_batches(dtypes=(torch.float64,)),
    st.sampled_from(list(MASK_AGGS)),
    st.lists(st.booleans(), min_size=1, max_size=5),
)
def test_gradient_is_the_weights_twin(b: Ragged, agg: LossAgg, bits: list[bool]) -> None:
    x = b.valid(-3.0, 3.0).requires_grad_(True)
    keep = _in_loss(b, bits)
    (g,) = torch.autograd.grad(kept_rows_aggregate(x, b.mask, keep, agg), x)
    w = torch.tensor(kept_rows_weights_naive(b.mask, keep, agg), dtype=torch.float64)
    torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-15)
    assert not bool(g[~keep].any())  # a row out of the loss gets no gradient


@settings(deadline=None)
@given(ragged_batches(dtypes=(torch.float64,)), st.lists(st.booleans(), min_size=1, max_size=5))
def test_a_masked_row_changes_the_loss_as_trl_says(b: Ragged, bits: list[bool]) -> None:
    """TRL 1.16.0 ``GRPOTrainer._compute_loss`` over the zeroed ``completion_mask`` m' (written out):
    grpo ``mean_b(Σ_t m'ℓ / max(Σ_t m', 1))``, bnpo/dapo ``Σ m'ℓ / max(Σ m', 1)``, dr_grpo
    ``Σ m'ℓ / (B·T)``."""
    x, keep = b.valid(-3.0, 3.0), _in_loss(b, bits)
    mz = (b.mask & keep.unsqueeze(1)).to(x.dtype)
    trl = {
        LossAgg.SEQ_MEAN_TOKEN_MEAN: ((x * mz).sum(-1) / mz.sum(-1).clamp(min=1.0)).mean(),
        LossAgg.TOKEN_MEAN: (x * mz).sum() / mz.sum().clamp(min=1.0),
        LossAgg.SEQ_MEAN_TOKEN_SUM_NORM: (x * mz).sum() / (b.B * b.T),
    }
    for agg, want in trl.items():
        torch.testing.assert_close(kept_rows_aggregate(x, b.mask, keep, agg), want, rtol=1e-12, atol=1e-14)


@settings(deadline=None)
@given(ragged_batches(), st.sampled_from(list(MASK_AGGS)))
def test_every_row_in_is_the_plain_aggregation(b: Ragged, agg: LossAgg) -> None:
    x = b.floats(-3.0, 3.0)
    every = torch.ones(b.B, dtype=torch.bool)
    torch.testing.assert_close(kept_rows_aggregate(x, b.mask, every, agg), aggregate_loss(x, b.mask, agg))


def test_refusals_name_the_argument() -> None:
    with pytest.raises(ShapeError, match=r"^in_loss: expected shape \[B\] = \[3\]"):
        kept_rows_aggregate(L, M, torch.ones(2, dtype=torch.bool))
    with pytest.raises(MaskError, match=r"^in_loss: expected only 0/1"):
        kept_rows_aggregate(L, M, torch.tensor([1, 2, 0]))
    with pytest.raises(MaskError, match=r"^mask: rows \[1\] have no valid token"):
        kept_rows_aggregate(L, M & torch.tensor([[True], [False], [True]]), IN)
