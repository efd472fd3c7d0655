"""Run ``tools/peers group_estimators``: the peers' own GRPO/RLOO/REINFORCE++ code vs refppo.

Needs the peer side venvs (/work/shared/peers/README.md); skipped with the reason where they are
absent. A case fails when a peer differs from refppo's matching parameters by more than 1e-6, or
when its control (a flipped parameter: the other convention) does NOT make a difference.
"""

from __future__ import annotations

from pathlib import Path

from _peers import require, run

VENVS = ("verl-openrlhf", "skyrl-areal")


def test_peers_group_estimators_match_refppo(tmp_path: Path) -> None:
    for venv in VENVS:
        require(venv)
    proc, doc = run("group_estimators", tmp_path=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    # every peer ran at its pinned version (a failed import would be FAILED)
    assert doc["versions"] == {
        "verl": "verl 0.9.1",
        "openrlhf": "openrlhf 0.11.2",
        "skyrl": "skyrl-train 0.3.1",
    }, doc["versions"]
    s = doc["summary"]
    # 23 peer results (16 + issue #13 item 3: opo, gpg, grpo_passk, gdpo, flash_reinforce, REINFORCE++
    # over holes x2), the four new estimators also through their preset variants, 18 controls
    assert (s["cases"], s["passed"], s["controls"], s["controls_mismatched"]) == (23, 23, 18, 18), s
    assert sum("preset" in c["errors"] for c in doc["cases"]) == 4, doc["cases"]
