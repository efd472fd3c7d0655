"""Write a PPO-step dump from inside any trainer, for ``refppo diff`` (format: spec/dump-format.md).

A few lines in the trainer, right after the step's losses are computed::

    from refppo.dump.write import write_dump
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
from refppo.conventions import parse
from refppo.dump.keys import (
    KNOWN_KEYS,
    SIDECAR_SAMPLING_KEYS,
    SIDECAR_SCORING_KEYS,
    STEP_KEYS,
    misspelt_error,
    sampling_problem,
)
from refppo.errors import DumpError, RefPPOError
from refppo.pipeline.settings import CONVENTION_KEYS, HPARAM_KEYS, Hyperparams, enum_keys

CONVENTION_FIELDS: frozenset[str] = frozenset(CONVENTION_KEYS)
HPARAM_FIELDS: frozenset[str] = frozenset(HPARAM_KEYS)
SIDECAR_KEYS: frozenset[str] = frozenset(
    (*CONVENTION_FIELDS, *HPARAM_FIELDS, *SIDECAR_SCORING_KEYS, *SIDECAR_SAMPLING_KEYS, *STEP_KEYS)
)
"""Every key a sidecar may hold (spec/dump-format.md, "Hyperparameters and conventions")."""


def check_sidecar(where: str, side: Mapping[str, Any]) -> None:
    """Refuse (``DumpError``, one line naming ``where`` and the key) a sidecar key the oracle does
    not know, with its "did you mean", a name the convention key does not have
    (``loss_agg="token_mean"``) and a hyperparameter number out of its range: the error at the
    trainer's line, not at diff time."""
    import difflib

    for key in sorted(side):
        if key not in SIDECAR_KEYS:
            close = difflib.get_close_matches(key, sorted(SIDECAR_KEYS), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else " (spec/dump-format.md lists the keys)"
            raise DumpError(f"{where}: unknown sidecar key {key!r}{hint}")
    # values as the oracle will read them (refppo.oracle.check.settings.parse_value): a name of an enum
    # key must be one of its names; a number must be in its range (strings of numbers, "none" and
    # the other spellings the oracle accepts are left to it)
    bad_sampling = sampling_problem(side)
    if bad_sampling is not None:
        raise DumpError(f"{where}: {bad_sampling}")
    names = enum_keys()
    nums = {k: v for k, v in side.items() if k in HPARAM_FIELDS and _is_number(v)}
    try:
        for k, v in side.items():
            if k in names and isinstance(v, str) and v.strip().lower() not in ("none", "null", "off", ""):
                parse(names[k], v.strip(), what=k)
        Hyperparams(**nums)
    except RefPPOError as exc:
        raise DumpError(f"{where}: {' '.join(str(exc).split())}") from None


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


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


def _writer(p: Path, suffix: str, data: dict[str, Tensor]) -> Callable[[Path], object]:
    """The function that writes ``data`` to a temporary path in the format of ``suffix``."""
    if suffix == ".safetensors":
        from safetensors.torch import save_file

        return lambda tmp: save_file(data, str(tmp))
    if suffix == ".pt":
        return lambda tmp: torch.save(data, str(tmp))
    if suffix == ".npz":
        import numpy as np

        arrays: dict[str, Any] = {k: v.numpy() for k, v in data.items()}
        return lambda tmp: np.savez(str(tmp), **arrays)  # tmp ends in .npz, so savez adds no suffix
    raise ValueError(f"{p}: unknown dump type {suffix!r}; use .safetensors, .pt or .npz")


def write_dump(
    path: str | Path,
    tensors: Mapping[str, Any],
    hparams: Mapping[str, Any] | Any = None,
    convention: Mapping[str, Any] | Any = None,
) -> Path:
    """Write ``tensors`` to ``path`` (``.safetensors``, ``.pt`` or ``.npz``) and the sidecar JSON.

    ``hparams`` may be a mapping or a :class:`refppo.pipeline.settings.Hyperparams`; ``convention`` a
    mapping or a :class:`refppo.pipeline.settings.Convention`. Returns the sidecar's path. Tensor
    values are written as given (no dtype change except the mask).

    A key that evidently misspells a dump key or a peer alias (``pgloss``, ``grad_log_probs``,
    ``advantage``: :func:`refppo.dump.keys.misspelt`) raises ``DumpError`` naming it, with its
    "did you mean", and nothing is written: ``refppo diff`` would refuse the dump. Other unknown
    keys are written (the oracle lists them as ignored). So is a sidecar key the oracle does not
    know, or a convention value it refuses (:func:`check_sidecar`).
    """
    p = Path(path)
    typo = misspelt_error(f"write_dump {p}", list(tensors), KNOWN_KEYS)
    if typo is not None:  # what the oracle would refuse at load time, refused before it is written
        raise DumpError(typo)
    data = {k: _to_tensor(k, v) for k, v in tensors.items()}
    suffix = p.suffix.lower()
    write = _writer(p, suffix, data)
    side: dict[str, Any] = {}
    side.update(_as_dict(hparams))
    side.update(_as_dict(convention))
    check_sidecar(f"write_dump {p}", side)
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


__all__ = ["SIDECAR_KEYS", "check_sidecar", "pipeline_tensors", "sidecar_for", "write_dump"]
