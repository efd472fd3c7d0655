"""refppo/core/_ties.py against torch's own autograd on every ordering of a small grid.

The gradient twins (refppo/core/grad.py, gspo.py) call ``shares``, ``inside`` and ``clamp`` where
torch uses ``torch.maximum`` and ``torch.clamp``. Through those callers a wrong share of the losing
branch is mostly multiplied by a zero clamp pass, so the twins' tests cannot see it; here each
helper is compared directly with what torch 2.13 autograd gives (rev4 NIT-5, mutation testing)."""

from __future__ import annotations

import itertools

import pytest
import torch

from refppo.core._ties import clamp, inside, shares

GRID = (-1.5, -0.5, 0.0, 0.5, 1.5)
BOUNDS = (None, *GRID)
CLAMPS = [
    (x, lo, hi)
    for x, lo, hi in itertools.product(GRID, BOUNDS, BOUNDS)
    if lo is None or hi is None or lo <= hi  # the callers never build an empty interval
]


@pytest.mark.parametrize(("x", "y"), list(itertools.product(GRID, GRID)))
def test_shares_are_torch_maximum_gradients(x: float, y: float) -> None:
    a = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(y, dtype=torch.float64, requires_grad=True)
    torch.maximum(a, b).backward()
    assert a.grad is not None and b.grad is not None
    assert shares(x, y) == (float(a.grad), float(b.grad))
    a.grad, b.grad = None, None
    torch.minimum(a, b).backward()  # "swap the arguments for min"
    assert shares(y, x) == (float(a.grad), float(b.grad))


@pytest.mark.parametrize(("x", "lo", "hi"), CLAMPS)
def test_inside_and_clamp_are_torch_clamp(x: float, lo: float | None, hi: float | None) -> None:
    if lo is None and hi is None:
        assert inside(x, lo, hi) and clamp(x, lo, hi) == x  # torch.clamp refuses no bound at all
        return
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    out = torch.clamp(t, lo, hi)
    out.backward()
    assert t.grad is not None
    assert inside(x, lo, hi) == (float(t.grad) == 1.0)
    assert clamp(x, lo, hi) == float(out.detach())
