"""The presets against the peers' OWN installed code (``tools/peers presets``, ``rescore_trl``),
run when the side venvs of ``tools/build_peer_venvs.sh`` exist.

Without a venv the test is SKIPPED with the reason (a skip is never a pass). With them, every case
must match under its preset + ``--set`` and every control (the exercised option flipped) must not.
Cases in :data:`PENDING` wait for a refppo fix that another change brings; they must still FAIL at
the named quantity, so that the entry is removed (and the case counted) once the fix lands.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _peers import REPO, TOOLS, cases_of, require, run
from peers.presets import VENVS  # tools/ is on the path (tests/peers/_peers.py)

PENDING: dict[str, tuple[str, str]] = {
    # case name: (first divergent quantity, the refppo fix that makes it match); empty since the
    # seq-mean-token-sum-norm and value_clip_form fixes of issue #9 landed.
}
CRITIC_GROUPS = ("skyrl-areal", "verl-openrlhf")
"""The venvs of the makers in :mod:`peers.makers` (critic and critic-free); ``trl`` below."""


def test_a_missing_venv_is_reported_not_run(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(TOOLS / "peers"), "presets", "--peers-root", str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert out.returncode == 1  # nothing ran: named, and never a pass
    assert out.stdout.count("SKIPPED") == len(VENVS), out.stdout
    assert "FAILED" not in out.stdout and "no case ran" in out.stdout, out.stdout


@pytest.mark.parametrize("group", CRITIC_GROUPS)
def test_presets_reproduce_the_peers_own_code(group: str, tmp_path: Path) -> None:
    require(group)
    proc, doc = run("presets", "--venv", group, tmp_path=tmp_path)
    assert not doc["failed"] and not doc["skipped"], (doc["failed"], doc["skipped"], proc.stdout[-2000:])
    ran = critic_free = 0
    advantages: set[str] = set()
    units = {c["unit"] for c in doc["cases"]}
    assert units == set(VENVS[group]), units  # every maker of the venv made cases
    for case in doc["cases"]:
        name, info = case["name"], case["info"]
        if name in PENDING:
            quantity, fix = PENDING[name]
            assert not case["ok"] and info["first_divergence"] == quantity, (
                f"{name} now matches or fails elsewhere: remove it from PENDING ({fix})",
                case,
            )
            continue
        assert case["ok"], (name, info["first_divergence"], info["diagnosis"])
        assert all(c["ok"] for c in case["controls"]), (name, "control still matches", case["controls"])
        ran += 1
        if ":critic-free" in case["unit"]:  # issue #13: no value quantity, --set advantage=...
            critic_free += 1
            assert "--set advantage=" in info["command"], info["command"]
            advantages.add(info["command"].split("--set advantage=")[1].split()[0])
            assert not {"vf_loss", "vf_clipfrac"} & set(info["quantities"]), info["quantities"]
            assert case["controls"], name
    assert ran >= 8  # at least eight cases really compared per venv
    assert critic_free >= 4  # the GRPO-family cases of peers/makers/critic_free.py ran
    if group == "verl-openrlhf":  # peers/makers/critic_free.py: whole steps of the newer estimators too
        assert {"opo", "gpg", "grpo-passk", "flash-reinforce"} <= advantages, sorted(advantages)
    assert proc.returncode == 0, proc.stdout[-4000:]


def test_trl_preset_reproduces_trl_own_ppo_trainer(tmp_path: Path) -> None:
    require("trl")
    proc, doc = run("presets", "--venv", "trl", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    cases = cases_of(doc, "trl")
    assert sorted(cases) == ["trl_full", "trl_ragged", "trl_ragged_k3_epoch2", "trl_ragged_whiten_rewards"]
    for name, c in cases.items():
        assert c["ok"] and len(c["info"]["quantities"]) >= 9, (name, c["info"])
    assert doc["versions"]["trl"] == "trl 1.12.0", doc["versions"]


def test_rescore_reproduces_trl_own_scoring_pass(tmp_path: Path) -> None:
    """``refppo diff --actor --ref --critic --reward-model`` on TRL's own rollout tensors and the
    checkpoints TRL scored them with (``tools/peers rescore_trl``), with a temperature control."""
    require("trl")
    proc, doc = run("rescore_trl", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    cases = cases_of(doc)
    assert sorted(cases) == ["trl_rescore_full.safetensors", "trl_rescore_ragged.safetensors"], sorted(cases)
    for c in cases.values():
        assert c["ok"] and set(c["errors"]) == {"actor", "ref", "critic", "reward-model"}, c
        (ctl,) = c["controls"]
        assert ctl["ok"] and "named ['temperature_other_value']" in ctl["detail"], ctl
