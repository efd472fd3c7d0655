"""Unit tests of refppo/core/logprobs.py: hand-worked examples and every validation error path."""

from __future__ import annotations

import math
import re

import pytest
import torch
from strategies import assert_twin_close

from refppo.core.logprobs import entropy_from_logits, entropy_from_logits_naive, logprobs_from_logits
from refppo.errors import DtypeError, HyperparameterError, ShapeError

# V = 2 with logits (0, ln 3): softmax = (1/4, 3/4).
LOGITS = torch.tensor([[[0.0, math.log(3.0)], [float("nan"), float("inf")]]], dtype=torch.float64)
MASK = torch.tensor([[True, False]])
# Closed forms of that distribution (float64 inputs, so compared to a few ulps, abs = 1e-15: a
# 7-digit tolerance would pass a float32 downcast, ~1e-8 off, or TRL's τ + 1e-7 divisor, ~1.4e-8 off).
LOG_3_4 = math.log(3 / 4)  # = −0.2876821
LOG_1_4 = math.log(1 / 4)  # = −1.3862944
H_1_4_3_4 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))  # = 0.3465736 + 0.2157616 = 0.5623351


def test_logprobs_hand_example() -> None:
    # log p(token 1) = ln(3/4) = −0.2876821; log p(token 0) = ln(1/4) = −1.3862944; padding -> 0.
    lp1 = logprobs_from_logits(LOGITS, torch.tensor([[1, 99]]), MASK)
    lp0 = logprobs_from_logits(LOGITS, torch.tensor([[0, -5]]), MASK)
    assert lp1[0].tolist() == pytest.approx([LOG_3_4, 0.0], abs=1e-15)
    assert lp0[0].tolist() == pytest.approx([LOG_1_4, 0.0], abs=1e-15)


def test_entropy_hand_example() -> None:
    # H = −(1/4·ln 1/4 + 3/4·ln 3/4) = 0.3465736 + 0.2157616 = 0.5623351.
    assert entropy_from_logits(LOGITS, MASK)[0].tolist() == pytest.approx([H_1_4_3_4, 0.0], abs=1e-15)


def test_temperature_divides_logits_before_softmax() -> None:
    # Logits (0, 2 ln 3) at τ = 2 are (0, ln 3): the same distribution as above. Dividing by τ + 1e-7
    # (TRL) instead would move log p by ≈ 1.4e-8, far outside abs = 1e-15.
    logits = torch.tensor([[[0.0, 2 * math.log(3.0)]]], dtype=torch.float64)
    assert logprobs_from_logits(logits, torch.tensor([[1]]), temperature=2.0).item() == pytest.approx(
        LOG_3_4, abs=1e-15
    )
    assert entropy_from_logits(logits, temperature=2.0).item() == pytest.approx(H_1_4_3_4, abs=1e-15)


def test_entropy_with_minus_inf_logit_is_finite() -> None:
    # A banned token (logit −inf, p = 0) contributes 0·log 0 = 0: logits (0, −inf, ln 3) have the
    # entropy of (1/4, 0, 3/4) = 0.5623351 — not NaN — and a finite gradient.
    logits = torch.tensor([[[0.0, -math.inf, math.log(3.0)]]], dtype=torch.float64, requires_grad=True)
    h = entropy_from_logits(logits)
    assert h.item() == pytest.approx(H_1_4_3_4, abs=1e-15)
    assert entropy_from_logits_naive(logits).item() == pytest.approx(H_1_4_3_4, abs=1e-15)
    h.sum().backward()
    assert logits.grad is not None and bool(torch.isfinite(logits.grad).all())


def test_logits_with_wrong_dims_are_rejected() -> None:
    with pytest.raises(
        ShapeError, match=r"logits: expected 3 dims \[B, T, V\] \(batch, resp, vocab\), got \[2, 3\]"
    ):
        logprobs_from_logits(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long))


def test_integer_logits_are_rejected() -> None:
    with pytest.raises(
        DtypeError, match=re.escape("logits: expected a floating-point tensor, got dtype torch.int64")
    ):
        logprobs_from_logits(torch.zeros(1, 2, 3, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long))


def test_float_token_ids_are_rejected() -> None:
    with pytest.raises(
        DtypeError,
        match=re.escape("tokens: expected an integer tensor of token ids, got dtype torch.float32"),
    ):
        logprobs_from_logits(torch.zeros(1, 2, 3), torch.zeros(1, 2))


def test_token_ids_with_wrong_shape_are_rejected() -> None:
    with pytest.raises(
        ShapeError, match=r"tokens: expected shape \[B, T\] = \[1, 2\] \(batch, resp\), got \[1, 3\]"
    ):
        logprobs_from_logits(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long))


def test_out_of_range_token_id_at_valid_position_is_rejected() -> None:
    with pytest.raises(ShapeError, match=r"tokens: id 5 at valid position \[0, 0\] is outside \[0, V=2\)"):
        logprobs_from_logits(LOGITS, torch.tensor([[5, 0]]), MASK)


def test_nonpositive_temperature_is_rejected() -> None:
    with pytest.raises(
        HyperparameterError, match=re.escape("temperature: expected a finite number > 0, got 0")
    ):
        logprobs_from_logits(LOGITS, torch.tensor([[0, 0]]), MASK, temperature=0)
    with pytest.raises(
        HyperparameterError, match=re.escape("temperature: expected a finite number > 0, got nan")
    ):
        entropy_from_logits(LOGITS, MASK, temperature=float("nan"))


def test_mask_with_wrong_shape_is_rejected() -> None:
    with pytest.raises(
        ShapeError, match=r"mask: expected shape \[B, T\] = \[1, 2\] \(batch, resp\), got \[1, 3\]"
    ):
        entropy_from_logits(LOGITS, torch.ones(1, 3, dtype=torch.bool))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_logprobs_and_entropy_on_many_positions_match_naive(dtype: torch.dtype) -> None:
    # 9·500 = 4500 positions of V = 64: more than one CPU chunk of positions (4096 at V = 64), with
    # NaN logits and junk ids on padding; values equal the naive twins and gradients are finite.
    from refppo.core.logprobs import logprobs_from_logits_naive

    g = torch.Generator().manual_seed(3)
    B, T, V = 9, 500, 64
    m = torch.arange(T).unsqueeze(0) < torch.randint(1, T + 1, (B, 1), generator=g)
    logits = (torch.randn(B, T, V, generator=g, dtype=torch.float64) * 3).to(dtype)
    logits[~m] = float("nan")
    tokens = torch.where(m, torch.randint(0, V, (B, T), generator=g), -1)
    logits.requires_grad_(True)
    lp = logprobs_from_logits(logits, tokens, m, temperature=0.8)
    ent = entropy_from_logits(logits, m, temperature=0.8)
    assert_twin_close(lp, logprobs_from_logits_naive(logits, tokens, m, temperature=0.8), dtype, "logprobs")
    assert_twin_close(ent, entropy_from_logits_naive(logits, m, temperature=0.8), dtype, "entropy")
    (lp.sum() + ent.sum()).backward()
    assert logits.grad is not None
    assert bool(torch.isfinite(logits.grad[m]).all()) and bool((logits.grad[~m] == 0).all())
