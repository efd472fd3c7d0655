"""Killing tests for batch 24's core mutation survivors (``tools/mutate.py``): the logged clip
fraction (:mod:`refppo.core.clipfrac`), against hand-worked vectors."""

from __future__ import annotations

import pytest
import torch

from refppo.agg_conventions import ClipFracCounts
from refppo.core.clipfrac import clip_fraction


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


L = torch.tensor([[1.0, 3.0], [5.0, 7.0]], dtype=torch.float64)
FULL = torch.ones(2, 2, dtype=torch.bool)
ROW0 = torch.tensor([True, False])


def test_kept_rows_seq_mean_over_the_rows_in_the_loss() -> None:
    """count_rows=False with one row in the loss: N_seq = max(1, 1) = 1, so seq-mean-token-mean is
    row 0's mean (1 + 3)/2 = 2. Kills `max(float(count_true(keep)), 1.0)` → `2.0` (gives 1)."""
    from refppo.core.masked import kept_rows_aggregate

    got = kept_rows_aggregate(L, FULL, ROW0, "seq-mean-token-mean", count_rows=False)
    assert float(got) == 2.0


def test_kept_rows_sum_norm_reads_the_horizon() -> None:
    """seq-mean-token-sum-norm with horizon H = 4, both rows counted: Σ m'L / (N_seq·H) = 4 / (2·4)
    = 0.5 (H = T = 2 would give 1). Kills the dropped ``horizon=`` of the call to aggregate_masked."""
    from refppo.core.masked import kept_rows_aggregate

    got = kept_rows_aggregate(L, FULL, ROW0, "seq-mean-token-sum-norm", horizon=4.0)
    assert float(got) == 0.5
