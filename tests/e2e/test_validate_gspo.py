"""Run tools/validate_gspo.py: verl 0.9.1's own ``compute_policy_loss_gspo`` vs refppo's ``policy_loss=gspo``.

Needs the verl side venv (/work/shared/peers/README.md); skipped with the reason where it is absent.
The script exits 1 when a loss, clip fraction, approx KL or gradient (autograd or the closed-form
twin) differs from verl's by more than 1e-7 relative, when a gradient reaches a padded position, or
when refppo's token-ratio ``vanilla`` loss does NOT differ from verl's GSPO on the same case.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "validate_gspo.py"
PEER = Path("/work/peervenv/verl-openrlhf/bin/python")


@pytest.mark.skipif(
    not PEER.exists(), reason=f"peer venv absent: {PEER} (built as /work/shared/peers/README.md says)"
)
def test_verl_gspo_policy_loss_matches_refppo() -> None:
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--peers-python", str(PEER)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "'verl 0.9.1'" in out, out  # the peer ran, at the version the presets cite
    assert "20 comparisons, 0 failure(s)" in out, out
