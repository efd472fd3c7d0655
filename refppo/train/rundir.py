"""The run directory (``run.out_dir``): one run per directory, and what ``--overwrite`` may delete.

A run directory holds exactly one run. Its identity file ``run.json`` is written when the run
starts::

    {"format": "refppo-run/1", "run_id": "<uuid4 hex>", "config_hash": "<sha256>", "created_utc": "..."}

``config_hash`` is the SHA-256 of the resolved config (sorted JSON) without the ``[run]`` keys that
may change on ``--resume`` (:data:`refppo.train.checkpointing.RESUMABLE_KEYS`). Every checkpoint's
``state.json`` repeats ``run_id`` and ``config_hash``; ``--resume`` refuses a checkpoint whose
``run_id`` is not the directory's (a checkpoint of another run) and a config whose hash differs.

**A refppo upgrade that adds a config key does not strand a run.** The contract for adding a key:
its default is what older versions did (they had no such key). So ``--resume`` accepts a
checkpoint whose saved config lacks keys of this version's config (an *absent* key; a whole
absent section counts as all its keys absent), provided each absent key (outside the resumable
``[run]`` keys) is at its default; an absent key set to another value is refused, named in one
line (resuming would change the run). A key in the saved config that this version does not know is
refused, named in one line. The run keeps its identity: the hashes compared are ``run.json``'s,
the checkpoint's and the hash of this config *without its absent keys*
(:func:`without_keys`), i.e. what the older refppo computed. Checkpoints written after such a
resume store the config without the absent keys and that same hash, so they look like the
run's first checkpoints and resume the same way, as often as needed. ``config.json``, by contrast,
is the full resolved config of the latest invocation (rewritten by every start and resume, new keys
included), so after such a resume it holds keys that ``run.json``'s hash does not cover: the hash is
the run's, over the keys the run started with. Checked on real run directories written by older
commits (``tests/train/fixtures/old_runs/``, ``tests/train/test_resume_old_release.py``): every checkpoint
file of theirs (weights, optimizer and RNG states, ``state.json``, ``COMPLETE``, ``run.json``) still
loads, and the resumed iteration is bit-identical to the one that commit computed itself.

The rule for an existing, non-empty ``run.out_dir`` (a fresh run, i.e. without ``--resume``):

* without ``--overwrite``: refused (one line, exit 2) — nothing is written or deleted;
* with ``--overwrite``: only the entries refppo writes are deleted — :data:`OWNED_FILES`,
  ``.tmp-*`` files of those names, ``checkpoints/{iter_*, .tmp-*}`` and
  ``tensorboard/events.out.tfevents.*`` (each folder removed only if that left it empty) — and only
  when ``run.json`` says the directory is a refppo run. Any other entry is kept (and named). A
  directory that holds refppo-looking names (``config.json``, ``checkpoints/``, ...) but no valid
  ``run.json`` is not known to be a refppo run: ``--overwrite`` refuses it and deletes nothing.
  Symbolic links are unlinked, never followed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from refppo.atomic import TMP_PREFIX, atomic_write_text
from refppo.errors import RefPPOError

RUN_FILE = "run.json"
"""The run identity file, written when a run starts."""
FORMAT = "refppo-run/1"
"""``format`` of :data:`RUN_FILE`."""
OWNED_FILES = (RUN_FILE, "config.json", "metrics.jsonl", "plot.png")
"""Files refppo writes at the top of a run directory."""
OWNED_DIRS = ("checkpoints", "tensorboard")
"""Folders refppo writes in a run directory (only their refppo entries are ever deleted)."""


class RunDirError(RefPPOError):
    """An output directory that a run may not use (another run's, or not refppo's)."""


@dataclass(frozen=True)
class RunIdentity:
    """The content of ``run.json``."""

    run_id: str
    config_hash: str
    created_utc: str

    def to_dict(self) -> dict[str, str]:
        """``run.json``'s JSON object."""
        return {
            "format": FORMAT,
            "run_id": self.run_id,
            "config_hash": self.config_hash,
            "created_utc": self.created_utc,
        }


def config_hash(config: Mapping[str, Mapping[str, Any]], resumable: Iterable[str]) -> str:
    """SHA-256 (hex) of ``config`` (``TrainConfig.to_dict()``) as sorted JSON, without the ``[run]``
    keys in ``resumable`` — the part of the config that a resumed run must share."""
    skip = set(resumable)
    kept = {
        section: {k: v for k, v in values.items() if not (section == "run" and k in skip)}
        for section, values in config.items()
    }
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode("utf-8")).hexdigest()


