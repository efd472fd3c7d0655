"""Run ``tools/peers gspo``: verl 0.9.1's ``compute_policy_loss_gspo`` and SkyRL-train 0.3.1's
``gspo_policy_loss`` (their own code) vs refppo's ``policy_loss=gspo``.

Needs the peer side venvs (/work/shared/peers/README.md); skipped with the reason where absent.
A case fails when a loss, clip fraction, approx KL or gradient (autograd or the closed-form twin)
differs from the peer's by more than 1e-7 relative, or when a gradient reaches a padded position;
its control (refppo's token-ratio ``vanilla`` loss on the same case) must differ from the peer.
"""

from __future__ import annotations

from pathlib import Path

from _peers import require, run


def test_verl_gspo_policy_loss_matches_refppo(tmp_path: Path) -> None:  # and SkyRL's (name: spec cites it)
    require("verl-openrlhf")
    require("skyrl-areal")
    proc, doc = run("gspo", tmp_path=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert doc["versions"] == {"verl": "verl 0.9.1", "skyrl": "skyrl-train 0.3.1"}, doc["versions"]
    s = doc["summary"]
    assert (s["cases"], s["passed"], s["controls_mismatched"]) == (32, 32, 32), s  # 20 verl, 12 SkyRL
    assert sum(c["unit"] == "verl" for c in doc["cases"]) == 20, doc["cases"]
