"""A memo of the batch moments of one tensor, for a caller that normalises it several ways.

The ``--detect`` walk whitens each raw reward candidate under every reward-whitening option
(``masked``, ``masked_no_shift``, ``center``, ``scale`` × the variance × where the eps sits): the
same ``x`` and mask each time, so the same ``(μ, σ²)`` (:func:`refppo.core.masked.masked_moments`)
and ``Σ m·x²/D`` (:func:`refppo.core.normalize.normalize`'s ``scale``), and often the same
output (``center`` reads no variance; two eps placements whose scale rounds to one float). Within
:func:`remembered_moments` those functions look their result up here before computing it (an
output by the bits of the 0-dim tensors it is made from; the latest :data:`KEEP_OUTPUTS` of them).

Exact by construction: an entry is the function's own result on the *same* tensor objects (held
by the entry, so their ids are not reused) whose in-place version counters have not moved, under
the same arguments; the functions are deterministic, so a hit is bit-identical to a recomputation
(``tests/core/test_core_moments_memo.py``). Nothing is remembered outside the context, and the
multi-rank path (``all_reduce``) is never remembered (it communicates).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

from torch import Tensor

R = TypeVar("R")

Memo = dict[tuple[Any, ...], tuple[Tensor, Tensor, tuple[int, ...], Any]]
"""``(what, id(x), id(mask), args) → (x, mask, their versions, result)``."""

KEEP_OUTPUTS = 2
"""How many whole outputs (not 0-dim moments) one memo holds: the latest ones (memory stays bounded;
the options that share an output are walked one after the other)."""

_MEMO: ContextVar[Memo | None] = ContextVar("refppo_moments_memo", default=None)


@contextmanager
def remembered_moments(memo: Memo) -> Iterator[Memo]:
    """Within the block, the batch moments are looked up in (and added to) ``memo``; the caller
    owns ``memo`` (its lifetime bounds what it holds)."""
    token = _MEMO.set(memo)
    try:
        yield memo
    finally:
        _MEMO.reset(token)


def memoized(what: str, x: Tensor, m: Tensor, args: tuple[Any, ...], fn: Callable[[], R]) -> R:
    """``fn()`` (the moments ``what`` of ``x`` over ``m`` under ``args``), remembered within
    :func:`remembered_moments` (module docstring); outside it, ``fn()``."""
    memo = _MEMO.get()
    if memo is None:
        return fn()
    key = (what, id(x), id(m), args)
    hit = memo.get(key)
    if hit is not None and hit[0] is x and hit[1] is m and hit[2] == _versions(x, m, hit[3]):
        out: R = hit[3]
        return out
    out = fn()
    if isinstance(out, Tensor) and out.dim() > 0:  # an output: the latest few are kept
        large = [k for k, v in memo.items() if isinstance(v[3], Tensor) and v[3].dim() > 0]
        for k in large[: max(0, len(large) - KEEP_OUTPUTS + 1)]:
            del memo[k]
    memo[key] = (x, m, _versions(x, m, out), out)
    return out


def _versions(x: Tensor, m: Tensor, out: Any) -> tuple[int, ...]:
    """The in-place version counters of ``x``, ``m`` and a tensor result (a changed one: no hit)."""
    return (x._version, m._version, *((out._version,) if isinstance(out, Tensor) else ()))


__all__ = ["KEEP_OUTPUTS", "Memo", "memoized", "remembered_moments"]