def new_identity(cfg_hash: str) -> RunIdentity:
    """A fresh identity (random run id) for a run starting now."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return RunIdentity(uuid.uuid4().hex, cfg_hash, now)


def read_identity(out_dir: str | Path) -> RunIdentity | None:
    """``run.json`` of ``out_dir``; None when there is none; :class:`RunDirError` when it is broken."""
    f = Path(out_dir) / RUN_FILE
    if not f.exists():
        return None
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunDirError(f"{f}: not a readable run identity file ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise RunDirError(f'{f}: not a refppo run identity file (no "format": {FORMAT!r})')
    try:
        return RunIdentity(str(data["run_id"]), str(data["config_hash"]), str(data.get("created_utc", "")))
    except KeyError as e:
        raise RunDirError(f"{f}: missing key {e.args[0]!r}") from None


def write_identity(out_dir: str | Path, ident: RunIdentity) -> Path:
    """Write ``run.json`` atomically."""
    return atomic_write_text(Path(out_dir) / RUN_FILE, json.dumps(ident.to_dict(), indent=2) + "\n")


def _section(config: Mapping[str, Any], section: str) -> Mapping[str, Any]:
    values = config.get(section)
    return values if isinstance(values, Mapping) else {}


def absent_keys(
    saved: Any, config: Mapping[str, Mapping[str, Any]], resumable: Iterable[str]
) -> tuple[str, ...]:
    """``SECTION.KEY`` of each key of ``config`` that the saved config ``saved`` (a checkpoint's;
    not a mapping: empty) lacks, outside the ``resumable`` ``[run]`` keys: keys added to refppo
    since the run began."""
    skip = set(resumable)
    saved = saved if isinstance(saved, Mapping) else {}
    return tuple(
        f"{section}.{key}"
        for section, values in config.items()
        for key in values
        if not (section == "run" and key in skip) and key not in _section(saved, section)
    )


def without_keys(config: Mapping[str, Mapping[str, Any]], keys: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``config`` without the ``SECTION.KEY`` ``keys``; a section that loses all its keys is dropped
    (the older refppo had no such section). With :func:`absent_keys` as ``keys``: the config as the
    run's older refppo wrote it, whose :func:`config_hash` is that refppo's."""
    drop = {tuple(k.split(".", 1)) for k in keys}
    out: dict[str, dict[str, Any]] = {}
    for section, values in config.items():
        kept = {k: v for k, v in values.items() if (section, k) not in drop}
        if kept or not values:
            out[section] = kept
    return out


