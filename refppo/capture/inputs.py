"""What :class:`refppo.capture.recorder.StepRecorder` checks at the trainer's line: its arguments, the
engine's sampling parameters and the inputs its setting reads (one line each, :class:`CaptureError`).

The three log-prob roles of a step (spec/dump-format.md): the behaviour log-probs
``rollout_logprobs`` ``[b, T]`` (what the inference engine reported for the sampled tokens), the
proximal ``old_logprobs`` (the trainer's recompute before the update) and the current ``logprobs``;
``policy_version`` ``[b]`` (integers ≥ 0: the policy update that sampled each row). The sampling
parameters go to the sidecar: ``temperature`` > 0, ``top_p`` in (0, 1], ``top_k`` ≥ −1 (0 or −1: off),
``min_p`` in [0, 1], ``logprobs_processed`` (the engine's log-probs are of the processed
distribution, after temperature and the filters, not of the raw logits).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, is_dataclass
from typing import Any

import torch
from torch import Tensor

from refppo.dump.keys import SIDECAR_SAMPLING_KEYS, SIDECAR_SCORING_KEYS, sampling_problem
from refppo.dump.required import missing_inputs
from refppo.errors import RefPPOError
from refppo.pipeline.settings import FLAT, HPARAM_KEYS, Convention, Hyperparams

SAMPLING_KEYS: tuple[str, ...] = ("temperature", "top_p", "top_k", "min_p", "logprobs_processed")
"""The sidecar's sampling keys, in the order they are read (:data:`refppo.dump.keys.SIDECAR_SAMPLING_KEYS`
and the scoring pass's ``temperature``)."""
assert frozenset(SAMPLING_KEYS) == SIDECAR_SAMPLING_KEYS | SIDECAR_SCORING_KEYS

LOGPROBS_MODES: dict[str, bool] = {
    "raw_logprobs": False,
    "raw_logits": False,
    "processed_logprobs": True,
    "processed_logits": True,
}
"""vLLM's ``logprobs_mode`` (``vllm/config/model.py``: ``LogprobsMode``) → ``logprobs_processed``."""


class CaptureError(RefPPOError):
    """The recorder was misused (the message is one line naming what is wrong)."""


def as_dict(obj: Any) -> dict[str, Any]:
    """A mapping, a dataclass or an object with ``to_dict()`` as a plain dict (None: empty)."""
    if obj is None:
        return {}
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    if is_dataclass(obj) and not isinstance(obj, type):
        return asdict(obj)
    if isinstance(obj, Mapping):
        return dict(obj)
    raise CaptureError(f"expected a mapping or a dataclass, got {type(obj).__name__}")


def sampling_of(sampling: Any) -> dict[str, Any]:
    """The sidecar's sampling keys from ``sampling``: a mapping of :data:`SAMPLING_KEYS` (or
    ``logprobs_mode``), or an engine's parameter object read by attribute (vLLM's ``SamplingParams``:
    ``temperature``, ``top_p``, ``top_k``, ``min_p``); values checked (one line naming the key)."""
    if sampling is None:
        return {}
    if isinstance(sampling, Mapping):
        src = dict(sampling)
        unknown = sorted(set(src) - {*SAMPLING_KEYS, "logprobs_mode"})
        if unknown:
            raise CaptureError(f"sampling: unknown key(s) {unknown}; valid keys are {list(SAMPLING_KEYS)}")
    else:
        names = (*SAMPLING_KEYS, "logprobs_mode")
        src = {k: v for k in names if (v := getattr(sampling, k, None)) is not None}
    mode = src.pop("logprobs_mode", None)
    if mode is not None:
        word = str(getattr(mode, "value", mode))
        if word not in LOGPROBS_MODES:
            raise CaptureError(f"sampling: logprobs_mode {word!r} is not one of {sorted(LOGPROBS_MODES)}")
        src.setdefault("logprobs_processed", LOGPROBS_MODES[word])
    out = {k: float(v) if k in ("temperature", "top_p", "min_p") and _num(v) else v for k, v in src.items()}
    problem = sampling_problem(out)
    if problem is not None:
        raise CaptureError(f"sampling: {problem}")
    return {k: out[k] for k in SAMPLING_KEYS if k in out}


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def scalar(name: str, value: Tensor | float) -> float:
    """A recorded loss as a finite float (a number or a one-element tensor)."""
    if isinstance(value, Tensor) and value.numel() != 1:
        raise CaptureError(
            f"record: loss {name!r} must be one number, got a tensor of shape {list(value.shape)}"
        )
    if not isinstance(value, (Tensor, int, float)) or isinstance(value, bool):
        raise CaptureError(
            f"record: loss {name!r} must be a number or a one-element tensor, got {type(value).__name__}"
        )
    v = float(value.detach()) if isinstance(value, Tensor) else float(value)
    if not math.isfinite(v):
        raise CaptureError(f"record: loss {name!r} is not finite ({v})")
    return v


def mask_shape(response_mask: object) -> tuple[int, ...]:
    """``[b, T]`` of a :meth:`StepRecorder.record` call's ``response_mask`` (a 0/1 or bool tensor)."""
    if not isinstance(response_mask, Tensor):
        raise CaptureError(f"record: response_mask must be a tensor, got {type(response_mask).__name__}")
    if not bool(((response_mask == 0) | (response_mask == 1)).all()):
        raise CaptureError("record: response_mask must hold only 0/1 (or bool) values")
    shape = tuple(response_mask.shape)
    if len(shape) != 2:
        raise CaptureError(f"record: response_mask must be [b, T], got shape {list(shape)}")
    return shape


def check_policy_version(value: Tensor) -> None:
    """``policy_version`` holds integers ≥ 0 (the policy update that sampled each row)."""
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise CaptureError(f"record: policy_version must hold integers, got {value.dtype}")
    if value.numel() and int(value.min()) < 0:
        raise CaptureError("record: policy_version must hold integers >= 0 (the policy update of each row)")


def setting_of(
    hparams: Mapping[str, Any], conventions: Mapping[str, Any]
) -> tuple[Convention, Hyperparams] | None:
    """The recorder's setting as the oracle will read it, or None when the sidecar leaves it to the
    oracle (a value it parses, a preset's conventions). An unknown ``kl_coef`` counts as 0 here:
    whether ``ref_logprobs`` is read is then the oracle's check, with the β it resolves."""
    side = {**hparams, **conventions}
    conv_vals = {k: v for k, v in side.items() if k in FLAT}
    hp_vals = {k: v for k, v in side.items() if k in HPARAM_KEYS and _num(v)}
    hp_vals.setdefault("kl_coef", 0.0)
    try:
        return Convention().with_updates(conv_vals), Hyperparams(**hp_vals)
    except (RefPPOError, TypeError, ValueError):
        return None


def needs_problem(present: set[str], hparams: Mapping[str, Any], conventions: Mapping[str, Any]) -> str:
    """'' when a micro-batch recorded with keys ``present`` holds every optional input its setting
    reads (:func:`refppo.dump.required.missing_inputs`: ``rollout_logprobs`` with the rollout
    correction on, ``ref_logprobs`` where a KL term with β > 0 reads it), else the first one's line."""
    setting = setting_of(hparams, conventions)
    if setting is None:
        return ""
    lines = missing_inputs(frozenset(present), *setting)
    return f"record: {lines[0]}" if lines else ""


__all__ = [
    "LOGPROBS_MODES",
    "SAMPLING_KEYS",
    "CaptureError",
    "as_dict",
    "check_policy_version",
    "mask_shape",
    "needs_problem",
    "sampling_of",
    "scalar",
    "setting_of",
]
