"""Checkpoints that resume a run exactly.

Layout of ``<out_dir>/checkpoints/iter_<NNNNNN>/``::

    <name>.safetensors     weights of each model (policy, reference, critic, reward) — safetensors
    optim_<name>.pt        optimizer state dicts — torch.save, loaded with weights_only=True
    rng_rank<R>.pt         RNG states of rank R: torch CPU (+CUDA), numpy, python ``random``, the
                           task's ``random.Random``, the sampling ``torch.Generator`` — weights_only
    state.json             iteration, KL controller, config, run id, config hash — plain JSON
    COMPLETE               written last: JSON manifest ``{"format": ..., "files": {name: bytes}}``

A checkpoint is written into ``<out_dir>/checkpoints/.tmp-iter_<NNNNNN>/`` (every file fsync-ed),
then ``COMPLETE`` is written there, and only then is the folder renamed to ``iter_<NNNNNN>`` (and
the parent fsync-ed). So a ``kill -9`` at any point leaves either no ``iter_<NNNNNN>`` at all or a
complete one; a folder named ``iter_*`` without ``COMPLETE`` (written by refppo before atomic
saves) is still ignored. On load, every file of the manifest must exist with its recorded size
(catches truncation), and each file that cannot be read gives one :class:`CheckpointError` naming
the file and what is wrong — never the text of a pickle error (whose advice, ``weights_only=False``,
would be unsafe for a file that may not be ours).

Tied weights (GPT-2's ``lm_head``/``wte``) go through ``safetensors.torch.save_model``/``load_model``,
which store a shared tensor once.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from refppo.atomic import TMP_PREFIX, atomic_write_text, fsync_dir, fsync_file, honour_umask
from refppo.errors import RefPPOError


class CheckpointError(RefPPOError):
    """A missing, incomplete or mismatched checkpoint."""


def _dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:06d}"


def staging_dir(root: str | Path, iteration: int) -> Path:
    """Where the checkpoint of ``iteration`` is written before it is renamed into place."""
    return Path(root) / f"{TMP_PREFIX}iter_{iteration:06d}"


def complete_checkpoints(root: str | Path) -> list[Path]:
    """The checkpoints under ``root`` that carry a ``COMPLETE`` marker, oldest first."""
    r = Path(root)
    if not r.is_dir():
        return []
    return sorted(p for p in r.glob("iter_*") if (p / "COMPLETE").exists())


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint with the highest iteration under ``root`` (None if there is none)."""
    done = complete_checkpoints(root)
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

MANIFEST_FORMAT = "refppo-checkpoint/1"
"""``format`` of the ``COMPLETE`` manifest."""


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint's non-tensor state."""

    path: Path
    iteration: int
    state: dict[str, Any]


def begin_checkpoint(root: str | Path, iteration: int) -> Path:
    """Create an empty staging folder for ``iteration`` (main rank, before any rank saves; a stale
    one from an interrupted save is removed). Returns it."""
    path = staging_dir(root, iteration)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


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
    """Write the files of the checkpoint of ``iteration`` into its staging folder (weights,
    optimizers and ``state.json`` from the main rank only; RNG state from every rank), each fsync-ed.
    Returns the staging folder. Call :func:`begin_checkpoint` (main rank) and a barrier first, and a
    barrier then :func:`mark_complete` (main rank) after."""
    from safetensors.torch import save_model

    path = staging_dir(root, iteration)
    path.mkdir(parents=True, exist_ok=True)
    written = [path / f"rng_rank{rank}.pt"]
    torch.save(rng, written[0])
    if is_main:
        for name, model in models.items():
            f = path / f"{name}.safetensors"
            save_model(model, os.fspath(f))
            written.append(f)
        for name, opt in optimizers.items():
            f = path / f"optim_{name}.pt"
            torch.save(opt.state_dict(), f)
            written.append(f)
        meta = {"iteration": iteration, **(state or {})}
        f = path / "state.json"
        f.write_text(json.dumps(meta, indent=2, sort_keys=True))
        written.append(f)
    for f in written:
        honour_umask(f)  # safetensors writes its file 0600 (its own temporary file, renamed)
        fsync_file(f)
    return path


def mark_complete(path: Path) -> Path:
    """Seal the staging folder ``path`` (main rank, after every rank has saved): write ``COMPLETE``
    (the manifest of every file and its size), fsync, and rename the folder to ``iter_<NNNNNN>``.
    A checkpoint of the same iteration already there (e.g. one skipped as corrupt) is moved aside
    first and deleted after. Returns the final folder."""
    if not path.name.startswith(f"{TMP_PREFIX}iter_"):
        raise CheckpointError(f"{str(path)!r} is not a checkpoint staging folder")
    files = {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.name != "COMPLETE"}
    atomic_write_text(path / "COMPLETE", json.dumps({"format": MANIFEST_FORMAT, "files": files}) + "\n")
    fsync_dir(path)
    final = path.with_name(path.name.removeprefix(TMP_PREFIX))
    old = path.with_name(f"{TMP_PREFIX}old-{final.name}")
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(path, final)
    fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)
    return final


