"""Unit tests of refppo/core/aggregate.py: hand-worked examples and every validation error path."""

from __future__ import annotations

import re

import pytest
import torch

from refppo.core.aggregate import aggregate_loss, aggregate_loss_naive
from refppo.errors import ConventionError, HyperparameterError, ShapeError

NAN = float("nan")
# Row 0: losses 1, 2 (one padded slot); row 1: loss 3 (two padded slots). T = 3.
L = torch.tensor([[1.0, 2.0, NAN], [3.0, NAN, 1e30]], dtype=torch.float64)
M = torch.tensor([[1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 2.0),  # (1 + 2 + 3)/3
        ("seq-mean-token-mean", 2.25),  # (1.5 + 3)/2
        ("seq-mean-token-sum", 3.0),  # (3 + 3)/2
        ("seq-mean-token-sum-norm", 1.0),  # (3/T + 3/T)/B = (1 + 1)/2
    ],
)
def test_aggregation_modes_hand_example(mode: str, expected: float) -> None:
    assert aggregate_loss(L, M, mode).item() == pytest.approx(expected, abs=1e-15)
    assert aggregate_loss_naive(L, M, mode).item() == pytest.approx(expected, abs=1e-15)


def test_explicit_normalisers_hand_example() -> None:
    assert aggregate_loss(L, M, "token-mean", token_count=4.0).item() == 1.5  # 6/4
    assert aggregate_loss(L, M, "seq-mean-token-mean", seq_count=3.0).item() == 1.5  # 4.5/3
    assert aggregate_loss(L, M, "seq-mean-token-sum", seq_count=4.0).item() == 1.5  # 6/4
    assert aggregate_loss(L, M, "seq-mean-token-sum-norm", horizon=4.0).item() == 0.75  # (3/4 + 3/4)/2
    assert aggregate_loss(L, M, "seq-mean-token-sum-norm", seq_count=4.0).item() == 0.5  # (1 + 1)/4


def test_seq_mean_token_sum_norm_is_a_mean_over_sequences() -> None:
    # Dr. GRPO as verl 0.9.1 agg_loss and SkyRL-train 0.3.1 reduce_loss compute it: each row's
    # token sum over the constant H, then the mean over the B rows — not Σ_bt m·L / H (B times
    # larger). Four identical rows of loss 1 on 2 of 4 positions: each row 2/4, mean 0.5.
    loss = torch.ones(4, 4, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0]] * 4)
    for fn in (aggregate_loss, aggregate_loss_naive):
        assert fn(loss, mask, "seq-mean-token-sum-norm").item() == 0.5
        assert fn(loss, mask, "seq-mean-token-sum-norm", horizon=8.0).item() == 0.25  # 2/8
        # a micro-batch of 1 row with the global count 4: a quarter of the full loss
        assert fn(loss[:1], mask[:1], "seq-mean-token-sum-norm", seq_count=4.0, horizon=4.0).item() == 0.125


def test_mean_of_micro_batch_means_is_not_the_token_mean() -> None:
    # The bug class of verl #5625: micro-batches {row 0}, {row 1} have means 1.5 and 3; their average
    # 2.25 is not the token mean 2. With the global token count 3 each micro loss is 3/3 and 3/3: sum 2.
    means = [aggregate_loss(L[i : i + 1], M[i : i + 1]).item() for i in (0, 1)]
    assert sum(means) / 2 == 2.25
    exact = [aggregate_loss(L[i : i + 1], M[i : i + 1], token_count=3.0).item() for i in (0, 1)]
    assert sum(exact) == 2.0


def test_unknown_mode_lists_valid_names() -> None:
    with pytest.raises(
        ConventionError,
        match=re.escape(
            "loss_agg: unknown name 'sum'; valid names are 'token-mean', 'seq-mean-token-mean', "
            "'seq-mean-token-sum', 'seq-mean-token-sum-norm'"
        ),
    ):
        aggregate_loss(L, M, "sum")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "token-mean", "token_count": 0.0}, "token_count: expected a finite number > 0, got 0.0"),
        (
            {"mode": "seq-mean-token-sum", "seq_count": -1.0},
            "seq_count: expected a finite number > 0, got -1.0",
        ),
        (
            {"mode": "seq-mean-token-sum-norm", "horizon": float("inf")},
            "horizon: expected a finite number > 0, got inf",
        ),
    ],
)
def test_invalid_normalisers_are_rejected(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(HyperparameterError, match=message):
        aggregate_loss(L, M, **kwargs)  # type: ignore[arg-type]  # parametrized kwargs


def test_loss_matrix_with_wrong_shape_names_the_tensor() -> None:
    with pytest.raises(
        ShapeError, match=r"loss_mat: expected shape \[B, T\] = \[2, 3\] \(batch, resp\), got \[3, 2\]"
    ):
        aggregate_loss(L.T, M)
