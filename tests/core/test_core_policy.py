"""Unit tests of refppo/core/policy.py: hand-worked examples and every validation error path."""

from __future__ import annotations

import math
import re

import pytest
import torch

from refppo.core.policy import clipped_policy_loss, clipped_policy_loss_naive, policy_ratio
from refppo.errors import ConventionError, DtypeError, HyperparameterError, ShapeError

# Four tokens (ε = 0.2) and one padded position; logp_old = 0 so ρ = exp(logp):
#   (A= 1, ρ=1.5): L1 = −1.5, L2 = −1·1.2 = −1.2 -> ℓ = −1.2  (clipped, L2 > L1)
#   (A=−1, ρ=0.5): L1 =  0.5, L2 =  1·0.8 =  0.8 -> ℓ =  0.8  (clipped, L2 > L1)
#   (A= 2, ρ=0.9): L1 = L2 = −1.8                  -> ℓ = −1.8  (inside)
#   (A=−1, ρ=4.0): L1 =  4.0, L2 =  1.2           -> ℓ =  4.0  (pessimistic: unclipped);
#                  with dual-clip c = 3: min(4, 3) -> ℓ = 3.0
# token-mean: (−1.2 + 0.8 − 1.8 + 4)/4 = 0.45; with dual-clip (−1.2 + 0.8 − 1.8 + 3)/4 = 0.2.
# clipfrac = 2/4; clipfrac_lower (dual) = 1/4.
# approx_kl = mean(logp_old − logp) = −(ln 1.5 + ln 0.5 + ln 0.9 + ln 4)/4
#           = −(0.4054651 − 0.6931472 − 0.1053605 + 1.3862944)/4 = −0.2483130  (= −ln(2.7)/4).
# approx_kl_k2 = ½·mean(d²) = (0.4054651² + 0.6931472² + 0.1053605² + 1.3862944²)/8
#              = (0.1644020 + 0.4804530 + 0.0111008 + 1.9218121)/8 = 2.5777679/8 = 0.3222210.
RATIOS = [1.5, 0.5, 0.9, 4.0]
LOGP = torch.tensor([[*(math.log(r) for r in RATIOS), float("nan")]], dtype=torch.float64)
LOGP_OLD = torch.tensor([[0.0, 0.0, 0.0, 0.0, float("inf")]], dtype=torch.float64)
ADV = torch.tensor([[1.0, -1.0, 2.0, -1.0, float("nan")]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 1, 0]])


def test_clipped_loss_hand_example() -> None:
    out = clipped_policy_loss(LOGP, LOGP_OLD, ADV, MASK, clip_low=0.2)
    assert out.per_token[0].tolist() == pytest.approx([-1.2, 0.8, -1.8, 4.0, 0.0], abs=1e-12)
    assert out.loss.item() == pytest.approx(0.45, abs=1e-12)
    assert out.clipfrac.item() == 0.5
    assert out.clipfrac_lower.item() == 0.0
    assert out.approx_kl.item() == pytest.approx(-math.log(2.7) / 4, abs=1e-15)
    lns = [math.log(r) for r in RATIOS]
    assert out.approx_kl_k2.item() == pytest.approx(sum(x * x for x in lns) / 8, abs=1e-15)
    naive = clipped_policy_loss_naive(LOGP, LOGP_OLD, ADV, MASK, clip_low=0.2)
    assert naive.loss == pytest.approx(0.45, abs=1e-12)


def test_dual_clip_hand_example() -> None:
    out = clipped_policy_loss(LOGP, LOGP_OLD, ADV, MASK, clip_low=0.2, dual_clip=3.0)
    assert out.per_token[0].tolist() == pytest.approx([-1.2, 0.8, -1.8, 3.0, 0.0], abs=1e-12)
    assert out.loss.item() == pytest.approx(0.2, abs=1e-12)
    assert out.clipfrac_lower.item() == 0.25


