"""Bad input to the core that used to pass silently: now a clear error naming what is wrong."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from refppo.core.kl import token_kl
from refppo.core.masked import masked_mean, masked_sum, masked_whiten
from refppo.core.rewards import token_rewards
from refppo.errors import DtypeError, HyperparameterError, ShapeError
from refppo.train.kl_controller import AdaptiveKLController, FixedKLController


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


@pytest.mark.parametrize("clamp", [(math.nan, None), (None, math.inf), (-math.inf, 1.0)])
def test_non_finite_kl_clamp_bounds_are_rejected(clamp: tuple[float | None, float | None]) -> None:
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    lr = torch.tensor([[-2.0, -1.0]], dtype=torch.float64)
    with pytest.raises(HyperparameterError, match=r"log_ratio_clamp: (lo|hi) must be finite or None"):
        token_kl(lp, lr, torch.ones(1, 2, dtype=torch.bool), "k1", log_ratio_clamp=clamp)
    with pytest.raises(HyperparameterError, match=r"value_clamp"):
        token_kl(lp, lr, torch.ones(1, 2, dtype=torch.bool), "k1", value_clamp=math.inf)


@pytest.mark.parametrize("eps", [-1.0, math.nan])
def test_whitening_eps_must_be_finite_and_non_negative(eps: float) -> None:
    x = torch.tensor([[1.0, 1.000001]], dtype=torch.float64)
    with pytest.raises(HyperparameterError, match=r"eps: expected a finite number >= 0"):
        masked_whiten(x, torch.ones(1, 2, dtype=torch.bool), eps=eps)


def test_kl_controller_state_is_validated_on_load() -> None:
    ada = AdaptiveKLController(0.1, 6.0, 10000.0)
    with pytest.raises(HyperparameterError, match=r"kl_coef: expected a finite β"):
        ada.load_state_dict({"value": math.nan})
    assert ada.value == 0.1  # unchanged after the refused load
    fixed = FixedKLController(0.1)
    with pytest.raises(HyperparameterError):
        fixed.load_state_dict({"value": -1.0})
    fixed.load_state_dict({"value": 0.2})
    assert fixed.value == 0.2
