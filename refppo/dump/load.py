"""Loading and validating a dump (the contract is spec/dump-format.md).

Every problem raises :class:`DumpError` with a one-line message; the CLI turns it into exit code 2.
A ``.pt`` file is read with ``torch.load(weights_only=True)`` only, so a pickle that carries code is
refused without running it.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import mmap
import re
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from refppo.dump.keys import alias_table, misspelt_error, resolve_aliases, suggest
from refppo.errors import RefPPOError

REQUIRED_INPUTS: tuple[str, ...] = ("response_mask", "old_logprobs", "ref_logprobs", "scores")
CRITIC_INPUTS: tuple[str, ...] = ("old_values",)
"""Required unless the checked convention's estimator needs no critic (``advantage`` ≠ ``gae``):
checked by :func:`check_inputs_for` once the convention is known."""
UPDATE_INPUTS: tuple[str, ...] = ("logprobs", "values", "entropy")
TOKEN_OUTPUTS: tuple[str, ...] = ("kl", "token_rewards", "advantages", "returns")
SCALAR_OUTPUTS: tuple[str, ...] = (
    "pg_loss",
    "pg_clipfrac",
    "approx_kl",
    "vf_loss",
    "vf_clipfrac",
    "entropy_loss",
    "kl_loss",
    "loss",
)
TOKEN_KEYS: tuple[str, ...] = (
    "response_mask",
    "old_logprobs",
    "ref_logprobs",
    "old_values",
    "logprobs",
    "values",
    "entropy",
    *TOKEN_OUTPUTS,
)
GRAD_KEYS: tuple[str, ...] = ("grad_logprobs", "grad_values")
"""v2: ∂J/∂``logprobs`` and ∂J/∂``values`` of the whole optimizer step, [B, T] (spec/dump-format.md)."""
INTEGER_KEYS: set[str] = {"micro_batch", "rank", "group_index", "input_ids", "attention_mask", "position_ids"}
"""Keys whose tensors hold integers (kept as int64, never cast to the compute dtype)."""
ROW_INTEGER_KEYS: tuple[str, ...] = ("micro_batch", "rank", "group_index")
"""[B] integers: v2's micro-batch (per rank) and data-parallel rank of each row; ``group_index``, the
prompt each row answers (critic-free group estimators, issue #13)."""
SEQUENCE_KEYS: tuple[str, ...] = ("input_ids", "attention_mask", "position_ids")
"""The ``[B, P+T]`` sequences for re-scoring (validated by :mod:`refppo.dump.sequences`)."""
SIDECAR_SCORING_KEYS: frozenset[str] = frozenset({"temperature"})
"""Sidecar keys of the scoring pass (not PPO settings): read by the re-scoring, not by ``Setup``."""
STEP_KEYS: tuple[str, ...] = ("world_size", "micro_batches", "separate_critic")
"""v2 sidecar keys describing the optimizer step (read here, not by the settings)."""
KNOWN_KEYS: frozenset[str] = frozenset((*TOKEN_KEYS, "scores", *SCALAR_OUTPUTS, *GRAD_KEYS, *INTEGER_KEYS))
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
NEEDS_UPDATE: dict[str, tuple[str, ...]] = {
    "pg_loss": ("logprobs",),
    "pg_clipfrac": ("logprobs",),
    "approx_kl": ("logprobs",),
    "vf_loss": ("values",),
    "vf_clipfrac": ("values",),
    "entropy_loss": ("entropy",),
    "kl_loss": ("logprobs",),
    "loss": ("logprobs", "values"),
    "grad_logprobs": ("logprobs",),
    "grad_values": ("values",),
}
"""The update-step inputs each update-stage output is computed from (``loss``: ``logprobs`` alone
without a critic)."""
NEEDS_CRITIC: tuple[str, ...] = ("values", "vf_loss", "vf_clipfrac")
"""Keys that make no sense without ``old_values`` (the value loss is clipped around them)."""


class DumpError(RefPPOError):
    """A dump (or its hyperparameters) that the oracle cannot use; the message is one line."""


@dataclass(frozen=True)
class StepLayout:
    """v2 sidecar keys: ``world_size`` W and ``micro_batches`` K (per rank per optimizer step), and
    ``separate_critic`` (the critic has its own optimizer: the ``loss`` key holds no value term)."""

    world_size: int = 1
    micro_batches: int = 1
    separate_critic: bool = False


@dataclass
class Dump:
    """A validated dump: tensors in the compute dtype, the dump's own precision for tolerances."""

    path: Path
    tensors: dict[str, Tensor]
    """Every known key present, in the compute dtype (float64 for float64 dumps, else float32;
    ``response_mask`` as bool)."""
    mask: Tensor
    dtype: torch.dtype
    """Lowest floating precision among the trainer's tensors (decides the tolerances)."""
    hparams: dict[str, Any]
    """The sidecar's raw key/value pairs (validated later by the settings), less :data:`STEP_KEYS`."""
    hparams_path: Path | None
    ignored: list[str] = field(default_factory=list)
    """Tensor keys the format does not know (ignored)."""
    aliased: dict[str, str] = field(default_factory=dict)
    """Peer names read as dump keys (``{alias: key}``, :data:`refppo.dump.keys.ALIASES`)."""
    step: StepLayout = field(default_factory=lambda: StepLayout())
    """v2: how the rows were split over ranks and micro-batches (defaults: one of each)."""
    sidecar_keys: frozenset[str] | None = None
    """The keys of the sidecar as given (step keys included): None when there was none (no file
    beside the dump, no ``--hparams``, no hyperparameters given in memory)."""
    mapped: frozenset[str] = frozenset()
    """Keys whose tensor is the loader's own, memory-mapped from the file (safetensors, used in its
    own dtype): :meth:`release` may hand their pages back to the OS."""

    def release(self, key: str) -> None:
        """Hand the resident pages of the memory-mapped tensor ``key`` back to the OS, once it has
        been compared: it is read again from the file when next used (the same bytes: the mapping
        is never written). A trainer output is then resident only while it is compared, not for
        the whole check (a B=1024, T=8192 float32 key is 33.5 MB). A no-op for other keys and where
        the OS has no ``MADV_PAGEOUT`` (Linux ≥ 5.4)."""
        if key in self.mapped:
            page_out(self.tensors[key])

    def release_mapped(self) -> None:
        """:meth:`release` every memory-mapped key: called between the search's stages, so that
        under a stage's peak only the dumped keys that stage reads are resident (each is paged in
        again from the file on its next read). Nine float32 keys of a B=1024, T=8192 dump are
        302 MB; a stage reads two or three of them."""
        for key in sorted(self.mapped):
            page_out(self.tensors[key])

    def key_notes(self) -> list[str]:
        """What the loader did with the dump's names: aliases read, unknown keys ignored (with hints)."""
        notes = [f"read key {a!r} as {k} (a peer's name for it)" for a, k in sorted(self.aliased.items())]
        for k in self.ignored:
            hint = suggest(k, KNOWN_KEYS)
            notes.append(f"ignored unknown tensor key {k!r}" + (f" (did you mean {hint}?)" if hint else ""))
        return notes

    @property
    def B(self) -> int:  # noqa: N802  (B, T: the axis names used throughout refppo)
        return int(self.mask.shape[0])

    @property
    def T(self) -> int:  # noqa: N802
        return int(self.mask.shape[1])

    def has(self, key: str) -> bool:
        return key in self.tensors


def _load_raw(path: Path) -> dict[str, Any]:
    suffix = path.suffix.lower()
    if not path.is_file():
        raise DumpError(f"{path}: no such file")
    if suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            raw: dict[str, Any] = dict(load_file(str(path)))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise DumpError(f"{path}: not a readable safetensors file ({_one_line(exc)})") from None
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
            raise DumpError(f"{path}: not a readable .npz file without pickles ({_one_line(exc)})") from None
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
    why = _one_line(ValueError(useful[0])) if useful else type(exc).__name__
    return f"not a weights-only torch file of tensors ({why})"


def _one_line(exc: BaseException) -> str:
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
        raise DumpError(f"{path}: not a readable JSON file ({_one_line(exc)})") from None
    if not isinstance(data, dict):
        raise DumpError(f"{path}: expected a JSON object of hyperparameters, got {type(data).__name__}")
    return data


def load_dump(
    path: str | Path, hparams_file: str | Path | None = None, *, overlay: Mapping[str, Any] | None = None
) -> Dump:
    """Load and validate a dump (see the module docstring and spec/dump-format.md).

    ``overlay``: sidecar keys given in memory, laid over the sidecar file's (beside the dump, or
    ``hparams_file``); never silently dropped.
    """
    p = Path(path)
    raw = _load_raw(p)
    mmapped = p.suffix.lower() == ".safetensors"  # safetensors' load_file maps the file
    if not overlay:
        return validate(p, raw, hparams_file, mmapped=mmapped)
    if hparams_file is not None and not Path(hparams_file).is_file():
        raise DumpError(f"{hparams_file}: no such hyperparameter file")
    side = Path(hparams_file) if hparams_file is not None else sidecar_path(p)
    base = read_hparams(side) if side is not None else {}
    return validate(p, raw, hparams={**base, **overlay}, hparams_path=side, mmapped=mmapped)


def validate(
    p: Path,
    raw: dict[str, Any],
    hparams_file: str | Path | None = None,
    *,
    hparams: dict[str, Any] | None = None,
    hparams_path: Path | None = None,
    mmapped: bool = False,
) -> Dump:
    """Check keys, shapes, dtypes, finiteness and masks; convert to the compute dtype.

    ``hparams``: the sidecar's object given in memory (instead of a file beside ``p``);
    ``hparams_path``: the file part of it was read from, if any (named in errors and reports).
    ``mmapped``: ``raw``'s tensors are memory-mapped from ``p`` (safetensors): those used as they
    are (already in the compute dtype) are listed in :attr:`Dump.mapped`.
    """
    try:
        raw, aliased = resolve_aliases(p, raw)
    except ValueError as exc:
        raise DumpError(str(exc)) from None
    ignored = sorted(k for k in raw if k not in KNOWN_KEYS)
    missing = [k for k in REQUIRED_INPUTS if k not in raw]
    if missing:
        raise DumpError(f"{p}: missing required keys {missing}{_missing_hint(ignored)}")
    typo = misspelt_error(str(p), ignored, KNOWN_KEYS)
    if typo is not None:  # never compare fewer outputs than were dumped: a misspelt one is refused
        raise DumpError(typo)
    for k, v in raw.items():
        if k in KNOWN_KEYS and not isinstance(v, Tensor):
            raise DumpError(f"{p}: {k}: expected a tensor, got {type(v).__name__}")
    critic = "old_values" in raw
    given = [k for k in NEEDS_CRITIC if k in raw]
    if given and not critic:
        raise DumpError(
            f"{p}: missing required key 'old_values' (the critic's rollout values): {given} are given "
            "and need it (a critic-free dump leaves out every value quantity)"
        )
    for k, needs in NEEDS_UPDATE.items():
        if k == "loss" and not critic:
            needs = ("logprobs",)  # a critic-free step's loss has no value term
        absent = [n for n in needs if n not in raw]
        if k in raw and absent:
            raise DumpError(
                f"{p}: {k} is given but the update-step inputs {absent} it is computed from are not"
            )
    mask_raw: Tensor = raw["response_mask"]
    if mask_raw.dim() != 2:
        raise DumpError(f"{p}: response_mask: expected 2 dims [B, T], got shape {list(mask_raw.shape)}")
    if mask_raw.is_complex():
        raise DumpError(f"{p}: response_mask: expected bool or 0/1 numbers, got dtype {mask_raw.dtype}")
    B, T = (int(s) for s in mask_raw.shape)
    if B == 0 or T == 0:
        raise DumpError(f"{p}: response_mask: expected B >= 1 and T >= 1, got shape [{B}, {T}]")
    if mask_raw.dtype == torch.bool:
        mask = mask_raw
    else:
        # compared in its own dtype (a float64 copy of a B=1024, T=8192 mask is 64 MB)
        if not bool(((mask_raw == 0) | (mask_raw == 1)).all()):
            raise DumpError(f"{p}: response_mask: expected only 0/1 values")
        mask = mask_raw != 0
    empty = (~mask.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise DumpError(f"{p}: response_mask: rows {empty[:8]} have no valid token")
    # Interior holes (0 between 1s: multi-turn tool-output tokens) are accepted: the recompute
    # crosses them by the gae_holes / whiten_holes conventions (spec/dump-format.md, "Masks").
    out: dict[str, Tensor] = {"response_mask": mask}
    if any(k in raw for k in SEQUENCE_KEYS):
        from refppo.dump.sequences import validate_sequences

        try:
            out.update(validate_sequences(raw, mask))
        except ValueError as exc:
            raise DumpError(f"{p}: {exc}") from None
    dtypes: list[torch.dtype] = []
    hp_path: Path | None = hparams_path
    has_side = hparams is not None and (bool(hparams) or hparams_path is not None)
    if hparams is None:
        hp_path = Path(hparams_file) if hparams_file is not None else sidecar_path(p)
        if hparams_file is not None and not Path(hparams_file).is_file():
            raise DumpError(f"{hparams_file}: no such hyperparameter file")
        hparams = read_hparams(hp_path) if hp_path is not None else {}
        has_side = hp_path is not None
    sidecar_keys = frozenset(hparams) if has_side else None
    step = _step_layout(hp_path or p, hparams)
    hparams = {k: v for k, v in hparams.items() if k not in STEP_KEYS}
    for k in sorted((INTEGER_KEYS - set(SEQUENCE_KEYS)) & set(raw)):
        out[k] = _integer_key(p, k, raw[k], B)
    _check_rows(p, out, step, _sidecar_advice(p, hp_path, has_side))
    for k in KNOWN_KEYS:
        if k not in raw or k == "response_mask" or k in INTEGER_KEYS:
            continue
        t: Tensor = raw[k]
        if t.dtype not in _FLOATS:
            raise DumpError(f"{p}: {k}: expected a floating-point tensor, got dtype {t.dtype}")
        if k in TOKEN_KEYS or k in GRAD_KEYS:
            if tuple(t.shape) != (B, T):
                raise DumpError(
                    f"{p}: {k}: expected shape [B, T] = [{B}, {T}] (from response_mask), got {list(t.shape)}"
                )
        elif k == "scores":
            if tuple(t.shape) != (B,):
                raise DumpError(
                    f"{p}: scores: expected shape [B] = [{B}] (from response_mask), got {list(t.shape)}"
                )
        elif t.numel() != 1 or t.dim() > 1:
            raise DumpError(f"{p}: {k}: expected a 0-dim scalar, got shape {list(t.shape)}")
        dtypes.append(t.dtype)
        out[k] = t.detach().reshape(()) if k in SCALAR_OUTPUTS else t.detach()
    order = {torch.float16: 0, torch.bfloat16: 0, torch.float32: 1, torch.float64: 2}
    dtype = min(dtypes, key=lambda d: order[d]) if dtypes else torch.float64
    # Compute in float64 for float64 dumps, else in float32 (its error is far below the float32
    # tolerances, and it halves the memory traffic of a B=256, T=2048 step).
    cdtype = torch.float64 if dtype == torch.float64 else torch.float32
    for k in list(out):
        if k == "response_mask" or k in INTEGER_KEYS:
            continue
        tc = out[k].to(cdtype)
        checked = k in REQUIRED_INPUTS or k in CRITIC_INPUTS or k in UPDATE_INPUTS
        if checked and not math.isfinite(float(tc.sum())):
            finite = torch.isfinite(tc)  # slow path only when the one-pass sum says something is off
            bad = ~finite if k == "scores" else (~finite & mask)
            if bool(bad.any()):
                where = [int(i) for i in bad.nonzero()[0]]
                raise DumpError(f"{p}: {k}: non-finite value at valid position {where}")
        out[k] = tc
    if "temperature" in hparams:
        tau: Any = hparams["temperature"]
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not (math.isfinite(tau) and tau > 0):
            raise DumpError(f"{hp_path or p}: temperature: expected a finite number > 0, got {tau!r}")
    mapped = frozenset(
        k for k, v in out.items() if mmapped and k in raw and k != "response_mask" and _same_bytes(v, raw[k])
    )
    return Dump(p, out, mask, dtype, hparams, hp_path, ignored, aliased, step, sidecar_keys, mapped)


def _same_bytes(a: Tensor, b: Any) -> bool:
    """``a`` is ``b`` or a view of all of its bytes (``detach``, ``reshape``, a no-op ``to``)."""
    return isinstance(b, Tensor) and a.data_ptr() == b.data_ptr() and a.nbytes == b.nbytes


_MADV_PAGEOUT = 21
"""Linux ``MADV_PAGEOUT`` (include/uapi/asm-generic/mman-common.h): reclaim these pages now. File
pages are dropped (re-read on the next access); anonymous ones go to swap or stay: never lost."""


def page_out(t: Tensor) -> None:
    """``madvise(MADV_PAGEOUT)`` over the whole pages of ``t``'s bytes (see :meth:`Dump.release`).

    Only a hint: the tensor's values are unchanged whatever the kernel does; nothing happens off
    Linux or when the call fails.
    """
    if sys.platform != "linux" or t.device.type != "cpu" or not t.is_contiguous():
        return
    madvise = _madvise()
    if madvise is None:
        return
    page = mmap.PAGESIZE
    start, nbytes = t.data_ptr(), t.numel() * t.element_size()
    lo, hi = -(-start // page) * page, (start + nbytes) // page * page
    if hi > lo:
        madvise(lo, hi - lo, _MADV_PAGEOUT)


@functools.cache
def _madvise() -> Any:
    """libc's ``madvise`` through ctypes, or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim(0)``): called between the
    oracle's stages, so that the blocks freed by one stage (``[B, T]`` rows of a few MiB, which
    glibc keeps in its heap once its dynamic mmap threshold has grown) do not stay resident under
    the next stage's peak. Changes no setting and no value; a no-op off glibc."""
    fn = _malloc_trim()
    if fn is not None:
        fn(0)


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim`` through ctypes, or None (other platforms and C libraries)."""
    if sys.platform != "linux":
        return None
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def _step_layout(path: Path, hparams: dict[str, Any]) -> StepLayout:
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
    return StepLayout(**vals)


def _integer_key(p: Path, k: str, t: Tensor, B: int) -> Tensor:
    """An integer-valued key as int64 (``micro_batch``, ``rank`` and ``group_index`` are ``[B]``)."""
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise DumpError(f"{p}: {k}: expected an integer tensor, got dtype {t.dtype}")
    if k in ROW_INTEGER_KEYS and tuple(t.shape) != (B,):
        raise DumpError(f"{p}: {k}: expected shape [B] = [{B}] (from response_mask), got {list(t.shape)}")
    return t.detach().to(torch.int64)


def _sidecar_advice(p: Path, hp_path: Path | None, has_side: bool) -> str:
    """Where to set a sidecar key, as the user gave (or did not give) the sidecar."""
    if hp_path is not None:
        return f"set {{key}} in the sidecar {hp_path}"
    if has_side:
        return "set {key} in the hyperparameters given with the tensors"
    return (
        f"there is no sidecar: write {p.name}.json beside the dump with {{key}} and the run's "
        "hyperparameters, or pass --hparams FILE"
    )


def _check_rows(p: Path, out: dict[str, Tensor], step: StepLayout, advice: str) -> None:
    """``rank`` in ``[0, world_size)`` and ``micro_batch`` in ``[0, micro_batches)``; ``advice``
    (:func:`_sidecar_advice`) says where to set the sidecar key."""
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


def check_inputs_for(dump: Dump, advantage: str) -> None:
    """The inputs the estimator ``advantage`` needs: ``old_values`` for ``gae``, ``group_index`` for a
    group estimator (``grpo``, ``dr-grpo``, ``rloo``, ``reinforce++-baseline``, ``opo``, ``gpg``,
    ``grpo-passk``; ``flash-reinforce``'s baseline is the batch mean). One-line DumpError."""
    if advantage == "gae" and "old_values" not in dump.tensors:
        raise DumpError(
            f"{dump.path}: missing required key 'old_values' (advantage=gae needs the critic's rollout "
            "values; a critic-free dump names its estimator: --set advantage=grpo, rloo, reinforce++, ...)"
        )
    if advantage not in ("gae", "reinforce++", "flash-reinforce") and "group_index" not in dump.tensors:
        raise DumpError(
            f"{dump.path}: missing key 'group_index' (advantage={advantage} needs [B] integers: "
            "the prompt each row answers)"
        )


def _missing_hint(unknown: list[str]) -> str:
    """ "did you mean" for the dump's unknown keys, else the accepted peer names (one line)."""
    hints = [f"{k!r} -> {s}" for k in unknown if (s := suggest(k, KNOWN_KEYS)) is not None]
    if hints:
        return f"; did you mean {', '.join(hints)}?"
    if unknown:
        return f"; unknown keys {unknown[:8]}; peer names accepted: {alias_table()}"
    return ""


@dataclass(frozen=True)
class Tolerance:
    """``|dump − ref| <= atol + rtol·max|ref|`` over the compared positions of one quantity."""

    rtol: float
    atol: float

    def of(self, ref_scale: float) -> float:
        return self.atol + self.rtol * (ref_scale if math.isfinite(ref_scale) else 0.0)


TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(rtol=1e-7, atol=1e-9),
    torch.float32: Tolerance(rtol=2e-4, atol=1e-5),
    torch.bfloat16: Tolerance(rtol=2e-2, atol=1e-2),
    torch.float16: Tolerance(rtol=5e-3, atol=2e-3),
}
