"""Run tools/validate_trl_grpo.py: TRL's own ``GRPOTrainer._compute_loss`` vs refppo's pipeline.

Twice: TRL 1.12.0 (the PPO closure's venv, ``trl``) and TRL 1.16.0 (the GRPO closure's venv,
``trl-grpo``, ``tools/build_peer_venvs.sh --with-trl-grpo``); each is skipped with the reason where
its venv is absent (/work/shared/peers/README.md).
The script exits 1 when refppo's loss or gradient (autograd or the closed-form twin) under the
mapping of spec/conventions.md differs from TRL's by more than 1e-9 relative for a ``loss_type`` /
``importance_sampling_level`` / ``delta`` / ``beta`` case, or when a contrast (one key of the
mapping flipped) still reproduces TRL.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "validate_trl_grpo.py"
sys.path.insert(0, str(REPO / "tools"))
from validate_presets import PEERS_ROOT, peers_python  # noqa: E402  (tools/ is not a package)

VENVS = {"1.12.0": "trl", "1.16.0": "trl-grpo"}
"""TRL version → its side venv under ``$REFPPO_PEERS_ROOT``."""


@pytest.mark.parametrize("version", sorted(VENVS))
def test_trl_grpo_loss_types_match_refppo(version: str) -> None:
    peer = peers_python(VENVS[version], PEERS_ROOT)  # None unless the READY stamp is there
    if peer is None:
        pytest.skip(
            f"peer venv not built: {PEERS_ROOT / VENVS[version]} (no READY stamp; "
            "tools/build_peer_venvs.sh, /work/shared/peers/README.md)"
        )
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--peers-python", str(peer)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"'trl {version}'" in out, out  # the peer ran, at the pinned version
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        assert f"OK  {loss_type}/sequence/" in out, out
    assert "24 comparisons, 0 failure(s)" in out, out
