"""Run tools/validate_trl_grpo.py: TRL 1.12.0's own ``GRPOTrainer._compute_loss`` vs refppo's pipeline.

Needs the TRL side venv (/work/shared/peers/README.md); skipped with the reason where it is absent.
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

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "validate_trl_grpo.py"
PEER = Path("/work/peervenv/trl/bin/python")


@pytest.mark.skipif(
    not PEER.exists(), reason=f"peer venv absent: {PEER} (built as /work/shared/peers/README.md says)"
)
def test_trl_grpo_loss_types_match_refppo() -> None:
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--peers-python", str(PEER)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "'trl 1.12.0'" in out, out  # the peer ran, at the pinned version
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        assert f"OK  {loss_type}/sequence/" in out, out
    assert "24 comparisons, 0 failure(s)" in out, out
