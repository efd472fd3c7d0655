"""Conversions for the naive twins: tensors in, Python floats and lists out, and back.

The naive twins compute on plain Python floats (IEEE double) with ``math``, one sequence and
one time step at a time. This module only moves data across that boundary; it computes nothing.
It is deliberately not used by the vectorized path.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rows(x: Tensor) -> list[list[float]]:
    """``[B, T]`` tensor -> list of B lists of T Python floats (float64 values)."""
    out: list[list[float]] = x.detach().to(torch.float64).cpu().tolist()
    return out


def vec(x: Tensor) -> list[float]:
    """``[B]`` tensor -> list of B Python floats."""
    out: list[float] = x.detach().to(torch.float64).cpu().tolist()
    return out


def mask_rows(mask: Tensor) -> list[list[bool]]:
    """``[B, T]`` mask (bool or 0/1) -> list of B lists of T bools."""
    out: list[list[bool]] = (mask != 0).cpu().tolist()
    return out


def tensor_like(values: list[list[float]] | list[float] | float, like: Tensor) -> Tensor:
    """Python floats -> tensor with ``like``'s dtype and device."""
    return torch.tensor(values, dtype=like.dtype, device=like.device)