def _unknown_keys(saved: Mapping[str, Any], config: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Keys (``SECTION.KEY``, or a whole ``SECTION``) of the saved config that ``config`` lacks."""
    out: list[str] = []
    for section, values in saved.items():
        known = config.get(section)
        if known is None or not isinstance(values, Mapping):
            out.append(str(section))
        else:
            out.extend(f"{section}.{key}" for key in values if key not in known)
    return out


_NO_DEFAULT = object()


def _absent_changes(
    absent: Iterable[str], config: Mapping[str, Mapping[str, Any]], defaults: Mapping[str, Mapping[str, Any]]
) -> str | None:
    """The one line refusing absent keys that are not at their default; None if all are."""
    changed = []
    for name in absent:
        section, key = name.split(".", 1)
        value, default = config[section][key], _section(defaults, section).get(key, _NO_DEFAULT)
        if value != default:
            had = "" if default is _NO_DEFAULT else f"{name}={default!r}"
            changed.append((f"{name}={value!r}", had))
    if not changed:
        return None
    one = len(changed) == 1
    return (
        f"--resume: {', '.join(c for c, _ in changed)} {'is' if one else 'are'} not in the checkpoint's "
        f"config (written by an older refppo, which had no such key{'' if one else 's'}): resuming "
        "would change the run"
        + (f" (it ran as {', '.join(h for _, h in changed if h)})" if any(h for _, h in changed) else "")
    )


def resume_mismatch(
    state: Mapping[str, Any],
    ident: RunIdentity,
    config: Mapping[str, Mapping[str, Any]],
    cfg_hash: str,
    resumable: Iterable[str],
    path: Path,
    *,
    defaults: Mapping[str, Mapping[str, Any]] | None = None,
) -> str | None:
    """Why the checkpoint at ``path`` (its ``state.json``: ``state``) may not be resumed by this run
    (identity ``ident`` from ``run.json``, resolved ``config`` with hash ``cfg_hash``); None if it may.
    Refused: another run id (or none); a saved key this version does not know; a key absent from
    the saved config (:func:`absent_keys`) that is not at its value in ``defaults`` (the default
    config; None: no absent key is accepted); a config that differs outside the ``resumable``
    ``[run]`` keys (each difference listed); differing config hashes (``run.json``'s, the
    checkpoint's, and this config's without its absent keys). ``cfg_hash`` is that of the full
    ``config``: when no key is absent it is the one compared."""
    saved_id = state.get("run_id")
    if saved_id != ident.run_id:
        whose = "no run id (written before run identities?)" if saved_id is None else f"run id {saved_id}"
        return (
            f"--resume: checkpoint {str(path)!r} has {whose}, but {RUN_FILE} of this out dir says "
            f"run id {ident.run_id}: it belongs to another run; refusing to mix them"
        )
    skip = set(resumable)
    raw = state.get("config", {})
    saved: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    unknown = _unknown_keys(saved, config)
    if unknown:
        return (
            f"--resume: the config of checkpoint {str(path)!r} has {', '.join(unknown)}, which this refppo "
            "does not know (written by a newer refppo?): resuming would change the run"
        )
    absent = absent_keys(saved, config, skip)
    changed = _absent_changes(absent, config, defaults or {})
    if changed is not None:
        return changed
    diffs = [
        f"{section}.{key}: {_section(saved, section)[key]!r} -> {value!r}"
        for section, values in config.items()
        for key, value in values.items()
        if not (section == "run" and key in skip)
        and key in _section(saved, section)
        and _section(saved, section)[key] != value
    ]
    if diffs:
        return "--resume with a different config (only run.iterations and logging may change): " + "; ".join(
            diffs
        )
    now_hash = config_hash(without_keys(config, absent), skip) if absent else cfg_hash
    if not state.get("config_hash") == ident.config_hash == now_hash:
        return (
            f"--resume: the config hashes of checkpoint {str(path)!r}, of {RUN_FILE} and of this config "
            "differ (a config key added or removed?)"
        )
    return None


def _owned_top(name: str) -> bool:
    return (
        name in OWNED_FILES
        or name in OWNED_DIRS
        or any(name.startswith(f"{TMP_PREFIX}{f}-") for f in OWNED_FILES)
    )


def _listing(names: list[str], n: int = 4) -> str:
    shown = ", ".join(names[:n])
    return shown + (f", … ({len(names)} entries)" if len(names) > n else "")


def check_fresh(out_dir: str | Path, *, overwrite: bool) -> None:
    """Refuse to start a fresh run in ``out_dir`` unless it is missing or empty, or ``overwrite`` is
    set and the directory is a refppo run (see the module docstring). Deletes nothing."""
    out = Path(out_dir)
    if not out.exists():
        return
    if not out.is_dir():
        raise RunDirError(f"run.out_dir {str(out)!r} exists and is not a directory")
    names = sorted(p.name for p in out.iterdir())
    if not names:
        return
    if not overwrite:
        raise RunDirError(
            f"run.out_dir {str(out)!r} is not empty ({_listing(names)}): --resume continues the run "
            "in it, --overwrite replaces it, or choose another --out"
        )
    owned = [n for n in names if _owned_top(n)]
    if owned and read_identity(out) is None:
        raise RunDirError(
            f"--overwrite: {str(out)!r} holds {_listing(owned)} but no {RUN_FILE}, so it is not known to "
            "be a refppo run (or it predates run identities); refppo deletes nothing there — remove "
            "them yourself or choose another --out"
        )


def _remove(p: Path) -> None:
    if p.is_symlink() or not p.is_dir():
        p.unlink(missing_ok=True)
    else:
        shutil.rmtree(p)


def _clear_folder(folder: Path, owned: Iterable[str]) -> None:
    if folder.is_symlink():
        folder.unlink()
        return
    if not folder.is_dir():
        folder.unlink(missing_ok=True)
        return
    prefixes = tuple(owned)
    for p in folder.iterdir():
        if p.name.startswith(prefixes):
            _remove(p)
    if not any(folder.iterdir()):
        folder.rmdir()


def clear_run(out_dir: str | Path) -> list[str]:
    """Delete the refppo entries of the run directory ``out_dir`` (call :func:`check_fresh` with
    ``overwrite=True`` first); returns the names of the entries it kept."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    for name in sorted(p.name for p in out.iterdir()):
        p = out / name
        if name == "checkpoints":
            _clear_folder(p, ("iter_", TMP_PREFIX))
        elif name == "tensorboard":
            _clear_folder(p, ("events.out.tfevents.",))
        elif _owned_top(name) and name != RUN_FILE:
            _remove(p)
    (out / RUN_FILE).unlink(missing_ok=True)  # last: an interrupted clear is still a refppo run
    return sorted(p.name for p in out.iterdir())


__all__ = [
    "FORMAT",
    "OWNED_DIRS",
    "OWNED_FILES",
    "RUN_FILE",
    "RunDirError",
    "RunIdentity",
    "absent_keys",
    "check_fresh",
    "clear_run",
    "config_hash",
    "new_identity",
    "read_identity",
    "resume_mismatch",
    "without_keys",
    "write_identity",
]
