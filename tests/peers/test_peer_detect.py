"""``--detect`` from refppo's defaults on dumps made by the peers' OWN code (issue #9).

``tools/peers detect`` takes the dumps of ``tools/peers presets`` (the side venvs of
``tools/build_peer_venvs.sh``) and runs ``--detect`` on each with no preset and no ``--set``: the
case's generating convention (preset + ``--set``) must be listed, or differ from a listed one only
on keys the dump does not pin (re-checked through the pipeline, never a key of the case's
``--set``). Without a venv the test is SKIPPED with the reason (a skip is never a pass). Cases in
the tool's ``EXCLUDED`` (named, with the reason) must still be not found, so a stale entry fails.
Venv ``trl``: TRL 1.12.0's whole ``PPOTrainer.train`` (``peers.makers.trl_ppo.make_detect_cases``).
The dumps are made once per venv; ``--detect`` then runs per case (``--dumps DIR --case NAME``),
each in its own process with its own timeout. A built venv whose makers crash fails here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _peers import require, run
from peers.detect import EXCLUDED, VENVS, make_dumps
from peers.harness import Report, peers_root

MIN_CASES = {"verl-openrlhf": 34, "skyrl-areal": 18, "trl": 5}
"""Cases each venv's makers write today (a maker that silently writes fewer must fail here)."""

CASE_TIMEOUT_S = 900
"""Per case: one ``--detect`` run (its own process and limit, so no venv-wide limit a loaded
machine can reach; the whole venv in one run took up to ~30 min for TRL GRPO dumps)."""


def _detect_one(dumps: Path, name: str, tmp_path: Path) -> tuple[dict[str, Any], int]:
    proc, doc = run(
        "detect", "--dumps", str(dumps), "--case", name, tmp_path=tmp_path, timeout=CASE_TIMEOUT_S
    )
    assert [c["name"] for c in doc["cases"]] == [name], doc["cases"]  # exactly this case ran
    info: dict[str, Any] = doc["cases"][0]["info"]
    return info, proc.returncode


@pytest.mark.parametrize("group", sorted(VENVS))
def test_detect_lists_the_peers_conventions(group: str, tmp_path: Path) -> None:
    require(group)
    dumps = tmp_path / "dumps"
    report = Report("detect")
    made = make_dumps(report, {group: VENVS[group]}, peers_root(), dumps)  # the peers' own code, once
    assert not report.skipped and not report.failed, (report.skipped, report.failed)
    names = [name for _, _, name in made]
    assert len(names) >= MIN_CASES[group], names
    for name in names:
        r, rc = _detect_one(dumps, name, tmp_path)
        assert r["preset_match"], f"{name}: the generating convention does not reproduce its own dump"
        if name in EXCLUDED:
            assert r["verdict"] == "excluded", f"{name} is now {r['verdict']}: remove it from EXCLUDED"
        else:
            assert r["verdict"] in ("found", "equivalent"), (name, r)
            # an option the case exercises differs only where it provably acts on nothing in the dump
            assert not set(r["differs"]) & set(r["set"]) - set(r.get("inert", [])), (name, r["differs"])
        assert rc == 0, (name, r)
