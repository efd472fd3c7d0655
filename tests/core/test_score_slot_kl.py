"""The KL penalty at the score slot too (issue #23 item 5; DeepSpeed-Chat): ``token_rewards(...,
kl_mask=)`` (refppo/core/rewards.py), its naive twin, the ``score_slot_kl`` stage option and
``--preset deepspeed-chat``.

DeepSpeed-Chat is not installable here (its PPO trainer lives in the DeepSpeedExamples repository,
not in the ``deepspeed`` wheel), so the preset is checked against a vector worked by hand from
``dschat/rlhf/ppo_trainer.py::DeepSpeedPPOTrainer.compute_rewards`` @3b45859::

    rewards = −kl_ctl·(log_probs − ref_log_probs)          every position
    ends = start + action_mask[:, start:].sum(1) + 1        one past the last action
    rewards[j, start:ends[j]][−1] += clamp(score, ±clip)    the score at the slot, on top of its KL
    (get_advantages_and_returns reads rewards[:, start:ends] only)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import Ragged, assert_twin_close, ragged_batches

from refppo.core.rewards import token_rewards, token_rewards_naive
from refppo.dump.write import write_dump
from refppo.errors import ShapeError
from refppo.oracle.run import check_step
from refppo.pipeline.rollout import value_mask

F64 = torch.float64
# one row, T = 4, L = 2: the slot is position 2 (after_last_valid); position 3 is padding
MASK = torch.tensor([[1, 1, 0, 0]], dtype=torch.bool)
OLD = torch.tensor([[-1.0, -2.0, -0.5, 7.5]], dtype=F64)
REF = torch.tensor([[-1.5, -1.0, -1.0, 7.5]], dtype=F64)
SCORE, BETA = 2.0, 0.1
# by hand: KL (k1) = old − ref = [0.5, −1, 0.5] on positions 0..2; −β·KL = [−0.05, 0.1, −0.05];
# the score 2 at the slot on top: [−0.05, 0.1, 1.95, 0]; without the slot's KL the slot holds 2.
DSCHAT = [[-0.05, 0.1, 1.95, 0.0]]
TRL = [[-0.05, 0.1, 2.0, 0.0]]


def test_hand_worked_dschat_rewards_core_and_twin() -> None:
    vm = value_mask(MASK, "after_last_valid")  # type: ignore[arg-type]
    kl = torch.where(vm, OLD - REF, 0.0)
    s = torch.tensor([SCORE], dtype=F64)
    for fn in (token_rewards, token_rewards_naive):
        got = fn(s, kl, MASK, BETA, score_at="after_last_valid", kl_mask=vm)
        torch.testing.assert_close(got, torch.tensor(DSCHAT, dtype=F64), rtol=0, atol=1e-15)
        got = fn(s, kl, MASK, BETA, score_at="after_last_valid")
        torch.testing.assert_close(got, torch.tensor(TRL, dtype=F64), rtol=0, atol=1e-15)


@given(ragged_batches(), st.floats(0.0, 1.0), st.sampled_from(["after_last_valid", "last_position"]))
def test_slot_kl_matches_its_twin_and_moves_only_the_slot(b: Ragged, beta: float, where: str) -> None:
    kl_full = b.valid(-1.0, 1.0)
    vm = value_mask(b.mask, where)  # type: ignore[arg-type]
    s = b.scores().to(b.dtype)
    got = token_rewards(s, kl_full, b.mask, beta, score_at=where, kl_mask=vm)
    assert_twin_close(got, token_rewards_naive(s, kl_full, b.mask, beta, score_at=where, kl_mask=vm), b.dtype)
    plain = token_rewards(s, kl_full, b.mask, beta, score_at=where)
    slot_only = vm & ~b.mask  # the slot outside the mask (none on a full row)
    assert torch.equal(got[~slot_only], plain[~slot_only])
    torch.testing.assert_close(got[slot_only], plain[slot_only] - beta * kl_full[slot_only])


def test_kl_mask_shape_is_checked() -> None:
    s = torch.tensor([SCORE], dtype=F64)
    with pytest.raises(ShapeError, match="kl_mask"):
        token_rewards(s, OLD - REF, MASK, BETA, kl_mask=torch.ones(2, 4, dtype=torch.bool))


def _dump(tmp_path: Path) -> Path:
    """The hand-worked row as a dump: scores, log-probs (real at the slot), old values, the
    DeepSpeed-Chat rewards; kl_coef = 0.1 as its ``__init__`` sets (the preset's)."""
    path = tmp_path / "dschat.safetensors"
    tensors = {
        "response_mask": MASK.to(torch.uint8), "old_logprobs": OLD, "ref_logprobs": REF,
        "old_values": torch.tensor([[0.3, -0.2, 0.1, 7.5]], dtype=F64),
        "scores": torch.tensor([SCORE], dtype=F64), "token_rewards": torch.tensor(DSCHAT, dtype=F64),
    }  # fmt: skip
    write_dump(path, tensors, hparams={"kl_coef": BETA})
    return path


def test_deepspeed_chat_preset_puts_the_kl_at_the_slot(tmp_path: Path) -> None:
    """``--preset deepspeed-chat`` matches the hand-worked rewards; control ``score_slot_kl=none``
    (the gap spec/conventions.md named before) mismatches at ``token_rewards`` by β·KL_slot = 0.05."""
    path = _dump(tmp_path)
    out = check_step(path, preset="deepspeed-chat")
    assert out.match, out.text()
    control = check_step(path, preset="deepspeed-chat", overrides={"score_slot_kl": "none"})
    assert not control.match
    assert control.result.quantities["token_rewards"].max_abs_err == pytest.approx(0.05, abs=1e-12)
