"""Crash-safe file writes: a file is either its old complete self or its new complete self.

Every write that must survive a crash (``kill -9``, power loss) goes through here: the bytes go to a
temporary file in the same directory, are flushed and ``fsync``-ed, and the temporary file is
renamed over the target with :func:`os.replace` (atomic on POSIX within one file system); the
directory is then ``fsync``-ed so that the rename itself is durable. The same pattern as
``atomicwrites``/``safetensors`` users and the "write, fsync, rename, fsync dir" recipe of
``man 2 rename``, written here in our own words.

Files get the mode ``0o666 & ~umask`` that ``open(2)`` would give them (:func:`file_mode`), not the
0600 of ``tempfile.mkstemp``.

Temporary names start with ``.tmp-`` so that nothing else (``latest_checkpoint``'s ``iter_*``
glob, a reader of ``metrics.jsonl``) can mistake them for a finished file.

:func:`pause_for_test` is a test-only hook (``REFPPO_TEST_PAUSE_AT``): the kill tests in
``tests/train/test_integrity.py`` use it to stop a run at a known point of a write and ``SIGKILL`` it
there, deterministically.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

TMP_PREFIX = ".tmp-"
"""Prefix of every temporary file or directory refppo writes before renaming it into place."""

PAUSE_ENV = "REFPPO_TEST_PAUSE_AT"
"""TEST-ONLY environment variable: ``<point>`` (e.g. ``checkpoint:2``, ``metrics:2``) at which a run
prints ``REFPPO_TEST_PAUSED <point>`` on stderr and sleeps until it is killed. Never set it in use."""


def fsync_dir(path: str | Path) -> None:
    """``fsync`` a directory so that the entries created / renamed in it are durable."""
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | Path) -> None:
    """``fsync`` a file written by someone else's writer (safetensors, ``torch.save``, matplotlib)."""
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_mode() -> int:
    """``0o666 & ~umask``: the mode ``open(2)`` gives a new file under this process's umask.

    Read from ``/proc/self/status`` (Linux ≥ 4.7) where it can be, since ``os.umask`` can only be
    read by setting it (a race with threads creating files meanwhile); set and restored otherwise."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def honour_umask(path: str | Path) -> None:
    """Give ``path`` the mode of :func:`file_mode`: for files made by writers that create them 0600
    (``tempfile.mkstemp``, safetensors' own atomic write), so that another user or a CI artifact
    uploader reads them as it reads any other file of the process."""
    os.chmod(path, file_mode())


def temp_path(target: str | Path, suffix: str = "") -> Path:
    """A fresh, unused temporary path beside ``target`` (``.tmp-<name>-<random><suffix>``); the file is
    created empty (so the name is reserved), with the umask's mode (:func:`file_mode`; ``mkstemp``
    alone makes it 0600), and must be replaced or removed by the caller."""
    t = Path(target)
    fd, name = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{t.name}-", suffix=suffix, dir=t.parent)
    try:
        os.fchmod(fd, file_mode())
    finally:
        os.close(fd)
    return Path(name)


def atomic_write_with(target: str | Path, write: Callable[[Path], object], suffix: str = "") -> Path:
    """Call ``write(tmp)`` to write the whole file at a temporary path beside ``target``, fsync it
    and rename it onto ``target``. ``suffix`` keeps writers that infer the format from the name
    (``np.savez``, ``savefig``) happy. On any error the temporary file is removed and ``target`` is
    untouched."""
    t = Path(target)
    t.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(t, suffix)
    try:
        write(tmp)
        honour_umask(tmp)  # a writer may have made its own file in its place
        fsync_file(tmp)
        os.replace(tmp, t)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(t.parent)
    return t


def atomic_write_bytes(target: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``target`` atomically (see the module docstring)."""
    return atomic_write_with(target, lambda p: p.write_bytes(data))


def atomic_write_text(target: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``target`` atomically."""
    return atomic_write_bytes(target, text.encode("utf-8"))


def pause_for_test(point: str) -> None:
    """TEST-ONLY: when ``REFPPO_TEST_PAUSE_AT`` equals ``point``, announce it on stderr and sleep until
    killed (the kill tests ``SIGKILL`` the process there). A no-op otherwise."""
    if os.environ.get(PAUSE_ENV) != point:
        return
    print(f"REFPPO_TEST_PAUSED {point}", file=sys.stderr, flush=True)
    while True:  # pragma: no cover - only ever left by SIGKILL
        time.sleep(3600)


__all__ = [
    "PAUSE_ENV",
    "TMP_PREFIX",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_with",
    "file_mode",
    "fsync_dir",
    "fsync_file",
    "honour_umask",
    "pause_for_test",
    "temp_path",
]
