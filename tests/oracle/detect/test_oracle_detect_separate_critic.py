"""``--detect`` on a ``separate_critic`` dump: its ``loss`` is the actor's objective (no value term), as
the checked reference computes it (refppo/oracle/check/recompute.py). The search's loss stage always added
``vf_coef·vf_loss``, so a dump the checked setting MATCHES was reported in the same run as reproduced
by no convention (stage ``loss``). Found by a reviewer (rev2 BUG-3)."""

from __future__ import annotations

from pathlib import Path

from oracle_helpers import HP, make_inputs, refppo_dump, setup_for

from refppo.dump.load import load_dump
from refppo.dump.write import write_dump
from refppo.oracle.check.diagnose import check
from refppo.oracle.detect.detection import detect


def test_detect_reproduces_a_separate_critic_loss(tmp_path: Path) -> None:
    s = setup_for(None, {})
    d = refppo_dump(make_inputs(B=8, T=16, seed=5), s)
    d["loss"] = d["loss"] - HP["vf_coef"] * d["vf_loss"]  # the actor's objective alone
    p = tmp_path / "s.safetensors"
    write_dump(p, d, hparams={**HP, "separate_critic": True})
    dump = load_dump(p)
    assert dump.step.separate_critic and check(dump, s).match
    found = detect(dump, s)
    assert "loss" not in found.unmatched_stages, found.unmatched_stages
    assert found.n_detected > 0 and found.detected  # was 0: "no convention reproduces (stage loss)"


def test_a_combined_loss_is_still_required_without_separate_critic(tmp_path: Path) -> None:
    """Control: the same dump WITHOUT the sidecar flag is not reproduced at the loss stage (the value
    term is missing from its loss), so the flag is what the search reads."""
    s = setup_for(None, {})
    d = refppo_dump(make_inputs(B=8, T=16, seed=5), s)
    d["loss"] = d["loss"] - HP["vf_coef"] * d["vf_loss"]
    p = tmp_path / "c.safetensors"
    write_dump(p, d, hparams=HP)
    assert "loss" in detect(load_dump(p), s).unmatched_stages
