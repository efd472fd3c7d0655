"""Unit tests of refppo/core/kl.py: hand-worked examples and every validation error path."""

from __future__ import annotations

import math
import re

import pytest
import torch

from refppo.core.kl import token_kl
from refppo.errors import ConventionError, DtypeError, HyperparameterError, ShapeError

# d = logp − logp_ref = +1 at token 0, −1 at token 1; token 2 is padding (junk).
LP = torch.tensor([[-1.0, -2.0, float("nan")]], dtype=torch.float64)
LR = torch.tensor([[-2.0, -1.0, float("inf")]], dtype=torch.float64)
M = torch.tensor([[1, 1, 0]])


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("k1", [1.0, -1.0, 0.0]),  # d
        ("k2", [0.5, 0.5, 0.0]),  # ½d²
        # exp(−d) + d − 1: e^−1 + 1 − 1 = e^−1 = 0.3678794; e^1 − 1 − 1 = e − 2 = 0.7182818
        ("k3", [math.exp(-1.0), math.e - 2.0, 0.0]),
        ("abs", [1.0, 1.0, 0.0]),  # |d|
    ],
)
def test_token_kl_hand_example(estimator: str, expected: list[float]) -> None:
    # float64 inputs: a few ulps (abs = 1e-15); 1e-7 would let a float32 downcast (~3e-8 off) pass.
    assert token_kl(LP, LR, M, estimator)[0].tolist() == pytest.approx(expected, abs=1e-15)


def test_token_kl_clamps_hand_example() -> None:
    # d = 5 clamped to 3 first -> k2 = ½·9 = 4.5, then value clamp 2 -> 2.
    lp, lr = torch.tensor([[0.0]], dtype=torch.float64), torch.tensor([[-5.0]], dtype=torch.float64)
    m = torch.ones(1, 1, dtype=torch.bool)
    assert token_kl(lp, lr, m, "k2", log_ratio_clamp=(-3.0, 3.0)).item() == 4.5
    assert token_kl(lp, lr, m, "k2", log_ratio_clamp=(-3.0, 3.0), value_clamp=2.0).item() == 2.0
    # k1 = −5 with value clamp 2 -> −2 (the clamp is symmetric).
    assert token_kl(lr, lp, m, "k1", value_clamp=2.0).item() == -2.0
    # (None, None) means no clamp at all.
    assert token_kl(lp, lr, m, "k1", log_ratio_clamp=(None, None)).item() == 5.0


def test_unknown_estimator_name_lists_valid_names() -> None:
    with pytest.raises(
        ConventionError,
        match=re.escape("kl_estimator: unknown name 'k4'; valid names are 'k1', 'k2', 'k3', 'abs'"),
    ):
        token_kl(LP, LR, M, "k4")


def test_mixed_dtypes_are_rejected() -> None:
    with pytest.raises(
        DtypeError,
        match=re.escape(
            "expected one floating dtype for all inputs, got logp=torch.float32, logp_ref=torch.float64"
        ),
    ):
        token_kl(LP.float(), LR, M)


def test_integer_logprobs_are_rejected() -> None:
    with pytest.raises(
        DtypeError, match=re.escape("logp: expected a floating-point tensor, got dtype torch.int64")
    ):
        token_kl(torch.zeros(1, 3, dtype=torch.long), LR, M)


def test_logp_ref_with_wrong_shape_names_it() -> None:
    with pytest.raises(
        ShapeError, match=r"logp_ref: expected shape \[B, T\] = \[1, 3\] \(batch, resp\), got \[3\]"
    ):
        token_kl(LP, LR[0], M)


def test_invalid_clamps_are_rejected() -> None:
    with pytest.raises(HyperparameterError, match=r"log_ratio_clamp: expected lo <= hi, got \(2.0, -2.0\)"):
        token_kl(LP, LR, M, log_ratio_clamp=(2.0, -2.0))
    with pytest.raises(HyperparameterError, match=re.escape("value_clamp: expected a number > 0, got 0.0")):
        token_kl(LP, LR, M, value_clamp=0.0)
