"""``refppo.capture.adapters`` against the peers' OWN installed code (``tools/validate_adapters.py``).

For verl 0.9.1, OpenRLHF 0.11.2 and TRL 1.12.0 the peer's code builds its own container (a
``DataProto`` through ``apply_kl_penalty``/``compute_advantage`` and ``ppo_loss``/``value_loss``
over two micro-batches; an ``Experience`` through ``compute_advantages_and_returns`` and
``PolicyLoss``/``ValueLoss``; one ``PPOTrainer.train`` step), the adapter turns it into a dump, and
``refppo diff --preset <peer>`` must match; the same container with one field corrupted must
mismatch first at that field. Without the side venv the test is SKIPPED with the reason (a skip is
never a pass).
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
from validate_adapters import VENV  # noqa: E402  (tools/ is not a package)
from validate_presets import PEERS_ROOT, peers_python  # noqa: E402  (tools/ is not a package)

VERSIONS = {"verl": "0.9.1", "openrlhf": "0.11.2", "trl": "1.12.0"}
MIN_CASES = {"verl": 3, "openrlhf": 2, "trl": 2}


def test_a_missing_venv_is_reported_not_run(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "tools" / "validate_adapters.py"), "--peers-root", str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SKIPPED") == 3, out.stdout


@pytest.mark.parametrize("peer", sorted(VENV))
def test_adapter_dumps_from_the_peers_own_code_match_the_preset(peer: str, tmp_path: Path) -> None:
    if peers_python(VENV[peer], PEERS_ROOT) is None:
        pytest.skip(f"side venv {PEERS_ROOT / VENV[peer]} not built (tools/build_peer_venvs.sh)")
    res_file = tmp_path / "result.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "validate_adapters.py"),
            "--peer",
            peer,
            "--json-out",
            str(res_file),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=1800,
    )
    res = json.loads(res_file.read_text())[peer]
    assert "error" not in res and "skipped" not in res, (res, proc.stdout[-2000:])
    assert res["version"] == VERSIONS[peer]
    assert len(res["cases"]) >= MIN_CASES[peer]
    for case in res["cases"]:
        assert case["ok"], (case["name"], case["first_divergence"], case["diagnosis"])
        # the dump compared the losses, not only the rollout quantities
        assert {"advantages", "returns", "pg_loss", "vf_loss"} <= set(case["quantities"]), case["quantities"]
        assert case["controls"] and all(c["caught"] for c in case["controls"]), (
            case["name"],
            case["controls"],
        )
        if res["v2"] and "grad_logprobs" in case["keys"]:  # dump v2 oracle: the gradients are compared too
            assert {"grad_logprobs", "grad_values"} <= set(case["quantities"]), case["quantities"]
    assert proc.returncode == 0, proc.stdout[-4000:]
