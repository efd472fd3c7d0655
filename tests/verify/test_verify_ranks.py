"""The two simulated ranks of ``refppo verify``'s ``all_reduce_2_ranks`` case (refppo/verify/ranks.py)."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from refppo.core.masked import AllReduce
from refppo.verify.cli import run_step
from refppo.verify.ranks import run_ranks


def test_run_ranks_sums_in_call_order() -> None:
    def call(rank: int, ar: AllReduce) -> list[float]:
        first = ar(torch.tensor([1.0 + rank, 10.0]))  # [1 + 2, 20]
        second = ar(first * (rank + 1))  # [3 + 6, 20 + 40]
        return [*first.tolist(), *second.tolist()]

    before = threading.active_count()
    assert run_ranks(call) == [[3.0, 20.0, 9.0, 60.0], [3.0, 20.0, 9.0, 60.0]]
    assert threading.active_count() == before  # both threads joined


def test_run_ranks_reraises_a_rank_error_without_hanging() -> None:
    def call(rank: int, ar: AllReduce) -> Tensor:
        if rank == 1:
            raise ValueError("rank 1 fails before its collective")
        return ar(torch.ones(1))  # rank 0 waits at the barrier until it is aborted

    before = threading.active_count()
    with pytest.raises(ValueError, match="rank 1 fails"):
        run_ranks(call)
    assert threading.active_count() == before  # both threads joined


def _ranks_with(reduce: Callable[[Tensor], Tensor]) -> Callable[..., list[Any]]:
    """A broken ``run_ranks``: every rank alone, its all-reduce ``reduce`` applied to its own sums."""

    def run(call: Callable[[int, AllReduce], Any], n_ranks: int = 2) -> list[Any]:
        return [call(r, reduce) for r in range(n_ranks)]

    return run


@pytest.mark.parametrize(
    ("bug", "reduce", "crash_allowed"),
    [
        ("no all-reduce (own sums)", lambda x: x, True),  # a 1-token shard: the unbiased check refuses
        ("own sums counted twice", lambda x: x + x, False),
    ],
)
def test_all_reduce_case_fails_when_the_ranks_do_not_communicate(
    monkeypatch: pytest.MonkeyPatch, bug: str, reduce: Callable[[Tensor], Tensor], crash_allowed: bool
) -> None:
    dist = importlib.import_module("refppo.verify.cases_dist")
    seeds = [0, 1, 2, 3]
    assert run_step("all_reduce_2_ranks", torch.device("cpu"), torch.float64, seeds).ok
    monkeypatch.setattr(dist, "run_ranks", _ranks_with(reduce))
    row = run_step("all_reduce_2_ranks", torch.device("cpu"), torch.float64, seeds)
    assert not row.ok, bug
    assert crash_allowed or row.max_abs < float("inf"), row