def test_asymmetric_clip_hand_example() -> None:
    # clip_low = 0.2, clip_high = 0.6 (DAPO "clip-higher"): (A=1, ρ=1.5) is now inside -> ℓ = −1.5.
    out = clipped_policy_loss(LOGP, LOGP_OLD, ADV, MASK, clip_low=0.2, clip_high=0.6)
    assert out.per_token[0, 0].item() == pytest.approx(-1.5, abs=1e-12)


def test_gradient_hand_example() -> None:
    # Token-mean over N = 4: ∂loss/∂logp_t = −A_t·ρ_t/4 on unclipped tokens, 0 on clipped ones:
    #   (−1.2: clipped) 0; (0.8: clipped) 0; (inside) −2·0.9/4 = −0.45; (4.0: unclipped) 1·4/4 = 1.0.
    logp = LOGP.clone().requires_grad_(True)
    clipped_policy_loss(logp, LOGP_OLD, ADV, MASK).loss.backward()
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([0.0, 0.0, -0.45, 1.0, 0.0], abs=1e-12)


def test_policy_ratio_log_ratio_clamp_hand_example() -> None:
    # log ρ = ln 4 = 1.386 clamped to 1 -> ρ = e = 2.7182818.
    r = policy_ratio(LOGP, LOGP_OLD, MASK, log_ratio_clamp=1.0)
    assert r[0].tolist() == pytest.approx([1.5, 0.5, 0.9, math.e, 0.0], abs=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clip_low": 1.5}, r"clip_low: expected a number in \[0, 1\], got 1.5"),
        ({"clip_low": -0.1}, "clip_low: expected a finite number >= 0, got -0.1"),
        ({"clip_high": -0.2}, "clip_high: expected a finite number >= 0, got -0.2"),
        ({"dual_clip": 0.5}, r"dual_clip: expected a constant c > 1 \(or None\), got 0.5"),
        ({"dual_clip": float("inf")}, r"dual_clip: expected a constant c > 1 \(or None\), got inf"),
        ({"log_ratio_clamp": 0.0}, "log_ratio_clamp: expected a finite number > 0, got 0.0"),
        ({"token_count": 0.0}, "token_count: expected a finite number > 0, got 0.0"),
    ],
)
def test_invalid_policy_hyperparameters_are_rejected(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(HyperparameterError, match=message):
        clipped_policy_loss(LOGP, LOGP_OLD, ADV, MASK, **kwargs)  # type: ignore[arg-type]  # parametrized kwargs


def test_unknown_aggregation_lists_valid_names() -> None:
    with pytest.raises(
        ConventionError, match=re.escape("loss_agg: unknown name 'mean'; valid names are 'token-mean', ")
    ):
        clipped_policy_loss(LOGP, LOGP_OLD, ADV, MASK, agg="mean")


def test_advantages_with_wrong_shape_name_the_tensor() -> None:
    with pytest.raises(
        ShapeError, match=r"advantages: expected shape \[B, T\] = \[1, 5\] \(batch, resp\), got \[5\]"
    ):
        clipped_policy_loss(LOGP, LOGP_OLD, ADV[0], MASK)


def test_integer_logprobs_are_rejected() -> None:
    with pytest.raises(
        DtypeError, match=re.escape("logp: expected a floating-point tensor, got dtype torch.int64")
    ):
        clipped_policy_loss(torch.zeros(1, 5, dtype=torch.long), LOGP_OLD, ADV, MASK)


def test_mixed_dtypes_are_rejected() -> None:
    with pytest.raises(DtypeError, match=re.escape("got logp=torch.float64, logp_old=torch.float32")):
        clipped_policy_loss(LOGP, LOGP_OLD.float(), ADV, MASK)
    with pytest.raises(DtypeError, match=re.escape("got logp=torch.float64, advantages=torch.float32")):
        clipped_policy_loss(LOGP, LOGP_OLD, ADV.float(), MASK)
