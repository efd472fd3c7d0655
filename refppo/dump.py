"""Write a PPO-step dump from inside any trainer, for ``refppo diff`` (format: spec/dump-format.md).

A few lines in the trainer, right after the step's losses are computed::

    from refppo.dump import write_dump
    write_dump(
        "step_000123.safetensors",
        {
            "response_mask": response_mask, "old_logprobs": old_logprobs, "ref_logprobs": ref_logprobs,
            "old_values": old_values, "scores": scores,                      # required inputs
            "logprobs": logprobs, "values": values,                          # update-step inputs
            "advantages": advantages, "returns": returns, "pg_loss": pg_loss, # outputs (any subset)
        },
        hparams={"gamma": 1.0, "lam": 0.95, "kl_coef": 0.05, "cliprange": 0.2,
                 "cliprange_value": 0.2, "vf_coef": 0.1},
        convention={"score_at": "after_last_valid"},
    )

Tensors are detached, moved to the CPU and made contiguous; ``response_mask`` is stored as uint8.
The hyperparameters and convention keys go to the sidecar ``<path>.json``. Both files are written
atomically (temp file, fsync, rename): a crash never leaves a half-written dump, nor a dump beside
another dump's sidecar.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from refppo.atomic import fsync_dir, fsync_file, honour_umask, temp_path


def _to_tensor(name: str, value: Any) -> Tensor:
    if isinstance(value, Tensor):
        t = value.detach()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        t = torch.tensor(float(value), dtype=torch.float64)
    else:
        try:
            import numpy as np

            t = torch.from_numpy(np.asarray(value))
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"{name}: expected a tensor, an array or a number, got {type(value).__name__}"
            ) from exc
    t = t.cpu().contiguous()
    if name == "response_mask":
        t = t.to(torch.uint8)
    return t


def _jsonable(value: Any) -> Any:
    value = getattr(value, "value", value)  # enums -> their names
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"hyperparameter value {value!r} is not finite")
    return value


def _as_dict(obj: Any) -> dict[str, Any]:
    if obj is None:
        return {}
    if is_dataclass(obj) and not isinstance(obj, type):
        to_dict = getattr(obj, "to_dict", None)
        data: dict[str, Any] = to_dict() if callable(to_dict) else asdict(obj)
        return data
    if isinstance(obj, Mapping):
        return dict(obj)
    raise TypeError(f"expected a mapping or a dataclass, got {type(obj).__name__}")


def sidecar_for(path: str | Path) -> Path:
    """The sidecar written beside a dump: ``<path>.json``."""
    p = Path(path)
    return p.with_name(p.name + ".json")


def write_dump(
    path: str | Path,
    tensors: Mapping[str, Any],
    hparams: Mapping[str, Any] | Any = None,
    convention: Mapping[str, Any] | Any = None,
) -> Path:
    """Write ``tensors`` to ``path`` (``.safetensors``, ``.pt`` or ``.npz``) and the sidecar JSON.

    ``hparams`` may be a mapping or a :class:`refppo.pipeline.Hyperparams`; ``convention`` a mapping,
    a :class:`refppo.pipeline.Convention` or a :class:`refppo.oracle.settings.Extras`. Returns the
    sidecar's path. Tensor values are written as given (no dtype change except the mask).
    """
    p = Path(path)
    data = {k: _to_tensor(k, v) for k, v in tensors.items()}
    suffix = p.suffix.lower()
    write: Callable[[Path], object]
    if suffix == ".safetensors":
        from safetensors.torch import save_file

        def write(tmp: Path) -> None:
            save_file(data, str(tmp))
    elif suffix == ".pt":

        def write(tmp: Path) -> None:
            torch.save(data, str(tmp))
    elif suffix == ".npz":
        import numpy as np

        arrays: dict[str, Any] = {k: v.numpy() for k, v in data.items()}

        def write(tmp: Path) -> None:
            np.savez(str(tmp), **arrays)  # tmp ends in .npz, so savez adds no suffix
    else:
        raise ValueError(f"{p}: unknown dump type {suffix!r}; use .safetensors, .pt or .npz")
    side: dict[str, Any] = {}
    side.update(_as_dict(hparams))
    side.update(_as_dict(convention))
    text = json.dumps({k: _jsonable(v) for k, v in side.items()}, indent=2, sort_keys=True) + "\n"
    # Crash safety (kill -9 at any point): both files are complete before either is renamed into
    # place, and the old dump goes first, so a dump is never paired with another dump's sidecar:
    # what a crash can leave is the old pair, no dump, or the new pair.
    p.parent.mkdir(parents=True, exist_ok=True)
    sc = sidecar_for(p)
    tmp_dump, tmp_side = temp_path(p, suffix), temp_path(sc)
    try:
        write(tmp_dump)
        honour_umask(tmp_dump)  # safetensors replaces the file with its own, made 0600
        fsync_file(tmp_dump)
        tmp_side.write_text(text)
        fsync_file(tmp_side)
        p.unlink(missing_ok=True)
        os.replace(tmp_side, sc)
        os.replace(tmp_dump, p)
    finally:
        tmp_dump.unlink(missing_ok=True)
        tmp_side.unlink(missing_ok=True)
    fsync_dir(p.parent)
    return sc


def pipeline_tensors(
    *,
    response_mask: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor,
    old_values: Tensor,
    scores: Tensor,
    rollout: Any = None,
    update: Any = None,
    logprobs: Tensor | None = None,
    values: Tensor | None = None,
    entropy: Tensor | None = None,
) -> dict[str, Tensor]:
    """The dump keys of a refppo step: inputs plus the fields of ``RolloutQuantities`` /
    ``UpdateQuantities`` (as returned by :mod:`refppo.pipeline`) when given."""
    out: dict[str, Tensor] = {
        "response_mask": response_mask,
        "old_logprobs": old_logprobs,
        "ref_logprobs": ref_logprobs,
        "old_values": old_values,
        "scores": scores,
    }
    for k, v in (("logprobs", logprobs), ("values", values), ("entropy", entropy)):
        if v is not None:
            out[k] = v
    if rollout is not None:
        for k in ("kl", "token_rewards", "advantages", "returns"):
            out[k] = getattr(rollout, k)
    if update is not None:
        for k in ("pg_loss", "vf_loss", "loss", "pg_clipfrac", "vf_clipfrac", "approx_kl"):
            out[k] = getattr(update, k)
        if entropy is not None:
            out["entropy_loss"] = update.entropy_loss
    return {k: v.detach() for k, v in out.items()}


__all__ = ["pipeline_tensors", "sidecar_for", "write_dump"]
