"""Reading a dump's file and its sidecar: ``.safetensors`` (memory-mapped), ``.pt`` through
``torch.load(weights_only=True)`` only (a pickle that carries code is refused without running it)
and ``.npz`` without pickles; the sidecar ``<dump>.json``. Every problem is a one-line
:class:`refppo.errors.DumpError`.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from refppo.errors import DumpError


def read_tensors(path: Path) -> dict[str, Any]:
    """The file's name -> tensor pairs, as stored (validated by :func:`refppo.dump.load.validate`)."""
    suffix = path.suffix.lower()
    if not path.is_file():
        raise DumpError(f"{path}: no such file")
    if suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            raw: dict[str, Any] = dict(load_file(str(path)))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise DumpError(f"{path}: not a readable safetensors file ({one_line(exc)})") from None
        return raw
    if suffix == ".pt":
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # pickle-protocol notices of the restricted unpickler
                obj = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as exc:  # any failure of the restricted unpickler is a refusal
            raise DumpError(f"{path}: refused: {_pt_refusal(exc)}") from None
        if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
            raise DumpError(f"{path}: expected a dict of name -> tensor, got {type(obj).__name__}")
        return dict(obj)
    if suffix == ".npz":
        import numpy as np

        try:
            with np.load(str(path), allow_pickle=False) as npz:
                return {k: torch.from_numpy(np.array(npz[k])) for k in npz.files}
        except Exception as exc:  # numpy raises ValueError/OSError/zipfile errors
            raise DumpError(f"{path}: not a readable .npz file without pickles ({one_line(exc)})") from None
    raise DumpError(f"{path}: unknown file type {suffix or '(none)'!r}; expected .safetensors, .pt or .npz")


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _pt_refusal(exc: BaseException) -> str:
    """Why ``torch.load(weights_only=True)`` refused a ``.pt`` file, in one clean line: the global a
    pickle names (``posix.system``) when it names one, else the first line of torch's message that
    is not its advice to load with ``weights_only=False`` (never repeated: it runs the pickle's
    code). ANSI colour codes are dropped."""
    text = _ANSI.sub("", str(exc))
    found = re.search(r"GLOBAL\s+([\w.]+)", text)
    if found:
        return (
            f"it is a pickle that calls {found.group(1)}, which the weights-only unpickler blocks "
            "(a .pt dump holds a dict of tensors only)"
        )
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    useful = [ln for ln in lines if "weights_only" not in ln and "PyTorch 2.6" not in ln]
    why = one_line(ValueError(useful[0])) if useful else type(exc).__name__
    return f"not a weights-only torch file of tensors ({why})"


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return (text[:200] + "...") if len(text) > 200 else text


def sidecar_path(path: Path) -> Path | None:
    """``<dump>.json`` (e.g. ``step.safetensors.json``), else ``step.json``; None when neither exists."""
    for cand in (path.with_name(path.name + ".json"), path.with_suffix(".json")):
        if cand.is_file():
            return cand
    return None


def read_hparams(path: Path) -> dict[str, Any]:
    """A JSON object of hyperparameters and convention keys (keys are checked by the settings)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DumpError(f"{path}: not a readable JSON file ({one_line(exc)})") from None
    if not isinstance(data, dict):
        raise DumpError(f"{path}: expected a JSON object of hyperparameters, got {type(data).__name__}")
    return data
