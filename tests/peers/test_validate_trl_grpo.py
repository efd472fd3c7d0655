"""Run ``tools/peers trl_grpo``: TRL's own ``GRPOTrainer._compute_loss`` vs refppo's pipeline.

Twice: TRL 1.12.0 (the PPO closure's venv, ``trl``) and TRL 1.16.0 (the GRPO closure's venv,
``trl-grpo``, ``tools/build_peer_venvs.sh --with-trl-grpo``); each is skipped with the reason where
its venv is absent (/work/shared/peers/README.md).
A case fails when refppo's loss or gradient (autograd or the closed-form twin) under the mapping of
spec/conventions.md differs from TRL's by more than 1e-9 relative for a ``loss_type`` /
``importance_sampling_level`` / ``delta`` / ``beta`` case, or when a control (one key of the
mapping flipped) still reproduces TRL.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _peers import require, run

VENVS = {"1.12.0": "trl", "1.16.0": "trl-grpo"}
"""TRL version → its side venv under ``$REFPPO_PEERS_ROOT``."""


@pytest.mark.parametrize("version", sorted(VENVS))
def test_trl_grpo_loss_types_match_refppo(version: str, tmp_path: Path) -> None:
    venv = VENVS[version]
    require(venv)  # skipped unless the READY stamp is there
    proc, doc = run("trl_grpo", "--venv", venv, tmp_path=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert doc["versions"] == {venv: f"trl {version}"}, doc["versions"]  # the peer ran, pinned version
    names = {c["name"] for c in doc["cases"] if c["passed"]}
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        assert any(n.startswith(f"{loss_type}/sequence/") for n in names), names
    s = doc["summary"]
    assert (s["cases"], s["passed"]) == (24, 24), s
    assert s["controls"] == s["controls_mismatched"] == 40, s