def _bad(p: Path, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {str(p)!r}: {what}")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def read_state(path: str | Path) -> dict[str, Any]:
    """Check the ``COMPLETE`` manifest of ``path`` (every listed file present with its recorded size)
    and return its parsed ``state.json``; :class:`CheckpointError` naming the file otherwise."""
    p = Path(path)
    marker = p / "COMPLETE"
    if not marker.exists():
        raise _bad(p, "incomplete or missing (no COMPLETE marker)")
    try:
        manifest = json.loads(marker.read_text(encoding="utf-8"))
        files = manifest["files"] if manifest.get("format") == MANIFEST_FORMAT else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError):
        files = None
    if not isinstance(files, dict):
        raise _bad(p, "COMPLETE is not a refppo file manifest (written by an older refppo, or damaged)")
    for name, size in sorted(files.items()):
        f = p / name
        if not f.is_file():
            raise _bad(p, f"{name} is missing")
        if f.stat().st_size != size:
            got = f.stat().st_size
            raise _bad(p, f"{name} is {got} bytes, COMPLETE recorded {size} (truncated or changed)")
    try:
        state = json.loads((p / "state.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _bad(p, "state.json is missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad(p, f"state.json is not valid JSON ({_one_line(e)})") from None
    if not isinstance(state, dict) or not isinstance(state.get("iteration"), int):
        raise _bad(p, "state.json has no integer 'iteration'")
    if p.name != f"iter_{state['iteration']:06d}":
        raise _bad(p, f"state.json says iteration {state['iteration']}, the folder name another")
    return state


def _torch_load(p: Path, name: str) -> Any:
    f = p / name
    if not f.is_file():
        raise _bad(p, f"{name} is missing")
    try:
        return torch.load(f, weights_only=True, map_location="cpu")
    except Exception as e:  # any failure means a damaged file
        # the message of an UnpicklingError suggests weights_only=False: never pass it on (nor chain it)
        raise _bad(p, f"{name} is not a readable weights-only torch file ({type(e).__name__})") from None


def load_checkpoint(
    path: str | Path,
    *,
    models: dict[str, nn.Module],
    optimizers: dict[str, torch.optim.Optimizer],
    rank: int = 0,
) -> tuple[Checkpoint, dict[str, Any]]:
    """Load weights and optimizer states into ``models``/``optimizers`` (in place); returns the
    checkpoint's state and this rank's RNG state (restore it with :func:`set_rng_state`).
    Every file is read before any optimizer is changed; a failure names the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    p = Path(path)
    state = read_state(p)
    rng_name = f"rng_rank{rank}.pt"
    if not (p / rng_name).exists():
        raise _bad(p, f"no RNG state for rank {rank}: was it saved with another world size?")
    # every rank reads every rank's RNG file (small), so that under torchrun all ranks reach the same
    # verdict on a damaged checkpoint (and --resume-fallback picks the same one everywhere)
    rngs = {f.name: _torch_load(p, f.name) for f in sorted(p.glob("rng_rank*.pt"))}
    rng = rngs[rng_name]
    opt_states = {name: _torch_load(p, f"optim_{name}.pt") for name in optimizers}
    for name, model in models.items():
        f = p / f"{name}.safetensors"
        if not f.exists():
            raise _bad(p, f"no weights for {name!r} ({f.name} is missing)")
        device = next(model.parameters()).device
        try:
            load_model(model, os.fspath(f), strict=True, device=str(device))
        except SafetensorError as e:
            raise _bad(p, f"{f.name} is not a valid safetensors file ({_one_line(e)})") from None
        except (RuntimeError, ValueError, KeyError) as e:
            raise _bad(p, f"{f.name} does not fit the {name} model ({_one_line(e)})") from None
    for name, opt in optimizers.items():
        try:
            opt.load_state_dict(opt_states[name])
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            raise _bad(p, f"optim_{name}.pt does not fit the {name} optimizer ({_one_line(e)})") from None
    return Checkpoint(p, int(state["iteration"]), state), rng


__all__ = [
    "Checkpoint",
    "CheckpointError",
    "begin_checkpoint",
    "complete_checkpoints",
    "latest_checkpoint",
    "load_checkpoint",
    "mark_complete",
    "read_state",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "staging_dir",
]
