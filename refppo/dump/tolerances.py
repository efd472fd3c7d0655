"""The oracle's tolerances by the dump's precision: a quantity matches when
``max|dump − ref| <= atol + rtol·max|ref|`` over its compared positions. The dtype is the lowest
floating precision among the trainer's tensors (:attr:`refppo.dump.load.Dump.dtype`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    """``|dump − ref| <= atol + rtol·max|ref|`` over the compared positions of one quantity."""

    rtol: float
    atol: float

    def of(self, ref_scale: float) -> float:
        return self.atol + self.rtol * (ref_scale if math.isfinite(ref_scale) else 0.0)


TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(rtol=1e-7, atol=1e-9),
    torch.float32: Tolerance(rtol=2e-4, atol=1e-5),
    torch.bfloat16: Tolerance(rtol=2e-2, atol=1e-2),
    torch.float16: Tolerance(rtol=5e-3, atol=2e-3),
}
