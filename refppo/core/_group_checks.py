"""The input checks of :mod:`refppo.core.group`'s critic-free advantages, in one place.

Split out of ``group.py`` (its size limit) so that the vectorized functions and their naive twins
(:mod:`refppo.core.group_naive`, :func:`refppo.core.helpers_naive.group_scalar_advantages_naive`)
run the SAME checks, in the same order, before any arithmetic: a bad input gets one error (class
and message) from every implementation (tests/core/test_core_twin_refusals.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from refppo.conventions import AdvantageEstimator, GaeHoles, parse
from refppo.core.checks import check_b, check_bt, check_float, check_mask, check_nonneg, check_unit_interval
from refppo.errors import DtypeError, HyperparameterError, MaskError, ShapeError
from refppo.group_conventions import GroupStdLevel
from refppo.types import ResponseMask, SeqFloat, TokenFloat

GROUP_ESTIMATORS = (
    AdvantageEstimator.GRPO,
    AdvantageEstimator.DR_GRPO,
    AdvantageEstimator.RLOO,
    AdvantageEstimator.REINFORCE_PP_BASELINE,
    AdvantageEstimator.OPO,
    AdvantageEstimator.GPG,
    AdvantageEstimator.GRPO_PASSK,
)
"""The estimators that need ``group_index`` (``flash-reinforce``'s baseline is the batch's, no group)."""


def _check_group_index(group_index: object, B: int, device: torch.device) -> Tensor:
    if not isinstance(group_index, Tensor):
        raise DtypeError(f"group_index: expected a torch.Tensor, got {type(group_index).__name__}")
    if group_index.dtype.is_floating_point or group_index.dtype == torch.bool or group_index.is_complex():
        raise DtypeError(
            f"group_index: expected an integer tensor (prompt ids), got dtype {group_index.dtype}"
        )
    if group_index.shape != (B,):
        shape = "[" + ", ".join(str(s) for s in group_index.shape) + "]"
        raise ShapeError(f"group_index: expected shape [B] = [{B}] (batch), got {shape}")
    if group_index.device != device:
        raise ShapeError(f"group_index: expected device {device}, got {group_index.device}")
    return group_index


def _check_options(singleton: str, whiten_eps_form: str) -> None:
    if singleton not in ("error", "score", "zero"):
        raise HyperparameterError(f"singleton: expected 'error', 'score' or 'zero', got {singleton!r}")
    if whiten_eps_form not in ("add", "clamp"):
        raise HyperparameterError(f"whiten_eps_form: expected 'add' or 'clamp', got {whiten_eps_form!r}")


def _check_scalar_inputs(
    est: AdvantageEstimator,
    scores: SeqFloat,
    eps: float,
    singleton: str,
    lengths: SeqFloat | None = None,
    *,
    lengths_from_mask: bool = False,
) -> Tensor:
    """The checked ``scores`` ``[B]`` (B ≥ 1) of a group (or batch-baseline) estimator ``est``, and
    ``lengths`` when given (read by ``opo`` only, but a malformed one is named under any estimator;
    ``opo`` refuses None unless ``lengths_from_mask``: :func:`_checked_group_inputs`, whose caller
    counts them from the mask). Shared with the naive twin
    :func:`refppo.core.helpers_naive.group_scalar_advantages_naive`."""
    if est not in GROUP_ESTIMATORS and est is not AdvantageEstimator.FLASH_REINFORCE:
        raise HyperparameterError(
            f"estimator: {est.value!r} is not a group estimator (see reinforce_pp_advantages)"
        )
    s = check_float("scores", scores)
    if s.dim() != 1 or s.shape[0] == 0:
        raise ShapeError(f"scores: expected shape [B] (batch) with B >= 1, got {list(s.shape)}")
    check_nonneg("eps", eps)
    _check_options(singleton, "add")
    if lengths is not None:
        _check_lengths(lengths, s.shape[0])
    elif est is AdvantageEstimator.OPO and not lengths_from_mask:
        raise ShapeError("lengths: estimator 'opo' needs the valid-token count [B] of each row")
    return s


def _checked_group_index(est: AdvantageEstimator, group_index: Tensor | None, s: Tensor) -> Tensor | None:
    """``group_index`` checked for ``est``: required by the group estimators, optional (unused, but a
    malformed one is still named) under ``flash-reinforce``. Shared with the naive twins."""
    if group_index is None:
        if est is AdvantageEstimator.FLASH_REINFORCE:
            return None
        raise ShapeError(
            f"group_index: estimator {est.value!r} needs group_index [B] (the prompt of each row)"
        )
    return _check_group_index(group_index, s.shape[0], s.device)


def _is_integer(dtype: torch.dtype) -> bool:
    """An integer dtype (bool excluded: a mask is not a count)."""
    return dtype != torch.bool and not dtype.is_floating_point and not dtype.is_complex


def _check_lengths(lengths: object, B: int) -> Tensor:
    """``lengths`` ``[B]``: each row's valid-token count ``L_i``, whole numbers ``>= 1`` (as a
    checked mask's rows: every row has a valid token), as a float tensor or an integer one (counts
    such as ``mask.sum(1)``; returned cast to float64, the caller casts to its compute dtype).
    Refused with one :class:`~refppo.errors.MaskError` naming the first bad row otherwise (a NaN,
    infinite, negative, zero or fractional count would make ``opo``'s ``Σ L_j s_j / Σ L_j`` NaN or
    silently wrong); a bool or complex tensor is a :class:`~refppo.errors.DtypeError`.
    Shared with the naive twin :func:`refppo.core.helpers_naive.group_scalar_advantages_naive`."""
    if isinstance(lengths, Tensor) and _is_integer(lengths.dtype):
        lengths = lengths.to(torch.float64)
    L = check_float("lengths", lengths)
    if L.shape != (B,):
        raise ShapeError(f"lengths: expected shape [B] = [{B}], got {list(L.shape)}")
    bad = ~(torch.isfinite(L) & (L >= 1) & (torch.floor(L) == L))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise MaskError(
            f"lengths: expected valid-token counts (whole numbers >= 1), got {float(L[i])!r} at row {i}"
        )
    return L


def _checked_group_inputs(
    scores: SeqFloat,
    group_index: Tensor | None,
    mask: ResponseMask,
    *,
    estimator: AdvantageEstimator | str,
    std_level: GroupStdLevel | str,
    eps: float,
    singleton: str,
    token_penalty: TokenFloat | None,
    whiten_eps: float,
    whiten_eps_form: str,
) -> tuple[Tensor, Tensor | None]:
    """:func:`group_advantages`' inputs checked in one place, before any arithmetic (shared with
    its naive twin :func:`group_advantages_naive`): ``(mask, token_penalty)``, or one clear error.
    (Groups of one are refused later, by ``singleton``, as in :func:`group_scalar_advantages`.)"""
    m = check_mask("mask", mask)
    _check_options(singleton, whiten_eps_form)
    check_nonneg("whiten_eps", whiten_eps)
    if isinstance(scores, Tensor) and scores.shape[:1] != m.shape[:1]:
        check_b("scores", scores, m.shape[0], m.device)
    est = parse(AdvantageEstimator, estimator, what="estimator")
    parse(GroupStdLevel, std_level, what="std_level")
    s = _check_scalar_inputs(est, scores, eps, singleton, lengths_from_mask=True)
    _checked_group_index(est, group_index, s)
    if token_penalty is None:
        return m, None
    p = check_bt("token_penalty", token_penalty, m)
    if p.dtype != s.dtype:
        raise DtypeError(
            f"expected one floating dtype for all inputs, got scores={s.dtype}, token_penalty={p.dtype}"
        )
    return m, p


def _checked_returns_inputs(
    rewards: TokenFloat, mask: ResponseMask, gamma: float, holes: GaeHoles | str
) -> tuple[Tensor, Tensor, float]:
    """REINFORCE++'s returns' inputs checked (:func:`refppo.core.group.discounted_returns` and its
    naive twin): ``(rewards, mask, γ)``, or one clear error; ``holes`` a known name."""
    m = check_mask("mask", mask)
    r = check_bt("rewards", rewards, m)
    gamma = check_unit_interval("gamma", gamma)
    parse(GaeHoles, holes, what="gae_holes")
    return r, m, gamma
