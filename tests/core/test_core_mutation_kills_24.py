"""Killing tests for batch 24's core mutation survivors (``tools/mutate.py``): the logged clip
fraction (:mod:`refppo.core.clipfrac`), against hand-worked vectors."""

from __future__ import annotations

import pytest
import torch

from refppo.core.clipfrac import clip_fraction
from refppo.rollout_conventions import ClipFracCounts


@pytest.mark.parametrize("counts", [ClipFracCounts.ALL, ClipFracCounts.BY_ADVANTAGE])
def test_cispo_weight_at_the_lower_bound_is_not_clipped(counts: ClipFracCounts) -> None:
    """CISPO's weight clamp(ρ, 0.5, 1.5) leaves ρ = 0.5 (exactly the bound) unchanged: not clipped.
    Tokens ρ = [0.5, 0.25, 1.0, 2.0], A = [-1, -1, 1, 1]: clipped 0.25 (below, A < 0) and 2.0 (above,
    A > 0): 2/4 under ``all`` and ``by_advantage``. Kills `ratio < lo` → `ratio <= lo` (3/4)."""
    ratio = torch.tensor([[0.5, 0.25, 1.0, 2.0]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, -1.0, 1.0, 1.0]], dtype=torch.float64)
    m = torch.ones(1, 4, dtype=torch.bool)
    got = clip_fraction(ratio, adv, m, band=(0.5, 1.5), surrogate=False, counts=counts)
    assert float(got) == 0.5
