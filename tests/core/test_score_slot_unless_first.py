"""``score_at = after_last_valid_unless_first`` (issue #23 item 5; torchtune 0.6.1): the score one
past the last valid position ``ℓ`` unless ``ℓ`` is 0 (a one-token response) or ``T − 1``::

    p = ℓ + 1  if 0 < ℓ < T − 1,  else ℓ

(torchtune ``recipes/ppo_full_finetune_single_device.py::PPOFullFinetuneRecipeSingleDevice.
generate_trajectory``, step 6.1: ``value_seq_idxs = torch.where((seq_lens > 0) & (seq_lens <
max_generated_tokens − 1), seq_lens + 1, seq_lens)``; ``seq_lens`` is the last valid index).

Checked against a vector worked by hand, and by hypothesis against the naive twins
(:func:`refppo.core.helpers_naive.score_positions_naive`, :func:`refppo.core.rewards.token_rewards_naive`,
:func:`refppo.pipeline.naive.value_mask_naive`) on masks that always carry a one-token row.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from refppo.conventions import ScorePosition
from refppo.core.helpers_naive import score_positions_naive
from refppo.core.rewards import score_positions, token_rewards, token_rewards_naive
from refppo.pipeline.naive import value_mask_naive
from refppo.pipeline.rollout import same_slots_as_after_last_valid, value_mask

WHERE = ScorePosition.AFTER_LAST_VALID_UNLESS_FIRST
# Rows of T = 5: one token (ℓ = 0), three tokens (ℓ = 2), full (ℓ = 4), a hole then ℓ = 3.
MASK = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 1, 0]], dtype=torch.bool)
KL = torch.tensor(
    [[0.2, 9, 9, 9, 9], [0.1, 0.2, 0.3, 9, 9], [0.0, 0.0, 0.0, 0.0, 0.4], [0.2, 9, 9, 0.6, 9]],
    dtype=torch.float64,
)
SCORES = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)


def test_hand_worked_slots_and_rewards() -> None:
    # Slots: row 0 keeps 0 (after_last_valid would give 1); row 1: 3; row 2 full: 4; row 3: 4.
    assert score_positions(MASK, WHERE).tolist() == [0, 3, 4, 4]
    assert score_positions(MASK, ScorePosition.AFTER_LAST_VALID).tolist() == [1, 3, 4, 4]
    # β = 0.5: −β·KL on the valid tokens, the score added at the slot.
    r = token_rewards(SCORES, KL, MASK, 0.5, score_at=WHERE)
    want = [
        [1.0 - 0.1, 0.0, 0.0, 0.0, 0.0],
        [-0.05, -0.1, -0.15, 2.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, 3.0 - 0.2],
        [-0.1, 0.0, 0.0, -0.3, 4.0],
    ]
    for got_row, want_row in zip(r.tolist(), want, strict=True):
        assert got_row == pytest.approx(want_row, abs=1e-15)
    # The value mask adds the slot where it is outside the mask: row 0 gains nothing.
    vm = value_mask(MASK, WHERE)
    assert vm.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 0, 0, 1, 1]]


@st.composite
def masks_with_a_one_token_row(draw: st.DrawFn) -> torch.Tensor:
    """``[B, T]`` bool masks (holes allowed), every row with a valid token, one row with only position 0."""
    B, T = draw(st.integers(1, 5)), draw(st.integers(1, 7))
    rows = [draw(st.lists(st.booleans(), min_size=T, max_size=T)) for _ in range(B)]
    rows = [r if any(r) else [True, *r[1:]] for r in rows]
    rows[draw(st.integers(0, B - 1))] = [True] + [False] * (T - 1)
    return torch.tensor(rows, dtype=torch.bool)


@given(masks_with_a_one_token_row(), st.sampled_from([0.0, 0.1, 1.0]), st.integers(0, 2**31 - 1))
def test_unless_first_matches_the_naive_twins(mask: torch.Tensor, beta: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    B, T = mask.shape
    kl = torch.randn(B, T, generator=g, dtype=torch.float64)
    s = torch.randn(B, generator=g, dtype=torch.float64)
    assert score_positions(mask, WHERE).tolist() == score_positions_naive(mask, WHERE)
    got = token_rewards(s, kl, mask, beta, score_at=WHERE)
    assert torch.allclose(got, token_rewards_naive(s, kl, mask, beta, score_at=WHERE), rtol=0, atol=1e-12)
    assert torch.equal(value_mask(mask, WHERE), value_mask_naive(mask, WHERE))


@given(masks_with_a_one_token_row())
def test_unless_first_is_after_last_valid_except_on_one_token_rows(mask: torch.Tensor) -> None:
    # ℓ = 0: the last valid slot; any other row: after_last_valid's (naive twin, both).
    last = score_positions_naive(mask, ScorePosition.LAST_VALID)
    after = score_positions_naive(mask, ScorePosition.AFTER_LAST_VALID)
    want = [lv if lv == 0 else a for lv, a in zip(last, after, strict=True)]
    got = score_positions(mask, WHERE).tolist()
    assert got == want
    if mask.shape[1] > 1:  # the one-token row tells the two conventions apart
        assert got != score_positions(mask, ScorePosition.AFTER_LAST_VALID).tolist()


def test_a_search_tries_it_only_where_a_one_token_row_tells_it_apart() -> None:
    # MASK's row 0 is one token: the two members differ there; without that row they give equal slots.
    assert not same_slots_as_after_last_valid(MASK, WHERE)
    assert same_slots_as_after_last_valid(MASK[1:], WHERE)
    assert not same_slots_as_after_last_valid(MASK[1:], ScorePosition.AFTER_LAST_VALID)  # only the new member
    one_wide = torch.ones(3, 1, dtype=torch.bool)  # T = 1: every slot is 0 under both
    assert same_slots_as_after_last_valid(one_wide, WHERE)
