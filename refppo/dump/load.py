"""Loading and validating a dump (the contract is spec/dump-format.md): :func:`load_dump` reads the
file (:mod:`refppo.dump.files`) and :func:`validate` checks it against the key schema
(:mod:`refppo.dump.keys`) and the step layout (:mod:`refppo.dump.step`) into a :class:`Dump`.

Every problem raises :class:`refppo.errors.DumpError` with a one-line message; the CLI turns it into
exit code 2. A ``.pt`` file is read with ``torch.load(weights_only=True)`` only, so a pickle that
carries code is refused without running it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from refppo.dump.files import read_hparams, read_tensors, sidecar_path
from refppo.dump.keys import (
    CRITIC_INPUTS,
    GRAD_KEYS,
    INTEGER_KEYS,
    KNOWN_KEYS,
    NEEDS_CRITIC,
    NEEDS_UPDATE,
    OPTIONAL_INPUTS,
    REQUIRED_INPUTS,
    ROW_FLOAT_KEYS,
    SCALAR_OUTPUTS,
    SEQUENCE_KEYS,
    STEP_KEYS,
    TOKEN_KEYS,
    UPDATE_INPUTS,
    alias_table,
    misspelt_error,
    resolve_aliases,
    sampling_problem,
    suggest,
)
from refppo.dump.residency import fix_mmap_threshold, page_out, trim_heap, unmap_pages
from refppo.dump.step import StepLayout, check_rows, integer_key, sidecar_advice, step_layout
from refppo.errors import DumpError

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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
        302 MB; a stage reads two or three of them. The C heap's free pages go back too
        (:func:`refppo.dump.residency.trim_heap`): what the stage before freed is not resident
        under the next one's peak."""
        for key in sorted(self.mapped):
            page_out(self.tensors[key])
        trim_heap()
        fix_mmap_threshold()  # from now on a freed [B, T] temporary is not kept in the heap

    def release_except(self, keep: Iterable[str]) -> None:
        """Unmap the resident pages of every memory-mapped key not in ``keep``
        (:func:`refppo.dump.residency.unmap_pages`; no heap trim): a step that rebuilds an earlier
        step's state (a replayed group reads the dumped inputs again) or a check that reads a few
        keys drops the others from its resident set before it allocates its own tensors. The pages
        stay in the page cache: the next read maps them again without reading the file."""
        kept = set(keep)
        for key in sorted(self.mapped - kept):
            unmap_pages(self.tensors[key])

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


