"""The presets against the peers' OWN installed code (``tools/validate_presets.py`` and
``tools/validate_trl_preset.py``), run when the side venvs of ``tools/build_peer_venvs.sh`` exist.

Without a venv the test is SKIPPED with the reason (a skip is never a pass). With them, every case
must match under its preset + ``--set`` and every control (the exercised option flipped) must not.
Cases in :data:`PENDING` wait for a refppo fix that another change brings; they must still FAIL at
the named quantity, so that the entry is removed (and the case counted) once the fix lands.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
from validate_presets import GROUPS, PEERS_ROOT, peers_python  # noqa: E402  (tools/ is not a package)

PENDING: dict[str, tuple[str, str]] = {
    # case name: (first divergent quantity, the refppo fix that makes it match); empty since the
    # seq-mean-token-sum-norm and value_clip_form fixes of issue #9 landed.
}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def test_a_missing_venv_is_reported_not_run(tmp_path: Path) -> None:
    assert peers_python("skyrl-areal", tmp_path) is None  # no READY stamp: nothing to run
    (tmp_path / "skyrl-areal" / "bin").mkdir(parents=True)
    (tmp_path / "skyrl-areal" / "bin" / "python").touch()
    assert peers_python("skyrl-areal", tmp_path) is None  # half-built (no READY) counts as missing
    out = subprocess.run(
        [sys.executable, str(REPO / "tools" / "validate_presets.py"), "--peers-root", str(tmp_path)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert out.returncode == 1  # nothing ran: named, and never a pass
    assert out.stdout.count("SKIPPED") == sum(len(v) for v in GROUPS.values()), out.stdout
    assert "FAILED" not in out.stdout and "no case ran" in out.stdout, out.stdout


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_presets_reproduce_the_peers_own_code(group: str, tmp_path: Path) -> None:
    if peers_python(group, PEERS_ROOT) is None:
        pytest.skip(f"side venv {PEERS_ROOT / group} not built (tools/build_peer_venvs.sh)")
    res_file = tmp_path / "result.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "validate_presets.py"),
            "--group",
            group,
            "--json-out",
            str(res_file),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=1800,
    )
    result = json.loads(res_file.read_text())
    ran = 0
    critic_free = 0
    advantages: set[str] = set()
    for peer in GROUPS[group]:
        res = result[peer]
        assert "cases" in res, (peer, res, proc.stdout[-2000:])  # not skipped, maker not crashed
        for case in res["cases"]:
            name = case["name"]
            if name in PENDING:
                quantity, fix = PENDING[name]
                assert not case["ok"] and case["first_divergence"] == quantity, (
                    f"{name} now matches or fails elsewhere: remove it from PENDING ({fix})",
                    case,
                )
                continue
            assert case["ok"], (name, case["first_divergence"], case["diagnosis"])
            assert case["control"] is None or case["control"]["mismatches"], (name, "control still matches")
            ran += 1
            critic_free += ":critic-free" in peer
            if ":critic-free" in peer:  # issue #13: no value quantity, --set advantage=...
                assert "--set advantage=" in case["command"], case["command"]
                advantages.add(case["command"].split("--set advantage=")[1].split()[0])
                assert not {"vf_loss", "vf_clipfrac"} & set(case["quantities"]), case["quantities"]
                assert case["control"] is not None
    assert ran >= 8  # at least eight cases really compared per venv
    assert critic_free >= 4  # the GRPO-family cases of tools/peer_makers/critic_free.py ran
    if group == "verl-openrlhf":  # tools/peer_makers/critic_free.py: whole steps of the newer estimators too
        assert {"opo", "gpg", "grpo-passk", "flash-reinforce"} <= advantages, sorted(advantages)


def test_trl_preset_reproduces_trl_own_ppo_trainer() -> None:
    py = PEERS_ROOT / "trl" / "bin" / "python"
    if not (PEERS_ROOT / "trl" / "READY").exists() or not py.exists():
        pytest.skip(f"side venv {PEERS_ROOT / 'trl'} not built (tools/build_peer_venvs.sh)")
    proc = subprocess.run(
        [str(py), str(REPO / "tools" / "validate_trl_preset.py")],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=1800,
    )
    assert "SKIPPED" not in proc.stdout, proc.stdout[-2000:]
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.stdout.count(" MATCH ") >= 4


def test_rescore_reproduces_trl_own_scoring_pass() -> None:
    """``refppo diff --actor --ref --critic --reward-model`` on TRL's own rollout tensors and the
    checkpoints TRL scored them with (``tools/validate_rescore_trl.py``), with a temperature control."""
    py = PEERS_ROOT / "trl" / "bin" / "python"
    if not (PEERS_ROOT / "trl" / "READY").exists() or not py.exists():
        pytest.skip(f"side venv {PEERS_ROOT / 'trl'} not built (tools/build_peer_venvs.sh)")
    proc = subprocess.run(
        [str(py), str(REPO / "tools" / "validate_rescore_trl.py")],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=1800,
    )
    assert "SKIPPED" not in proc.stdout, proc.stdout[-2000:]
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.stdout.count(" MATCH ") == 2 and proc.stdout.count("named ['temperature_other_value']") == 2
