"""Run tools/validate_kl_straight_through.py: verl 0.9.1's own ``kl_penalty`` with a ``+`` suffix
(straight-through) vs refppo's ``k1+``/``k3+``/``abs+`` — value, autograd gradient and the
closed-form gradient twin — with the base estimator's gradient as a control that must differ.

Needs the verl side venv (/work/shared/peers/README.md); skipped with the reason where it is absent.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "validate_kl_straight_through.py"
sys.path.insert(0, str(REPO / "tools"))
from validate_presets import PEERS_ROOT, peers_python  # noqa: E402  (tools/ is not a package)


def test_verl_straight_through_kl_matches_refppo() -> None:
    peer = peers_python("verl-openrlhf", PEERS_ROOT)  # $REFPPO_PEERS_ROOT and its READY stamp
    if peer is None:
        pytest.skip(
            f"peer venv not built: {PEERS_ROOT / 'verl-openrlhf'} "
            "(no READY stamp; /work/shared/peers/README.md)"
        )
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--peers-python", str(peer)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "verl 0.9.1" in out and "7 names, 0 failure(s)" in out, out
    assert out.count("ok  control") == 5, out  # every + variant's gradient differs from its base's
