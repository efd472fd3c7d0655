"""Unit tests of refppo/core/masked.py: hand-worked examples and every validation error path."""

from __future__ import annotations

import math
import re

import pytest
import torch

from refppo.core.masked import masked_mean, masked_sum, masked_var, masked_whiten
from refppo.errors import DtypeError, MaskError, ShapeError

NAN = float("nan")
# Two rows: valid values 1, 2 | 4; padding holds NaN and inf.
X = torch.tensor([[1.0, 2.0, NAN], [4.0, float("inf"), NAN]], dtype=torch.float64)
M = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_masked_sum_and_mean_hand_example() -> None:
    # valid values 1, 2, 4: sum 7, mean 7/3; per row: sums 3 and 4, means 1.5 and 4.
    assert float(masked_sum(X, M)) == 7.0
    assert masked_sum(X, M, dim=-1).tolist() == [3.0, 4.0]
    assert float(masked_mean(X, M)) == pytest.approx(7 / 3, abs=1e-15)
    assert masked_mean(X, M, dim=-1).tolist() == [1.5, 4.0]


def test_masked_var_hand_example() -> None:
    # mean 7/3; deviations −4/3, −1/3, 5/3; squares 16/9 + 1/9 + 25/9 = 42/9 = 14/3.
    # unbiased: (14/3)/2 = 7/3; population: (14/3)/3 = 14/9.
    assert float(masked_var(X, M)) == pytest.approx(7 / 3, abs=1e-14)
    assert float(masked_var(X, M, unbiased=False)) == pytest.approx(14 / 9, abs=1e-14)


def test_masked_whiten_hand_example() -> None:
    # valid values 1, 3: mean 2, unbiased variance ((−1)² + 1²)/1 = 2 -> (x − 2)/sqrt(2 + 1e-8).
    x = torch.tensor([[1.0, NAN], [3.0, 5.0]], dtype=torch.float64)
    m = torch.tensor([[True, False], [True, False]])
    s = 1 / math.sqrt(2 + 1e-8)
    assert masked_whiten(x, m).flatten().tolist() == pytest.approx([-s, 0.0, s, 0.0], abs=1e-15)
    # shift_mean=False adds the mean back: 2 ∓ 1/sqrt(2).
    assert masked_whiten(x, m, shift_mean=False).flatten().tolist() == pytest.approx([2 - s, 0.0, 2 + s, 0.0])


def test_mask_with_values_other_than_0_1_is_rejected() -> None:
    with pytest.raises(MaskError, match=r"mask: expected only 0/1 values, found 2\.0 at position \[0, 1\]"):
        masked_mean(X, torch.tensor([[1, 2, 0], [1, 0, 0]]))


def test_mask_with_nonfinite_float_entries_is_rejected() -> None:
    with pytest.raises(
        MaskError, match=re.escape("mask: expected only 0/1 values, found non-finite entries")
    ):
        masked_sum(X, torch.tensor([[1.0, NAN, 0.0], [1.0, 0.0, 0.0]]))


def test_mask_row_without_valid_token_is_rejected() -> None:
    with pytest.raises(MaskError, match=r"mask: rows \[1\] have no valid token"):
        masked_mean(X, torch.tensor([[1, 1, 0], [0, 0, 0]]))


def test_mask_with_wrong_number_of_dims_is_rejected() -> None:
    with pytest.raises(ShapeError, match=r"mask: expected 2 dims \[B, T\] \(batch, resp\), got shape \[6\]"):
        masked_sum(X.flatten(), M.flatten())


def test_mask_with_zero_response_positions_is_rejected() -> None:
    with pytest.raises(
        ShapeError, match=r"mask: expected at least one response position \(T >= 1\), got shape \[2, 0\]"
    ):
        masked_sum(torch.zeros(2, 0), torch.zeros(2, 0, dtype=torch.bool))


def test_mask_that_is_not_a_tensor_is_rejected() -> None:
    with pytest.raises(MaskError, match=re.escape("mask: expected a torch.Tensor, got list")):
        masked_sum(X, [[1, 1, 0], [1, 0, 0]])  # type: ignore[arg-type]  # the error path under test


def test_x_with_wrong_shape_names_tensor_and_shapes() -> None:
    with pytest.raises(
        ShapeError, match=r"x: expected shape \[B, T\] = \[2, 3\] \(batch, resp\), got \[2, 4\]"
    ):
        masked_mean(torch.zeros(2, 4), M)


def test_integer_x_is_rejected() -> None:
    with pytest.raises(
        DtypeError, match=re.escape("x: expected a floating-point tensor, got dtype torch.int64")
    ):
        masked_sum(torch.ones(2, 3, dtype=torch.int64), M)


def test_unbiased_variance_of_one_token_is_rejected() -> None:
    with pytest.raises(
        MaskError, match=re.escape("an unbiased variance needs at least 2 valid tokens, got 1")
    ):
        masked_var(X[:1], torch.tensor([[1, 0, 0]]))
    with pytest.raises(MaskError, match=re.escape("at least 2 valid tokens")):
        masked_whiten(X[:1], torch.tensor([[1, 0, 0]]))
