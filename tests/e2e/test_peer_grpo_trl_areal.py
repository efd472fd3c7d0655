"""Run tools/validate_grpo_peers.py: TRL GRPOTrainer's and AReaL's GRPO family, as dumps.

Per side venv (TRL 1.12.0 ``trl``, TRL 1.16.0 ``trl-grpo``, AReaL 1.0.4 ``skyrl-areal``), each
skipped with the reason where it is absent (/work/shared/peers/README.md). The peer's OWN code makes
each dump (TRL: the advantage block of ``GRPOTrainer._generate_and_score_completions`` and
``_compute_loss``; AReaL: ``PPOActor._compute_advantages`` with a group ``reward_norm``); the script
exits 1 when ``refppo diff --preset PEER --set ...`` does not reproduce a dump, when the case's
control (one key flipped) still reproduces it, or when ``--detect`` from refppo's defaults does not
list the generating convention. TRL ``scale_rewards="batch"`` (``group_std_level=batch``) and
AReaL ``std_level: batch`` (``group_std_level=batch-centred``) must be reproduced like the rest (they
were NOT EXPRESSIBLE before that key); each of their controls is another std level.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "validate_grpo_peers.py"
ROOT = Path(os.environ.get("REFPPO_PEERS_ROOT", "/work/peervenv"))
EXPECTED = {
    # venv: (the peer's version line, cases that must pass through the preset, named cases)
    "trl": ("trl 1.12.0", "trl1120_grpo_", ("group_bool_grpo_beta", "none_bool_bnpo_n3_beta", "group_n1")),
    "trl-grpo": (
        "trl 1.16.0",
        "trl1160_grpo_",
        ("group_bool_grpo_beta", "none_dr_grpo", "group_equal_scores"),
    ),
    "skyrl-areal": (
        "areal 1.0.4",
        "areal_grpo_",
        ("grpo_k1", "dr_grpo", "rloo_leave1out", "rloo_group_size1"),
    ),
}
BATCH_STD = {
    # venv: the cases with a batch-level std (group_std_level batch / batch-centred), all expressed
    "trl": ("batch_dapo", "batch_equal_scores_beta", "batch_bnpo_n3_f32"),
    "trl-grpo": ("batch_dapo", "batch_equal_scores_beta", "batch_bnpo_n3_f32"),
    "skyrl-areal": ("grpo_std_batch", "grpo_std_batch_population_n3"),
}


@pytest.mark.parametrize("venv", sorted(EXPECTED))
def test_peer_grpo_dumps_reproduce_under_the_preset_and_detect_finds_them(venv: str, tmp_path: Path) -> None:
    if not (ROOT / venv / "READY").exists():
        pytest.skip(
            f"peer venv absent: {ROOT / venv} "
            "(built by tools/build_peer_venvs.sh, /work/shared/peers/README.md)"
        )
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--venv", venv, "--peers-root", str(ROOT), "--json-out", str(out)],
        capture_output=True, text=True, timeout=1800, cwd=REPO,
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    version, prefix, named = EXPECTED[venv]
    assert f"{venv}: {version}" in log, log  # the peer ran, at the pinned version
    res = json.loads(out.read_text())[venv]
    cases = res["cases"]
    for name in (*named, *BATCH_STD[venv]):
        assert prefix + name in cases, sorted(cases)
    expressed = {n: c for n, c in cases.items() if c["verdict"] != "not expressible"}
    assert len(expressed) >= 6, sorted(cases)
    for name in BATCH_STD[venv]:
        c = cases[prefix + name]
        assert c["verdict"] == "MATCH" and "group_std_level" in c["command"], (name, c)
        assert set(c["control"]) == {"group_std_level"} and c["control_mismatches"], (name, c)
        assert c["detect"] in ("found", "equivalent"), (name, c)  # --detect lists the std level too
    for name, c in expressed.items():
        assert c["verdict"] == "MATCH" and c["quantities"] >= 2, (name, c)
        assert c["control_mismatches"], (name, c)
        if c["detect"] not in ("found", "equivalent"):
            # named gaps only (tools/validate_grpo_peers.py::DETECT_GAPS), reported with the reason
            assert name == "areal_grpo_grpo_reward_scale_clip" and c["detect_gap"], (name, c)
    not_expressible = sorted(n for n, c in cases.items() if c["verdict"] == "not expressible")
    assert not_expressible == [], not_expressible  # every form these makers run is stated now
