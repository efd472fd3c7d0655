"""Seeded ragged batches with junk padding, and the shape of a verify case.

A :class:`Batch` is a right-padded mask ``[B, T]`` (row 0 of length 1, row 1 full, the others
random) plus a generator; its tensors hold NaN, ±inf or ±1e30 at padded positions, so a step
that reads padding is caught. A case maps ``(Batch, device)`` to a list of
``(output name, vectorised, naive, mask-or-None)`` to compare.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

JUNK_VALUES: tuple[float, ...] = (math.nan, math.inf, -math.inf, 1e30, -1e30)


@dataclass(frozen=True)
class Batch:
    """A seeded ragged batch: mask plus helpers that draw tensors with junk on the padding."""

    mask: Tensor
    dtype: torch.dtype
    gen: torch.Generator

    @property
    def shape(self) -> tuple[int, int]:
        B, T = self.mask.shape
        return int(B), int(T)

    def floats(self, low: float, high: float) -> Tensor:
        """``[B, T]`` uniform in ``[low, high)`` at valid positions, junk at padded ones."""
        x = torch.rand(self.shape, generator=self.gen, dtype=torch.float64) * (high - low) + low
        junk_idx = torch.randint(0, len(JUNK_VALUES), self.shape, generator=self.gen)
        junk = torch.tensor(JUNK_VALUES, dtype=torch.float64)[junk_idx]
        return torch.where(self.mask, x, junk).to(self.dtype)

    def scores(self, low: float = -5.0, high: float = 5.0) -> Tensor:
        B, _ = self.shape
        return (torch.rand(B, generator=self.gen, dtype=torch.float64) * (high - low) + low).to(self.dtype)


def make_batch(seed: int, dtype: torch.dtype, *, B: int | None = None, T: int | None = None) -> Batch:
    """Seeded right-padded batch (B in 2..8, T in 1..24 unless given).

    Row 0 has length 1 and row 1 is full; the other rows have random lengths.
    """
    gen = torch.Generator().manual_seed(seed)
    if B is None:
        B = int(torch.randint(2, 9, (), generator=gen))
    if T is None:
        T = int(torch.randint(1, 25, (), generator=gen))
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    lengths[0] = 1
    if B > 1:
        lengths[1] = T
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    return Batch(mask=mask, dtype=dtype, gen=gen)


def with_holes(b: Batch) -> Batch:
    """``b`` with interior holes punched in its mask (same generator): each row keeps its first and
    last valid token, and every position strictly between them is masked with probability 0.4.

    The original mask is the new one's envelope (:func:`refppo.core.gae.envelope`), so
    ``b.floats`` is finite on the holes and ``with_holes(b).floats`` holds junk there.
    """
    B, T = b.shape
    last = b.mask.sum(dim=1, keepdim=True) - 1
    t = torch.arange(T).unsqueeze(0)
    interior = (t > 0) & (t < last)
    drop = torch.rand((B, T), generator=b.gen) < 0.4
    return replace(b, mask=b.mask & ~(interior & drop))


Pair = tuple[str, Tensor, Tensor, Tensor | None]
Case = Callable[[Batch, torch.device], list[Pair]]