def load_dump(
    path: str | Path, hparams_file: str | Path | None = None, *, overlay: Mapping[str, Any] | None = None
) -> Dump:
    """Load and validate a dump (see the module docstring and spec/dump-format.md).

    ``overlay``: sidecar keys given in memory, laid over the sidecar file's (beside the dump, or
    ``hparams_file``); never silently dropped.
    """
    p = Path(path)
    raw = read_tensors(p)
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

    The checks run in this order (a dump wrong in two ways is refused for the first): key names,
    ``response_mask``, the re-scoring sequences, the sidecar and the step layout, the integer keys,
    the floating-point tensors' dtypes and shapes, finiteness in the compute dtype, the sampling keys
    (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``logprobs_processed``), ``policy_version``.
    """
    try:
        raw, aliased = resolve_aliases(p, raw)
    except ValueError as exc:
        raise DumpError(str(exc)) from None
    ignored = _check_keys(p, raw)
    mask = _response_mask(p, raw)
    B, T = (int(s) for s in mask.shape)
    out: dict[str, Tensor] = {"response_mask": mask}
    if any(k in raw for k in SEQUENCE_KEYS):
        from refppo.dump.sequences import validate_sequences

        try:
            out.update(validate_sequences(raw, mask))
        except ValueError as exc:
            raise DumpError(f"{p}: {exc}") from None
    hparams, hp_path, has_side = _sidecar(p, hparams_file, hparams, hparams_path)
    sidecar_keys = frozenset(hparams) if has_side else None
    step = step_layout(hp_path or p, hparams)
    hparams = {k: v for k, v in hparams.items() if k not in STEP_KEYS}
    for k in sorted((INTEGER_KEYS - set(SEQUENCE_KEYS)) & set(raw)):
        out[k] = integer_key(p, k, raw[k], B)
    check_rows(p, out, step, sidecar_advice(p, hp_path, has_side))
    dtypes = _float_tensors(p, raw, out, B, T)
    order = {torch.float16: 0, torch.bfloat16: 0, torch.float32: 1, torch.float64: 2}
    dtype = min(dtypes, key=lambda d: order[d]) if dtypes else torch.float64
    _to_compute_dtype(p, out, dtype)
    bad_sampling = sampling_problem(hparams)
    if bad_sampling is not None:
        raise DumpError(f"{hp_path or p}: {bad_sampling}")
    if "policy_version" in out and bool((out["policy_version"] < 0).any()):
        raise DumpError(f"{p}: policy_version: expected integers >= 0 (the policy update of each row)")
    mapped = frozenset(
        k for k, v in out.items() if mmapped and k in raw and k != "response_mask" and _same_bytes(v, raw[k])
    )
    return Dump(p, out, mask, dtype, hparams, hp_path, ignored, aliased, step, sidecar_keys, mapped)


def _check_keys(p: Path, raw: dict[str, Any]) -> list[str]:
    """The keys the format does not know (sorted), once the required ones are present, none is a
    misspelt known key, every known one is a tensor, and every value or update-stage output has
    the inputs it is computed from."""
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
    return ignored


def _response_mask(p: Path, raw: dict[str, Any]) -> Tensor:
    """``response_mask`` as a bool ``[B, T]`` with B, T ≥ 1, 0/1 values and a valid token per row.

    Interior holes (0 between 1s: multi-turn tool-output tokens) are accepted: the recompute
    crosses them by the gae_holes / whiten_holes conventions (spec/dump-format.md, "Masks")."""
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
        raise DumpError(
            f"{p}: response_mask: rows {empty[:8]} have no valid token (a row masked out of the loss "
            "but kept in the row count: dump its tokens, flag it in `truncated`, "
            "--set truncated_rows=mask_in_loss)"
        )
    return mask


def _sidecar(
    p: Path, hparams_file: str | Path | None, hparams: dict[str, Any] | None, hparams_path: Path | None
) -> tuple[dict[str, Any], Path | None, bool]:
    """``(the sidecar's object, its file, whether there is a sidecar)``: ``hparams`` as given in
    memory, else ``hparams_file``, else the file beside ``p`` (:func:`refppo.dump.files.sidecar_path`)."""
    hp_path: Path | None = hparams_path
    has_side = hparams is not None and (bool(hparams) or hparams_path is not None)
    if hparams is None:
        hp_path = Path(hparams_file) if hparams_file is not None else sidecar_path(p)
        if hparams_file is not None and not Path(hparams_file).is_file():
            raise DumpError(f"{hparams_file}: no such hyperparameter file")
        hparams = read_hparams(hp_path) if hp_path is not None else {}
        has_side = hp_path is not None
    return hparams, hp_path, has_side


def _float_tensors(p: Path, raw: dict[str, Any], out: dict[str, Tensor], B: int, T: int) -> list[torch.dtype]:
    """Every known floating-point key into ``out`` (detached; scalars as 0-dim), after its dtype and
    shape are checked (``[B, T]`` token keys and gradients, ``[B]`` scores, scalars); returns their
    dtypes."""
    dtypes: list[torch.dtype] = []
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
        elif k in ROW_FLOAT_KEYS:
            if tuple(t.shape) != (B,):
                raise DumpError(
                    f"{p}: {k}: expected shape [B] = [{B}] (from response_mask), got {list(t.shape)}"
                )
        elif t.numel() != 1 or t.dim() > 1:
            raise DumpError(f"{p}: {k}: expected a 0-dim scalar, got shape {list(t.shape)}")
        dtypes.append(t.dtype)
        out[k] = t.detach().reshape(()) if k in SCALAR_OUTPUTS else t.detach()
    return dtypes


def _to_compute_dtype(p: Path, out: dict[str, Tensor], dtype: torch.dtype) -> None:
    """Every floating-point tensor of ``out`` in the compute dtype, in place: float64 for float64
    dumps, else float32 (its error is far below the float32 tolerances, and it halves the memory
    traffic of a B=256, T=2048 step). The inputs must be finite at valid positions (every row of
    ``scores``)."""
    mask = out["response_mask"]
    cdtype = torch.float64 if dtype == torch.float64 else torch.float32
    for k in list(out):
        if k == "response_mask" or k in INTEGER_KEYS:
            continue
        tc = out[k].to(cdtype)
        checked = k in REQUIRED_INPUTS or k in CRITIC_INPUTS or k in UPDATE_INPUTS or k in OPTIONAL_INPUTS
        if checked and not math.isfinite(float(tc.sum())):
            finite = torch.isfinite(tc)  # slow path only when the one-pass sum says something is off
            bad = ~finite if k in ROW_FLOAT_KEYS else (~finite & mask)
            if bool(bad.any()):
                where = [int(i) for i in bad.nonzero()[0]]
                raise DumpError(f"{p}: {k}: non-finite value at valid position {where}")
        out[k] = tc


def _same_bytes(a: Tensor, b: Any) -> bool:
    """``a`` is ``b`` or a view of all of its bytes (``detach``, ``reshape``, a no-op ``to``)."""
    return isinstance(b, Tensor) and a.data_ptr() == b.data_ptr() and a.nbytes == b.nbytes


def _missing_hint(unknown: list[str]) -> str:
    """ "did you mean" for the dump's unknown keys, else the accepted peer names (one line)."""
    hints = [f"{k!r} -> {s}" for k in unknown if (s := suggest(k, KNOWN_KEYS)) is not None]
    if hints:
        return f"; did you mean {', '.join(hints)}?"
    if unknown:
        return f"; unknown keys {unknown[:8]}; peer names accepted: {alias_table()}"
    return ""


__all__ = ["Dump", "load_dump", "validate"]
