"""``--detect`` from refppo's defaults on dumps made by the peers' OWN code (issue #9).

``tools/validate_detect.py`` makes the dumps of ``tools/validate_presets.py`` in the side venvs of
``tools/build_peer_venvs.sh`` and runs ``--detect`` on each with no preset and no ``--set``: the
case's generating convention (preset + ``--set``) must be listed, or differ from a listed one only
on keys the dump does not pin (re-checked through the pipeline, never a key of the case's
``--set``). Without a venv the test is SKIPPED with the reason (a skip is never a pass). Cases in
the tool's ``EXCLUDED`` (named, with the reason) must still be not found, so a stale entry fails.
Group ``trl``: TRL 1.12.0's whole ``PPOTrainer.train`` (``tools/validate_detect_trl.py``).
The dumps are made once per group; ``--detect`` then runs per case (``--dumps DIR --case NAME``),
each in its own process with its own timeout. A built venv whose makers crash fails here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
from validate_detect import EXCLUDED, GROUPS, cases, make_dumps, maker_crashes  # noqa: E402  (tools/ is not a package)
from validate_presets import PEERS_ROOT, peers_python  # noqa: E402  (tools/ is not a package)

MIN_CASES = {"verl-openrlhf": 31, "skyrl-areal": 18, "trl": 5}
"""Cases each group's makers write today (a maker that silently writes fewer must fail here)."""


CASE_TIMEOUT_S = 900
"""Per case: one ``--detect`` run (its own process and limit, so no group-wide limit a loaded
machine can reach; the whole group in one run took up to ~30 min for TRL GRPO dumps)."""


def _detect_one(
    dumps: Path, name: str, tmp_path: Path
) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    res_file = tmp_path / f"detect-{name}.json"
    tool = str(REPO / "tools" / "validate_detect.py")
    proc = subprocess.run(
        [sys.executable, tool, "--dumps", str(dumps), "--case", name, "--json-out", str(res_file)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=CASE_TIMEOUT_S,
    )
    assert res_file.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(res_file.read_text())
    assert sorted(result) == [name], sorted(result)  # exactly this case ran
    return result[name], proc


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_detect_lists_the_peers_conventions(group: str, tmp_path: Path) -> None:
    if peers_python(group, PEERS_ROOT) is None:
        pytest.skip(f"side venv {PEERS_ROOT / group} not built (tools/build_peer_venvs.sh)")
    dumps = tmp_path / "dumps"
    skipped, failed = make_dumps([group], PEERS_ROOT, dumps)  # the peers' own code, once
    assert not skipped and not failed and not maker_crashes(dumps), (skipped, failed, maker_crashes(dumps))
    names = [name for _, name, _, _ in cases(dumps)]
    assert len(names) >= MIN_CASES[group], names
    for name in names:
        r, proc = _detect_one(dumps, name, tmp_path)
        assert r["preset_match"], f"{name}: the generating convention does not reproduce its own dump"
        if name in EXCLUDED:
            assert r["verdict"] == "excluded", f"{name} is now {r['verdict']}: remove it from EXCLUDED"
        else:
            assert r["verdict"] in ("found", "equivalent"), (name, r)
            # an option the case exercises differs only where it provably acts on nothing in the dump
            assert not set(r["differs"]) & set(r["set"]) - set(r.get("inert", [])), (name, r["differs"])
        assert proc.returncode == 0, proc.stdout[-2000:]
