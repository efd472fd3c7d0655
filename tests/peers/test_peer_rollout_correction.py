"""Run ``tools/peers rollout_correction``: verl 0.9.1, OpenRLHF 0.11.2, AReaL 1.0.4, SkyRL-train 0.3.1
and TRL 1.16.0 rollout-correction code (their own functions) vs refppo's core
(``refppo.core.rollout_correction``, ``rollout_losses``, ``cispo``).

Needs the peer side venvs (/work/shared/peers/README.md); skipped with the reason where absent.
A case fails when a weight, kept mask, loss, gradient or clip fraction differs from the peer's beyond
its tolerance (tools/peers/rollout_correction.py) or a gradient reaches a padded position; each
case's control (one convention flipped: product vs geometric, truncate vs mask, the gate's order or
reduction, rejected tokens zeroed vs dropped, the weight not detached, ...) must differ from the peer.
"""

from __future__ import annotations

from pathlib import Path

from _peers import cases_of, require, run


def test_peers_rollout_correction_matches_refppo_core(tmp_path: Path) -> None:
    for venv in ("verl-openrlhf", "skyrl-areal", "trl-grpo"):
        require(venv)
    proc, doc = run("rollout_correction", tmp_path=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert doc["versions"] == {
        "verl": "verl 0.9.1",
        "openrlhf": "openrlhf 0.11.2",
        "areal": "areal 1.0.4",
        "skyrl": "skyrl-train 0.3.1",
        "trl": "trl 1.16.0",
    }, doc["versions"]
    s = doc["summary"]
    assert (s["cases"], s["passed"], s["controls_mismatched"]) == (65, 65, 68), s
    per_unit = {u: len(cases_of(doc, u)) for u in ("verl", "openrlhf", "areal", "skyrl", "trl")}
    assert per_unit == {"verl": 29, "openrlhf": 4, "areal": 16, "skyrl": 4, "trl": 12}, per_unit
    verl = cases_of(doc, "verl")
    # the sequence product is verl's convention (the geometric control mismatches), IcePop zeroes
    assert verl["verl/weights/sequence/2.0"]["passed"], verl["verl/weights/sequence/2.0"]
    assert verl["verl/drop/seq_max_k2/0.15/seq-mean-token-mean"]["passed"]
