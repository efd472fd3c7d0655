"""Checkpoints that resume a run exactly.

Layout of ``<out_dir>/checkpoints/iter_<NNNNNN>/``::

    <name>.safetensors     weights of each model (policy, reference, critic, reward) — safetensors
    optim_<name>.pt        optimizer state dicts — torch.save, loaded with weights_only=True
    rng_rank<R>.pt         RNG states of rank R: torch CPU (+CUDA), numpy, python ``random``, the
                           task's ``random.Random``, the sampling ``torch.Generator`` — weights_only
    state.json             iteration, KL controller, config — plain JSON
    COMPLETE               written last: a checkpoint without it is ignored (interrupted save)

Tied weights (GPT-2's ``lm_head``/``wte``) go through ``safetensors.torch.save_model``/``load_model``,
which store a shared tensor once.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from refppo.errors import RefPPOError


class CheckpointError(RefPPOError):
    """A missing, incomplete or mismatched checkpoint."""


def _dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:06d}"


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint with the highest iteration under ``root`` (None if there is none)."""
    r = Path(root)
    if not r.is_dir():
        return None
    done = sorted(p for p in r.glob("iter_*") if (p / "COMPLETE").exists())
    return done[-1] if done else None


# --------------------------------------------------------------------------------------------- RNG state


def rng_state(task_rng: random.Random, generator: torch.Generator) -> dict[str, Any]:
    """Every RNG state as tensors / Python builtins (loadable with ``weights_only=True``)."""
    np_state: tuple[Any, ...] = tuple(np.random.get_state())
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
        "numpy_meta": [str(np_state[0]), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": random.getstate(),
        "task": task_rng.getstate(),
        "generator": generator.get_state(),
        "generator_device": str(generator.device),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _tuplify(x: Any) -> Any:
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


def set_rng_state(state: dict[str, Any], task_rng: random.Random, generator: torch.Generator) -> None:
    """Restore what :func:`rng_state` saved."""
    torch.set_rng_state(state["torch"])
    name, pos, has_gauss, cached = state["numpy_meta"]
    keys = state["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state((name, keys, int(pos), int(has_gauss), float(cached)))
    random.setstate(_tuplify(state["python"]))
    task_rng.setstate(_tuplify(state["task"]))
    generator.set_state(state["generator"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------------------- save / load


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint's non-tensor state."""

    path: Path
    iteration: int
    state: dict[str, Any]


def save_checkpoint(
    root: str | Path,
    iteration: int,
    *,
    models: dict[str, nn.Module],
    optimizers: dict[str, torch.optim.Optimizer],
    rng: dict[str, Any],
    rank: int = 0,
    state: dict[str, Any] | None = None,
    is_main: bool = True,
) -> Path:
    """Write the checkpoint of ``iteration`` (weights and optimizers from the main rank only;
    RNG state from every rank). Returns its directory. Call on every rank, then barrier."""
    from safetensors.torch import save_model

    path = _dir(root, iteration)
    path.mkdir(parents=True, exist_ok=True)
    torch.save(rng, path / f"rng_rank{rank}.pt")
    if is_main:
        for name, model in models.items():
            save_model(model, os.fspath(path / f"{name}.safetensors"))
        for name, opt in optimizers.items():
            torch.save(opt.state_dict(), path / f"optim_{name}.pt")
        meta = {"iteration": iteration, **(state or {})}
        (path / "state.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    return path


def mark_complete(path: Path) -> None:
    """Write the COMPLETE marker (main rank, after every rank has saved)."""
    (path / "COMPLETE").write_text("ok\n")


def load_checkpoint(
    path: str | Path,
    *,
    models: dict[str, nn.Module],
    optimizers: dict[str, torch.optim.Optimizer],
    rank: int = 0,
) -> tuple[Checkpoint, dict[str, Any]]:
    """Load weights and optimizer states into ``models``/``optimizers`` (in place); returns the
    checkpoint's state and this rank's RNG state (restore it with :func:`set_rng_state`)."""
    from safetensors.torch import load_model

    p = Path(path)
    if not (p / "COMPLETE").exists():
        raise CheckpointError(f"checkpoint {str(p)!r} is incomplete or missing (no COMPLETE marker)")
    for name, model in models.items():
        f = p / f"{name}.safetensors"
        if not f.exists():
            raise CheckpointError(f"checkpoint {str(p)!r} has no weights for {name!r}")
        device = next(model.parameters()).device
        missing, unexpected = load_model(model, os.fspath(f), strict=True, device=str(device))
        del missing, unexpected
    for name, opt in optimizers.items():
        f = p / f"optim_{name}.pt"
        if not f.exists():
            raise CheckpointError(f"checkpoint {str(p)!r} has no optimizer state for {name!r}")
        opt.load_state_dict(torch.load(f, weights_only=True, map_location="cpu"))
    rng_file = p / f"rng_rank{rank}.pt"
    if not rng_file.exists():
        raise CheckpointError(
            f"checkpoint {str(p)!r} has no RNG state for rank {rank}: was it saved with another world size?"
        )
    rng = torch.load(rng_file, weights_only=True)
    state = json.loads((p / "state.json").read_text())
    return Checkpoint(p, int(state["iteration"]), state), rng


__all__ = [
    "Checkpoint",
    "CheckpointError",
    "latest_checkpoint",
    "load_checkpoint",
    "mark_complete",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]
