"""Residency of a dump's tensors: pages of a memory-mapped key handed back to the OS once compared
(``madvise(MADV_PAGEOUT)``), and the C heap's free pages between the oracle's stages
(``malloc_trim``), the C library's mmap threshold fixed (``mallopt``: a freed large temporary is
unmapped, not kept in the heap). Hints only: no value changes, whatever the kernel or the C library does.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from typing import Any

from torch import Tensor

_MADV_PAGEOUT = 21
"""Linux ``MADV_PAGEOUT`` (include/uapi/asm-generic/mman-common.h): reclaim these pages now. File
pages are dropped (re-read on the next access); anonymous ones go to swap or stay: never lost."""


def page_out(t: Tensor) -> None:
    """``madvise(MADV_PAGEOUT)`` over the whole pages of ``t``'s bytes
    (see :meth:`refppo.dump.load.Dump.release`).

    Only a hint: the tensor's values are unchanged whatever the kernel does; nothing happens off
    Linux or when the call fails.
    """
    _advise(t, _MADV_PAGEOUT)


_MADV_DONTNEED = 4
"""Linux ``MADV_DONTNEED``: unmap these pages from the process. A never-written file mapping's pages
stay in the page cache (the next access maps them again, no read from the disk)."""


def unmap_pages(t: Tensor) -> None:
    """``madvise(MADV_DONTNEED)`` over the whole pages of ``t``'s bytes, for a tensor memory-mapped
    read-only from a file (:meth:`refppo.dump.load.Dump.release_except`): they leave the process's
    resident set, the values unchanged. Nothing happens off Linux or when the call fails."""
    if t._version != 0:  # written in place: its pages may be the process's own copies, not the file's
        page_out(t)
        return
    _advise(t, _MADV_DONTNEED)


def _advise(t: Tensor, advice: int) -> None:
    """``madvise(advice)`` over the whole pages inside ``t``'s bytes (a contiguous CPU tensor on
    Linux; else, or without ``madvise``, nothing)."""
    if sys.platform != "linux" or t.device.type != "cpu" or not t.is_contiguous():
        return
    madvise = _madvise()
    if madvise is None:
        return
    page = mmap.PAGESIZE
    start, nbytes = t.data_ptr(), t.numel() * t.element_size()
    lo, hi = -(-start // page) * page, (start + nbytes) // page * page
    if hi > lo:
        madvise(lo, hi - lo, advice)


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


MMAP_THRESHOLD = 4 << 20
"""Bytes from which glibc maps each allocation on its own (``M_MMAP_THRESHOLD``), fixed by
:func:`fix_mmap_threshold`."""

_M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number (malloc.h)."""


@functools.cache
def fix_mmap_threshold() -> None:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD` (once per process; a no-op off glibc).

    By default the threshold grows to the size of each mapped block freed (up to 32 MiB), so the
    ``[B, T]`` bool and float32 temporaries of a large dump (8–32 MiB) come from the heap after the
    first ones are freed, and a freed heap block stays resident until :func:`trim_heap`; with the
    threshold fixed, each is unmapped when freed. On the full-size mismatching dump of
    ``benchmarks/bench_oracle.py`` the ``--detect`` peak fell from 2.55–2.8× the dump to about 2.4× (more
    page faults: the system time grows). Changes no value."""
    fn = _mallopt()
    if fn is not None:
        fn(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)


@functools.cache
def _mallopt() -> Any:
    """glibc's ``mallopt`` through ctypes, or None (other platforms and C libraries)."""
    if sys.platform != "linux":
        return None
    try:
        fn = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn
