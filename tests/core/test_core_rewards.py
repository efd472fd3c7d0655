"""Unit tests of refppo/core/rewards.py: hand-worked examples and every validation error path."""

from __future__ import annotations

import re

import pytest
import torch

from refppo.core.rewards import score_positions, token_rewards
from refppo.errors import ConventionError, DtypeError, HyperparameterError, MaskError, ShapeError

NAN = float("nan")
# Row 0: 3 valid tokens of T = 5; row 1: full.
MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
KL = torch.tensor([[0.1, 0.2, 0.3, NAN, NAN], [0.0, 0.0, 0.0, 0.0, 0.4]], dtype=torch.float64)
SCORES = torch.tensor([1.0, 2.0], dtype=torch.float64)


def test_token_rewards_last_valid_hand_example() -> None:
    # β = 0.5: −β·KL = (−0.05, −0.1, −0.15); score 1 on the last valid token: 1 − 0.15 = 0.85.
    # Row 1: score 2 on position 4: 2 − 0.5·0.4 = 1.8.
    r = token_rewards(SCORES, KL, MASK, 0.5)
    assert r[0].tolist() == pytest.approx([-0.05, -0.1, 0.85, 0.0, 0.0], abs=1e-15)
    assert r[1].tolist() == pytest.approx([0.0, 0.0, 0.0, 0.0, 1.8], abs=1e-15)


def test_token_rewards_after_last_valid_and_last_position_hand_example() -> None:
    # after_last_valid: row 0 score at position 3 (first padding slot); row 1 is full -> falls back to 4.
    r = token_rewards(SCORES, KL, MASK, 0.5, score_at="after_last_valid")
    assert r[0].tolist() == pytest.approx([-0.05, -0.1, -0.15, 1.0, 0.0], abs=1e-15)
    assert r[1].tolist() == pytest.approx([0.0, 0.0, 0.0, 0.0, 1.8], abs=1e-15)
    # last_position: always T − 1 = 4.
    r = token_rewards(SCORES, KL, MASK, 0.5, score_at="last_position")
    assert r[0].tolist() == pytest.approx([-0.05, -0.1, -0.15, 0.0, 1.0], abs=1e-15)
    assert score_positions(MASK, "after_last_valid").tolist() == [3, 4]


def test_token_rewards_without_kl_is_score_only() -> None:
    r = token_rewards(SCORES, None, MASK, 0.5)
    assert r.tolist() == [[0.0, 0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0]]


def test_scores_with_wrong_shape_are_rejected() -> None:
    with pytest.raises(ShapeError, match=r"scores: expected shape \[B\] = \[2\] \(batch\), got \[2, 1\]"):
        token_rewards(SCORES.unsqueeze(1), KL, MASK, 0.1)


def test_integer_scores_are_rejected() -> None:
    with pytest.raises(
        DtypeError, match=re.escape("scores: expected a floating-point tensor, got dtype torch.int64")
    ):
        token_rewards(torch.tensor([1, 2]), KL, MASK, 0.1)


def test_kl_with_wrong_shape_is_rejected() -> None:
    with pytest.raises(
        ShapeError, match=r"kl: expected shape \[B, T\] = \[2, 5\] \(batch, resp\), got \[2, 4\]"
    ):
        token_rewards(SCORES, KL[:, :4], MASK, 0.1)


def test_negative_beta_is_rejected() -> None:
    with pytest.raises(HyperparameterError, match=re.escape("beta: expected a finite number >= 0, got -0.1")):
        token_rewards(SCORES, KL, MASK, -0.1)


def test_unknown_score_position_lists_valid_names() -> None:
    with pytest.raises(
        ConventionError,
        match=re.escape(
            "score_at: unknown name 'first'; valid names are "
            "'last_valid', 'after_last_valid', 'last_position'"
        ),
    ):
        token_rewards(SCORES, KL, MASK, 0.1, score_at="first")


def test_empty_response_row_is_rejected() -> None:
    with pytest.raises(MaskError, match=r"mask: rows \[0\] have no valid token"):
        token_rewards(SCORES, KL, torch.tensor([[0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]), 0.1)
