"""AReaL 1.0.4 bootstraps GAE on truncated rows from the value after the last token (issue #23
item 5): ``gae_bootstrap=truncated`` with ``bootstrap_values`` reproduces AReaL's own step.

AReaL ``areal/trainer/ppo/actor.py::PPOActor._compute_advantages`` starts its GAE from
``nextvalues = values[:, max_seqlen − 1] * seq_no_eos_mask``: a row filling the frame (no EOS) reads
the critic's value after its last token. ``tools/peers/makers/areal_bootstrap.py`` runs that code
(with ``ppo_actor_loss_fn`` / ``ppo_critic_loss_fn``) on batches with truncated rows. Runs in the
``skyrl-areal`` venv; SKIPPED with the reason when it is not built.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from _peers import REPO, TOOLS, require

from refppo.oracle.run import check_step

CASES = ("flagged", "implied", "whitened")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    py = require("skyrl-areal")
    out = tmp_path_factory.mktemp("areal_bootstrap")
    proc = subprocess.run(
        [str(py), str(TOOLS / "peers" / "makers" / "areal_bootstrap.py"), str(out)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(TOOLS)}, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out


@pytest.mark.parametrize("case", CASES)
def test_areal_truncated_rows_match_with_the_bootstrap_and_not_without(dumps: Path, case: str) -> None:
    """``--preset areal --set gae_bootstrap=truncated`` matches AReaL's dump (returns to ≤ 2e-6,
    float32); the control ``gae_bootstrap=none`` mismatches at ``returns``."""
    path = dumps / f"areal_bootstrap_{case}.pt"
    conv = json.loads((dumps / f"areal_bootstrap_{case}.set.json").read_text())
    out = check_step(path, preset="areal", overrides=conv)
    assert out.match, out.text()
    assert out.result.quantities["returns"].max_abs_err <= 2e-6
    control = check_step(path, preset="areal", overrides={**conv, "gae_bootstrap": "none"})
    assert not control.match
    assert not control.result.quantities["returns"].ok
