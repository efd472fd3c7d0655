"""Two simulated ranks in one process, for the ``all_reduce`` paths of the core.

:func:`run_ranks` runs ``call(rank, all_reduce)`` for each rank in its own thread; the
``all_reduce`` each one gets is a SUM over the ranks (every rank deposits its tensor, waits for the
others at a barrier, then returns the sum in rank order), so the collectives pair up in call order
exactly as ``torch.distributed.all_reduce`` does. An exception on one rank aborts the barrier (the
other ranks stop waiting) and is re-raised once every thread has been joined.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar, cast

from torch import Tensor

from refppo.core.masked import AllReduce

R = TypeVar("R")

_WAIT_S = 120.0
"""How long a rank waits for the others at a collective before giving up (a deadlock guard)."""


def run_ranks(call: Callable[[int, AllReduce], R], n_ranks: int = 2) -> list[R]:
    """``[call(0, ar), …, call(n_ranks − 1, ar)]``, run concurrently with a shared SUM all-reduce."""
    barrier = threading.Barrier(n_ranks)
    slots: list[Tensor | None] = [None] * n_ranks
    results: list[R | None] = [None] * n_ranks
    errors: list[BaseException] = []

    def make_all_reduce(rank: int) -> AllReduce:
        def all_reduce(x: Tensor) -> Tensor:
            slots[rank] = x.clone()
            barrier.wait(_WAIT_S)
            parts = [s for s in slots if s is not None]
            total = parts[0].clone()
            for p in parts[1:]:
                total = total + p
            barrier.wait(_WAIT_S)  # nobody overwrites a slot before every rank has read them all
            return total

        return all_reduce

    def worker(rank: int) -> None:
        try:
            results[rank] = call(rank, make_all_reduce(rank))
        except BaseException as exc:  # re-raised below, after every thread is joined
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(n_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        raise first
    return cast(list[R], results)  # every worker stored its result (no error was raised)
