"""Bad input to the rollout-correction steps: one clear error naming what is wrong, the same from the
vectorized function and its naive twin (refppo/core/rollout_correction.py, rollout_losses.py, cispo.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from refppo.core.cispo import cispo_policy_loss, cispo_policy_loss_naive
from refppo.core.rollout_correction import is_weights, is_weights_naive, rejection_mask, rejection_mask_naive
from refppo.core.rollout_losses import corrected_policy_loss, corrected_policy_loss_naive
from refppo.errors import ConventionError, DtypeError, HyperparameterError, MaskError, ShapeError

F64 = torch.float64
M = torch.tensor([[True, True, False], [True, False, False]])
LP = torch.tensor([[-1.0, -2.0, 9.0], [-0.5, 9.0, 9.0]], dtype=F64)
LB = LP - 0.1


def _both(fn: Callable[..., Any], twin: Callable[..., Any], *args: Any, **kw: Any) -> list[Exception]:
    errors = []
    for f in (fn, twin):
        with pytest.raises(Exception) as info:  # the type: asserted by the caller
            f(*args, **kw)
        errors.append(info.value)
    assert type(errors[0]) is type(errors[1]) and str(errors[0]) == str(errors[1]), errors
    return errors


@pytest.mark.parametrize(
    ("kw", "err", "msg"),
    [
        (
            {"level": "tokens"},
            ConventionError,
            "is_level: unknown name 'tokens'; valid names are 'token', 'sequence'",
        ),
        ({"agg": "arithmetic"}, ConventionError, "is_agg: unknown name 'arithmetic'"),
        (
            {"mode": "clip"},
            ConventionError,
            "is_mode: unknown name 'clip'; valid names are 'truncate', 'mask'",
        ),
        ({"low": 2.0, "high": 1.0}, HyperparameterError, "low, high: expected low <= high, got 2.0 > 1.0"),
        ({"low": -0.5}, HyperparameterError, "low: expected a number >= 0 (a ratio bound), got -0.5"),
        ({"high": math.nan}, HyperparameterError, "high: expected a finite number or None, got nan"),
        (
            {"log_ratio_clamp": 0.0},
            HyperparameterError,
            "log_ratio_clamp: expected a finite number > 0, got 0.0",
        ),
    ],
)
def test_is_weights_refuses_bad_settings(kw: dict[str, Any], err: type[Exception], msg: str) -> None:
    for e in _both(is_weights, is_weights_naive, LP, LB, M, **kw):
        assert isinstance(e, err) and msg in str(e), e


@pytest.mark.parametrize(
    ("kw", "err", "msg"),
    [
        ({}, HyperparameterError, "low, high: a rejection gate needs at least one bound, got neither"),
        ({"stat": "k4", "high": 1.0}, ConventionError, "rs_stat: unknown name 'k4'"),
        ({"order": "rollout", "high": 1.0}, ConventionError, "rs_order: unknown name 'rollout'"),
        ({"reduce": "min", "high": 1.0}, ConventionError, "rs_reduce: unknown name 'min'"),
        ({"stat": "ratio", "low": -1.0}, HyperparameterError, "low: expected a number >= 0 (a ratio bound)"),
    ],
)
def test_rejection_mask_refuses_bad_settings(kw: dict[str, Any], err: type[Exception], msg: str) -> None:
    for e in _both(rejection_mask, rejection_mask_naive, LP, LB, M, **kw):
        assert isinstance(e, err) and msg in str(e), e


def test_a_k1_gate_takes_a_negative_lower_bound() -> None:
    keep = rejection_mask(LP, LB, M, stat="k1", low=-0.05, high=0.05)  # d = 0.1 > 0.05: all rejected
    assert (
        keep.tolist() == rejection_mask_naive(LP, LB, M, stat="k1", low=-0.05, high=0.05) == [[False] * 3] * 2
    )
    assert rejection_mask(LP, LB, M, stat="k1", low=-0.2, high=0.2).tolist() == M.tolist()


@pytest.mark.parametrize(
    ("args", "err", "msg"),
    [
        (
            (LP, LB[:, :2], M),
            ShapeError,
            "logp_beh: expected shape [B, T] = [2, 3] (batch, resp), got [2, 2]",
        ),
        (
            (LP, LB.float(), M),
            DtypeError,
            "expected one floating dtype for all inputs, got logp=torch.float64",
        ),
        (
            (LP, LB, torch.tensor([[True, True, False], [False, False, False]])),
            MaskError,
            "mask: rows [1] have no",
        ),
        ((LP.long(), LB, M), DtypeError, "logp: expected a floating-point tensor, got dtype torch.int64"),
    ],
)
def test_bad_tensors_are_named(args: tuple[Any, ...], err: type[Exception], msg: str) -> None:
    for fn, twin in ((is_weights, is_weights_naive), (rejection_mask, rejection_mask_naive)):
        kw = {"high": 1.5}
        for e in _both(fn, twin, *args, **kw):
            want = (
                msg.replace("logp:", "logp_prox:").replace("logp=", "logp_prox=")
                if fn is rejection_mask
                else msg
            )
            assert isinstance(e, err) and want in str(e), e


ADV = torch.ones_like(LP)


@pytest.mark.parametrize(
    ("weight", "kw", "err", "msg"),
    [
        (ADV[:, :2], {}, ShapeError, "weight: expected shape [B, T] = [2, 3] (batch, resp), got [2, 2]"),
        (
            ADV.float(),
            {},
            DtypeError,
            "expected one floating dtype for all inputs, got logp=torch.float64, weight",
        ),
        (
            ADV,
            {"keep": M.to(F64)},
            DtypeError,
            "keep: expected a bool tensor (the kept tokens), got dtype torch.float64",
        ),
        (
            ADV,
            {"rejected": "dropped"},
            ConventionError,
            "rejected: unknown name 'dropped'; valid names are 'zero', 'drop'",
        ),
    ],
)
def test_corrected_policy_loss_refuses(
    weight: torch.Tensor, kw: dict[str, Any], err: type[Exception], msg: str
) -> None:
    for e in _both(corrected_policy_loss, corrected_policy_loss_naive, LP, LB, ADV, M, weight, **kw):
        assert isinstance(e, err) and msg in str(e), e


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"clip_low": 1.5}, "clip_low: expected a number in [0, 1] or None, got 1.5"),
        ({"clip_high": -0.1}, "clip_high: expected a finite number >= 0, got -0.1"),
    ],
)
def test_cispo_refuses_bad_clips(kw: dict[str, Any], msg: str) -> None:
    for e in _both(cispo_policy_loss, cispo_policy_loss_naive, LP, LB, ADV, M, **kw):
        assert isinstance(e, HyperparameterError) and msg in str(e), e
