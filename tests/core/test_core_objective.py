"""Unit tests of refppo/core/objective.py: hand-worked examples and every validation error path."""

from __future__ import annotations

import math

import pytest
import torch

from refppo.core.objective import entropy_bonus, kl_loss, total_loss, total_loss_naive
from refppo.errors import HyperparameterError


def _s(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def test_total_loss_hand_example() -> None:
    # pg 1 + 0.1·vf 2 − 0.01·H 3 + 0.2·kl 0.5 + 0.5·ptx 4 = 1 + 0.2 − 0.03 + 0.1 + 2 = 3.27.
    coefs = {"vf_coef": 0.1, "ent_coef": 0.01, "kl_coef": 0.2, "ptx_coef": 0.5}
    assert total_loss(_s(1.0), _s(2.0), _s(3.0), _s(0.5), _s(4.0), **coefs).item() == pytest.approx(
        3.27, abs=1e-14
    )
    assert total_loss_naive(1.0, 2.0, 3.0, 0.5, 4.0, **coefs) == pytest.approx(3.27, abs=1e-14)
    # Missing terms count 0: pg 1 − 0.01·3 = 0.97.
    assert total_loss(_s(1.0), entropy=_s(3.0), ent_coef=0.01).item() == pytest.approx(0.97, abs=1e-14)


def test_entropy_bonus_is_subtracted() -> None:
    # More entropy lowers the loss: H = 2 with ent_coef 0.5 -> 0 − 1 = −1.
    h = entropy_bonus(torch.tensor([[2.0, 2.0]], dtype=torch.float64), torch.tensor([[1, 1]]))
    assert total_loss(_s(0.0), entropy=h, ent_coef=0.5).item() == -1.0


def test_kl_loss_hand_example() -> None:
    # Default estimator k3 with d = logp − logp_ref = 1: e^−1 + 1 − 1 = e^−1 = 0.3678794; d = 0: 0.
    # token-mean over 2 valid tokens: e^−1/2 = 0.1839397 (float64: to a few ulps).
    lp = torch.tensor([[-1.0, -3.0, float("nan")]], dtype=torch.float64)
    lr = torch.tensor([[-2.0, -3.0, 0.0]], dtype=torch.float64)
    assert kl_loss(lp, lr, torch.tensor([[1, 1, 0]])).item() == pytest.approx(math.exp(-1.0) / 2, abs=1e-15)


@pytest.mark.parametrize("name", ["vf_coef", "ent_coef", "kl_coef", "ptx_coef"])
def test_negative_coefficients_are_rejected(name: str) -> None:
    with pytest.raises(HyperparameterError, match=f"{name}: expected a finite number >= 0, got -1.0"):
        total_loss(_s(0.0), **{name: -1.0})


# ----- normalisers and clamps reach the aggregation (found by tools/mutate.py: dropping them survived)


def test_entropy_bonus_passes_its_normalisers_to_the_aggregation() -> None:
    """Row 0: H = (1, 2), row 1: H = (3, pad). Valid sum 6 over 3 tokens.

    - token-mean with a global ``token_count=12`` (micro-batch of a larger step): 6/12 = 0.5
      (without the normaliser: 6/3 = 2);
    - seq-mean-token-sum-norm with ``horizon=4`` and ``seq_count=4``: (3/4 + 3/4)/4 = 0.375
      (without them: (3/2 + 3/2)/2 = 1.5 with H = T = 2)."""
    ent = torch.tensor([[1.0, 2.0], [3.0, float("nan")]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, False]])
    assert float(entropy_bonus(ent, mask, "token-mean", token_count=12.0)) == 0.5
    got = entropy_bonus(ent, mask, "seq-mean-token-sum-norm", horizon=4.0, seq_count=4.0)
    assert float(got) == 0.375


def test_kl_loss_applies_the_log_ratio_clamp() -> None:
    """k1 of d = log π − log π_ref = 5 clamped to [−1, 1] is 1 (unclamped: 5); the padded token
    (NaN) is never read; token-mean over the one valid token."""
    logp = torch.tensor([[5.0, float("nan")]], dtype=torch.float64)
    ref = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, False]])
    assert float(kl_loss(logp, ref, mask, "k1", "token-mean", log_ratio_clamp=(-1.0, 1.0))) == 1.0
    assert float(kl_loss(logp, ref, mask, "k1", "token-mean")) == 5.0
    assert float(kl_loss(logp, ref, mask, "k1", "token-mean", value_clamp=2.0)) == 2.0


def test_kl_loss_passes_its_normalisers_to_the_aggregation() -> None:
    """k1 of d = (1, 2) on one row, token-mean with a global ``token_count=6``: 3/6 = 0.5 (without
    the normaliser 3/2 = 1.5)."""
    logp = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    ref = torch.zeros(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    assert float(kl_loss(logp, ref, mask, "k1", "token-mean", token_count=6.0)) == 0.5
