"""Diagnosis wording that must not mislead a new user (issue #9, "Diagnosis that does not mislead")."""

from __future__ import annotations

from pathlib import Path

from oracle_helpers import make_inputs, naive_dump, save, setup_for

from refppo.dump.load import load_dump
from refppo.oracle.check.diagnose import check


def _diagnose(tmp_path: Path, made_with: dict[str, str], checked_with: dict[str, str]) -> list[str]:
    made = setup_for(conv=made_with)
    dump = load_dump(save(tmp_path, naive_dump(make_inputs(seed=7), made), made))
    res = check(dump, setup_for(conv=checked_with))
    assert not res.match
    return res.diagnosis


def test_a_partial_explanation_says_what_still_differs(tmp_path: Path) -> None:
    # Two conventions differ (score slot and whitening): moving the score explains token_rewards,
    # but the advantages still differ. That must not read as a fix.
    text = "\n".join(_diagnose(tmp_path, {"score_at": "after_last_valid", "whiten_advantages": "none"}, {}))
    moved = "score_at=after_last_valid (as in preset trl, deepspeed-chat)"
    assert f"{moved} explains token_rewards only" in text
    assert "explains token_rewards only; advantages" in text and "still differ" in text
    assert "explained by the convention score_at=after_last_valid" not in text
    assert "no single convention change or known bug explains every quantity" in text


def test_a_full_explanation_still_reads_as_one(tmp_path: Path) -> None:
    text = "\n".join(_diagnose(tmp_path, {"score_at": "after_last_valid"}, {}))
    assert "explained by the convention score_at=after_last_valid" in text
    assert "every quantity in the dump matches" in text
    assert "explains token_rewards only" not in text


def test_a_score_one_slot_off_differs_only_at_the_last_valid_token(tmp_path: Path) -> None:
    # A verl/refppo dump (score on the last valid token) checked as TRL (score one slot later):
    # token_rewards differ at the last valid token and the slot after it, nowhere else. That is a
    # score position, not an error "carried back by GAE" (token_rewards do not come from GAE).
    text = "\n".join(_diagnose(tmp_path, {}, {"score_at": "after_last_valid"}))
    assert (
        "token_rewards: differs only at the last valid token of a row and at the score slot one past it"
        in text
    )
    assert "the score sits one slot away" in text
    assert "carried back by GAE" not in text
    assert "explained by the convention score_at=last_valid" in text


def test_gae_outputs_keep_the_carried_back_note(tmp_path: Path) -> None:
    # Control: with only the returns dumped the error does flow back through GAE, and is said to.
    made = setup_for(conv={})
    d = naive_dump(make_inputs(seed=7), made, keep=("returns",))
    res = check(load_dump(save(tmp_path, d, made)), setup_for(conv={"score_at": "after_last_valid"}))
    assert res.first_divergence == "returns"
    assert "carried back by GAE" in "\n".join(res.diagnosis)
