"""Properties of the token-level rewards (refppo/core/rewards.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import Ragged, assert_exactly_equal, assert_twin_close, ragged_batches

from refppo.conventions import ScorePosition
from refppo.core.rewards import score_positions, token_rewards, token_rewards_naive

pytestmark = pytest.mark.property

positions = st.sampled_from(list(ScorePosition))
betas = st.sampled_from([0.0, 0.05, 0.2, 1.0])


@given(ragged_batches(), positions, betas, st.booleans())
def test_token_rewards_match_naive(b: Ragged, where: ScorePosition, beta: float, with_kl: bool) -> None:
    kl = b.floats(-2.0, 2.0) if with_kl else None
    s = b.scores()
    got = token_rewards(s, kl, b.mask, beta, score_at=where)
    want = token_rewards_naive(s, kl, b.mask, beta, score_at=where)
    assert_twin_close(got, want, b.dtype, where.value)


@given(ragged_batches(), positions, st.sampled_from(["nan", "inf", "-inf", "huge", "mixed"]))
def test_token_rewards_padding_invariant(b: Ragged, where: ScorePosition, other_junk: str) -> None:
    kl, s = b.valid(-2.0, 2.0), b.scores()
    r1 = token_rewards(s, b.with_junk(kl), b.mask, 0.1, score_at=where)
    r2 = token_rewards(s, b.with_junk(kl, other_junk), b.mask, 0.1, score_at=where)
    assert_exactly_equal(r1, r2, what="rewards")
    assert bool(torch.isfinite(r1).all())


@given(ragged_batches(), positions)
def test_token_rewards_batch_permutation_equivariant(b: Ragged, where: ScorePosition) -> None:
    kl, s = b.floats(-2.0, 2.0), b.scores()
    perm = torch.randperm(b.B, generator=b.gen)
    assert_exactly_equal(
        token_rewards(s[perm], kl[perm], b.mask[perm], 0.1, score_at=where),
        token_rewards(s, kl, b.mask, 0.1, score_at=where)[perm],
        what="rewards",
    )


@given(ragged_batches(dtypes=(torch.float64,)), positions, betas)
def test_token_rewards_sum_to_score_minus_beta_kl(b: Ragged, where: ScorePosition, beta: float) -> None:
    kl, s = b.floats(-2.0, 2.0), b.scores()
    r = token_rewards(s, kl, b.mask, beta, score_at=where)
    kl_sum = torch.where(b.mask, kl, torch.zeros((), dtype=kl.dtype)).sum(dim=1)
    assert torch.allclose(r.sum(dim=1), s - beta * kl_sum, rtol=0, atol=1e-12)


@given(ragged_batches(), betas)
def test_token_rewards_are_minus_beta_kl_except_last_valid(b: Ragged, beta: float) -> None:
    kl, s = b.floats(-2.0, 2.0), b.scores()
    r = token_rewards(s, kl, b.mask, beta, score_at="last_valid")
    lengths = torch.tensor(b.lengths)
    last = torch.zeros_like(b.mask)
    last[torch.arange(b.B), lengths - 1] = True
    expected = torch.where(b.mask, -beta * kl, torch.zeros((), dtype=kl.dtype))
    assert_exactly_equal(r, expected, b.mask & ~last, what="non-score tokens")
    assert_exactly_equal(r[~b.mask], torch.zeros_like(r[~b.mask]), what="padding")
    assert_exactly_equal(r[last], expected[last] + s, what="last valid token")


@given(ragged_batches())
def test_score_positions_follow_the_convention_diagram(b: Ragged) -> None:
    lengths = torch.tensor(b.lengths)
    assert torch.equal(score_positions(b.mask, "last_valid"), lengths - 1)
    assert torch.equal(score_positions(b.mask, "after_last_valid"), torch.clamp(lengths, max=b.T - 1))
    assert torch.equal(score_positions(b.mask, "last_position"), torch.full((b.B,), b.T - 1))
