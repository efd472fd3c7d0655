"""``--detect`` on gradient-only v2 step dumps of the peers' OWN micro-batch code (#23 item 3).

``tools/peers detect_grads`` runs verl 0.9.1, OpenRLHF 0.11.2 (venv ``verl-openrlhf``) and
SkyRL-train 0.3.1 (``skyrl-areal``) over two ranks × two micro-batches
(:mod:`peers.makers.grad_only`): ``grad_logprobs``/``grad_values``, no scalar loss. From refppo's
defaults ``--detect`` must list each case's generating convention (which must itself reproduce the
dump), and must NOT list a control's (the same peer's code with a per-micro-batch normaliser: its
own convention does not reproduce it either). Without a venv the test is SKIPPED with the reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _peers import require, run
from peers.detect_grads import CONTROL, EXCLUDED, VENVS

MIN_CASES = {"verl:grads": 8, "openrlhf:grads": 6, "skyrl:grads": 4}
"""Cases (controls included) each maker writes today: a maker that silently writes fewer fails."""


@pytest.mark.parametrize("venv", sorted(VENVS))
def test_detect_lists_each_peers_convention_from_the_gradient(venv: str, tmp_path: Path) -> None:
    require(venv)
    proc, doc = run("detect_grads", "--venv", venv, tmp_path=tmp_path, timeout=1500)
    assert not doc["skipped"] and not doc["failed"], (doc["skipped"], doc["failed"])
    for unit in VENVS[venv]:
        cases = [c for c in doc["cases"] if c["unit"] == unit]
        assert len(cases) >= MIN_CASES[unit], [c["name"] for c in cases]
        assert any(c["name"].endswith(CONTROL) for c in cases), unit  # every peer has a control
        assert any(not c["name"].endswith(CONTROL) and c["name"] not in EXCLUDED for c in cases), unit
    for c in doc["cases"]:
        r = c["info"]
        if c["name"] in EXCLUDED:
            assert r["verdict"] == "excluded", (c["name"], r)
        elif c["name"].endswith(CONTROL):
            assert not r["preset_match"] and r["verdict"] == "not found", (c["name"], r)
        else:
            assert r["preset_match"], f"{c['name']}: the generating convention does not reproduce its dump"
            assert r["verdict"] in ("found", "equivalent"), (c["name"], r)
            # an option the case exercises is never what differs
            assert not set(r["differs"]) & set(r["set"]), (c["name"], r["differs"])
    assert proc.returncode == 0, proc.stdout[-3000:]
