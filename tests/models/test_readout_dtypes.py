"""``refppo.models.readout.at_least_float32`` on each floating dtype, by hand: the half types (bf16
from CPU/CUDA autocast, fp16 from fp16 autocast) become float32; float32 and float64 pass through
(the same object: no copy). The autocast test in test_models.py only reaches bf16; a hand mutant
``promote_types(x.dtype, torch.float16)`` survived it (``promote_types(bf16, fp16)`` is float32)."""

from __future__ import annotations

import pytest
import torch

from refppo.models.readout import at_least_float32


@pytest.mark.parametrize(
    "dtype, want",
    [
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
    ],
)
def test_at_least_float32_promotes_only_the_half_types(dtype: torch.dtype, want: torch.dtype) -> None:
    x = torch.tensor([[0.5, -1.25], [3.0, 0.0]], dtype=dtype)
    y = at_least_float32(x)
    assert y.dtype == want
    assert y.tolist() == [[0.5, -1.25], [3.0, 0.0]]  # exact in every dtype listed
    if dtype == want:
        assert y is x


def test_at_least_float32_keeps_the_gradient_path() -> None:
    """The cast is differentiable: d(sum(y))/dx = 1 for each element (by hand)."""
    x = torch.tensor([1.0, 2.0], dtype=torch.bfloat16, requires_grad=True)
    at_least_float32(x).sum().backward()
    assert x.grad is not None and x.grad.tolist() == [1.0, 1.0]
