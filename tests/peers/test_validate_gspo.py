"""Run tools/validate_gspo.py: verl 0.9.1's ``compute_policy_loss_gspo`` and SkyRL-train 0.3.1's
``gspo_policy_loss`` (their own code) vs refppo's ``policy_loss=gspo``.

Needs the peer side venvs (/work/shared/peers/README.md); skipped with the reason where absent.
The script exits 1 when a loss, clip fraction, approx KL or gradient (autograd or the closed-form
twin) differs from verl's by more than 1e-7 relative, when a gradient reaches a padded position, or
when refppo's token-ratio ``vanilla`` loss does NOT differ from verl's GSPO on the same case.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "validate_gspo.py"
PEERS = (Path("/work/peervenv/verl-openrlhf/bin/python"), Path("/work/peervenv/skyrl-areal/bin/python"))


@pytest.mark.skipif(
    not all(p.exists() for p in PEERS),
    reason="peer venvs absent: "
    + ", ".join(str(p) for p in PEERS if not p.exists())
    + " (built as /work/shared/peers/README.md says)",
)
def test_verl_gspo_policy_loss_matches_refppo() -> None:  # and SkyRL's (name kept: spec cites it)
    proc = subprocess.run(
        [sys.executable, str(TOOL), *(a for p in PEERS for a in ("--peers-python", str(p)))],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "'verl 0.9.1'" in out and "'skyrl-train 0.3.1'" in out, out  # both peers ran, pinned versions
    assert "32 comparisons, 0 failure(s)" in out, out  # 20 with verl, 12 with SkyRL
