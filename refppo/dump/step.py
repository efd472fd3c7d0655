"""A v2 dump's optimizer step: how its rows were split over data-parallel ranks and micro-batches
(sidecar keys ``world_size``, ``micro_batches``, ``separate_critic``; ``[B]`` integer keys
``rank``, ``micro_batch``, ``group_index``), checked against each other (spec/dump-format.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from refppo.dump.keys import ROW_INTEGER_KEYS
from refppo.errors import DumpError


@dataclass(frozen=True)
class StepLayout:
    """v2 sidecar keys: ``world_size`` W and ``micro_batches`` K (per rank per optimizer step), and
    ``separate_critic`` (the critic has its own optimizer: the ``loss`` key holds no value term)."""

    world_size: int = 1
    micro_batches: int = 1
    separate_critic: bool = False


def step_layout(path: Path, hparams: dict[str, Any]) -> StepLayout:
    """The v2 sidecar keys (positive integers ``world_size``, ``micro_batches``; bool ``separate_critic``)."""
    vals: dict[str, Any] = {}
    for k in ("world_size", "micro_batches"):
        if k in hparams:
            v = hparams[k]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise DumpError(f"{path}: {k}: expected a positive integer, got {v!r}")
            vals[k] = v
    if "separate_critic" in hparams:
        v = hparams["separate_critic"]
        if not isinstance(v, bool):
            raise DumpError(f"{path}: separate_critic: expected true or false, got {v!r}")
        vals["separate_critic"] = v
    v = hparams.get("loss_scale", 1.0)  # the recorder's record of the AMP scale it divided out
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
        raise DumpError(f"{path}: loss_scale: expected a finite number > 0, got {v!r}")
    return StepLayout(**vals)


def integer_key(p: Path, k: str, t: Tensor, B: int) -> Tensor:
    """An integer-valued key as int64 (``micro_batch``, ``rank``, ``group_index`` are ``[B]``;
    ``truncated`` ``[B]`` bool or 0/1)."""
    if k == "truncated" and t.dtype == torch.bool:
        t = t.to(torch.int64)
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise DumpError(f"{p}: {k}: expected an integer tensor, got dtype {t.dtype}")
    if k in ROW_INTEGER_KEYS and tuple(t.shape) != (B,):
        raise DumpError(f"{p}: {k}: expected shape [B] = [{B}] (from response_mask), got {list(t.shape)}")
    if k == "truncated" and not bool(((t == 0) | (t == 1)).all()):
        raise DumpError(f"{p}: truncated: expected 0/1 (or bool) per row")
    return t.detach().to(torch.int64)


def sidecar_advice(p: Path, hp_path: Path | None, has_side: bool) -> str:
    """Where to set a sidecar key, as the user gave (or did not give) the sidecar."""
    if hp_path is not None:
        return f"set {{key}} in the sidecar {hp_path}"
    if has_side:
        return "set {key} in the hyperparameters given with the tensors"
    return (
        f"there is no sidecar: write {p.name}.json beside the dump with {{key}} and the run's "
        "hyperparameters, or pass --hparams FILE"
    )


def check_rows(p: Path, out: dict[str, Tensor], step: StepLayout, advice: str) -> None:
    """``rank`` in ``[0, world_size)`` and ``micro_batch`` in ``[0, micro_batches)``; ``advice``
    (:func:`sidecar_advice`) says where to set the sidecar key."""
    for k, n, name in (
        ("rank", step.world_size, "world_size"),
        ("micro_batch", step.micro_batches, "micro_batches"),
    ):
        if k not in out:
            continue
        bad = ((out[k] < 0) | (out[k] >= n)).nonzero().flatten().tolist()
        if bad:
            raise DumpError(
                f"{p}: {k}: row {bad[0]} holds {int(out[k][bad[0]])}, outside [0, {name}={n}) "
                f"({advice.format(key=name)})"
            )
    if step.world_size > 1 and "rank" not in out:
        raise DumpError(f"{p}: rank: missing while the sidecar says world_size={step.world_size}")
    if step.micro_batches > 1 and "micro_batch" not in out:
        raise DumpError(
            f"{p}: micro_batch: missing while the sidecar says micro_batches={step.micro_batches}"
        )
