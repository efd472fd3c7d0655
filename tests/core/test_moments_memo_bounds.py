"""The moments memo's bounds (:mod:`refppo.core.moments_memo`): it holds the latest
:data:`KEEP_OUTPUTS` whole outputs (of any dimension ≥ 1) and every 0-dim moment, and an output
changed in place after it was remembered is recomputed, not answered from the memo. Hand-counted
calls; the values are the functions' own (the memo never changes a value)."""

from __future__ import annotations

import torch
from torch import Tensor

from refppo.core.moments_memo import KEEP_OUTPUTS, Memo, memoized, remembered_moments


def _counted(make: Tensor, calls: list[str], name: str) -> Tensor:
    calls.append(name)
    return make.clone()


def _outputs(memo: Memo) -> int:
    return sum(1 for v in memo.values() if v[3].dim() > 0)


def test_the_latest_outputs_are_kept_and_every_moment() -> None:
    assert KEEP_OUTPUTS == 2
    x, m = torch.arange(6.0), torch.ones(6, dtype=torch.bool)
    calls: list[str] = []
    memo: Memo = {}
    with remembered_moments(memo):
        mean = memoized("mean", x, m, (), lambda: _counted(torch.tensor(2.5), calls, "mean"))
        for i in range(4):  # four 1-dim outputs: the latest two stay
            memoized("out", x, m, (i,), lambda i=i: _counted(x + i, calls, f"out{i}"))
        assert _outputs(memo) == 2 and len(memo) == 3  # two outputs and the moment
        memoized("mean", x, m, (), lambda: _counted(torch.tensor(0.0), calls, "mean again"))
        for i in (3, 2):  # remembered: no call
            memoized("out", x, m, (i,), lambda i=i: _counted(x + i, calls, f"out{i} again"))
        memoized("out", x, m, (1,), lambda: _counted(x + 1, calls, "out1 again"))  # evicted: recomputed
    assert calls == ["mean", "out0", "out1", "out2", "out3", "out1 again"], calls
    assert float(mean) == 2.5


def test_a_moment_added_after_the_outputs_evicts_none() -> None:
    x, m = torch.arange(6.0).reshape(2, 3), torch.ones(2, 3, dtype=torch.bool)
    calls: list[str] = []
    memo: Memo = {}
    with remembered_moments(memo):
        for i in range(2):
            memoized("out", x, m, (i,), lambda i=i: _counted(x + i, calls, f"out{i}"))
        memoized("var", x, m, (), lambda: _counted(torch.tensor(1.0), calls, "var"))
        for i in range(2):
            memoized("out", x, m, (i,), lambda i=i: _counted(x + i, calls, f"out{i} again"))
    assert calls == ["out0", "out1", "var"], calls


def test_an_output_changed_in_place_is_recomputed() -> None:
    x, m = torch.arange(4.0), torch.ones(4, dtype=torch.bool)
    calls: list[str] = []
    with remembered_moments({}):
        first = memoized("out", x, m, (), lambda: _counted(2 * x, calls, "out"))
        first.add_(100.0)  # a caller wrote into the remembered output
        again = memoized("out", x, m, (), lambda: _counted(2 * x, calls, "out again"))
    assert calls == ["out", "out again"], calls
    assert torch.equal(again, 2 * x)
