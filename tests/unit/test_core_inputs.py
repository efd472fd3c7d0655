"""Bad input to the core that used to pass silently: now a clear error naming what is wrong."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from refppo.core import masked_mean, masked_sum, token_rewards
from refppo.errors import DtypeError, ShapeError


@pytest.mark.parametrize("fn", [masked_sum, masked_mean])
def test_masked_reduction_over_the_batch_axis_is_rejected(fn: Callable[..., torch.Tensor]) -> None:
    # dim=0 would reduce over sequences (and masked_mean would divide by 0 on an all-padding column)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    with pytest.raises(ShapeError, match=r"dim: expected None .* got 0"):
        fn(torch.zeros(2, 3), mask, dim=0)
    assert torch.equal(masked_sum(torch.ones(2, 3), mask, dim=1), torch.tensor([2.0, 1.0]))


def test_token_rewards_refuse_a_kl_of_another_dtype() -> None:
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(DtypeError, match=r"scores=torch.float32, kl=torch.float64"):
        token_rewards(torch.zeros(2), torch.zeros(2, 3, dtype=torch.float64), mask, 0.1)


def test_empty_batch_is_rejected() -> None:
    with pytest.raises(ShapeError, match=r"at least one sequence \(B >= 1\), got shape \[0, 3\]"):
        masked_mean(torch.zeros(0, 3), torch.ones(0, 3, dtype=torch.bool))
