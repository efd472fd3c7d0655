"""The score map: what a trainer does to the reward model's score before it enters the reward.

For a row's score ``s`` (``[B]``), bias ``b``, scale ``k`` and symmetric clip ``C`` (or none)::

    s' = clip((s + b)·k, −C, C)

in that order: AReaL 1.0.4 ``reward_bias``, ``reward_scaling``, ``reward_clip``
(``areal/trainer/ppo/actor.py::PPOActor._compute_advantages``, run by tools/peers/makers/areal.py).
A clip alone is OpenRLHF's ``reward_clip_range`` (``openrlhf/models/utils.py::compute_reward``,
10) and DeepSpeed-Chat's ``clip_reward_value`` (5). ``b = 0, k = 1`` leaves ``s`` bit for bit
(the affine step is skipped, so ``−0.0`` stays ``−0.0``); ``C = None`` does not clip.

:func:`map_scores` is the vectorized step, :func:`map_scores_naive` its naive twin (Python floats,
one score at a time). The pipeline applies it first (step 0 of :mod:`refppo.pipeline`), so the
trainer, the oracle and ``--detect``'s re-checks map the score through this one function.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from refppo.core import _pyfloat as pf
from refppo.core.checks import check_float, check_positive
from refppo.errors import HyperparameterError, ShapeError
from refppo.types import SeqFloat


def check_score_map(bias: float, scale: float, clip: float | None) -> None:
    """``bias`` and ``scale`` finite numbers, ``clip`` None or a finite number > 0."""
    for name, v in (("score_bias", bias), ("score_scale", scale)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise HyperparameterError(f"{name}: expected a finite number, got {v!r}")
    if clip is not None:
        check_positive("score_clip", clip)


def _checked_scores(scores: SeqFloat, bias: float, scale: float, clip: float | None) -> Tensor:
    """:func:`map_scores`' inputs checked (shared with :func:`map_scores_naive`): ``scores`` ``[B]``."""
    s = check_float("scores", scores)
    if s.dim() != 1:
        raise ShapeError(f"scores: expected shape [B], got {list(s.shape)}")
    check_score_map(bias, scale, clip)
    return s


def map_scores(
    scores: SeqFloat, *, bias: float = 0.0, scale: float = 1.0, clip: float | None = None
) -> Tensor:
    """``clip((s + bias)·scale, ±clip)`` ``[B]`` (module docstring)."""
    s = _checked_scores(scores, bias, scale, clip)
    if bias != 0.0 or scale != 1.0:
        s = (s + bias) * scale
    return s if clip is None else torch.clamp(s, -clip, clip)


def map_scores_naive(
    scores: Tensor, *, bias: float = 0.0, scale: float = 1.0, clip: float | None = None
) -> list[float]:
    """Naive twin of :func:`map_scores`: each score in double precision, the clip by comparisons."""
    _checked_scores(scores, bias, scale, clip)  # the core's checks (the arithmetic below is separate)
    out = []
    for s in pf.vec(scores):
        if bias != 0.0 or scale != 1.0:
            s = (s + bias) * scale
        if clip is not None:
            s = -clip if s < -clip else (clip if s > clip else s)
        out.append(s)
    return out


__all__ = ["check_score_map", "map_scores", "map_scores_naive"]
