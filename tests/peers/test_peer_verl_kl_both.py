"""A KL in the reward and a KL loss both on in one step (issue #23 item 5): ``kl_in=both``
reproduces verl 0.9.1's own step with ``algorithm.use_kl_in_reward`` and ``actor.use_kl_loss``
both true (``tools/peers/makers/verl_kl_both.py``; one β and one estimator for the two). Runs in the
``verl-openrlhf`` venv; SKIPPED with the reason when it is not built.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from _peers import REPO, TOOLS, require

from refppo.oracle.run import check_step

CASES = ("k3_token-mean", "k1_seq-mean-token-mean", "k2_token-mean")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    py = require("verl-openrlhf")
    out = tmp_path_factory.mktemp("verl_kl_both")
    proc = subprocess.run(
        [str(py), str(TOOLS / "peers" / "makers" / "verl_kl_both.py"), str(out)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(TOOLS)}, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out


@pytest.mark.parametrize("case", CASES)
def test_verl_kl_in_reward_and_kl_loss_match_kl_in_both(dumps: Path, case: str) -> None:
    """``--preset verl --set kl_in=both`` matches (float64, ≤ 1e-8); neither placement alone does:
    ``kl_in=reward`` misses the KL loss (``kl_loss``, ``loss``), ``kl_in=loss`` the reward's −β·KL
    (``token_rewards`` onwards)."""
    path = dumps / f"verl_kl_both_{case}.pt"
    conv = json.loads((dumps / f"verl_kl_both_{case}.set.json").read_text())
    out = check_step(path, preset="verl", overrides=conv)
    assert out.match, out.text()
    assert max(q.max_abs_err for q in out.result.quantities.values()) <= 1e-8
    for control, first in (("reward", "kl_loss"), ("loss", "token_rewards")):
        bad = check_step(path, preset="verl", overrides={**conv, "kl_in": control})
        assert not bad.match
        assert not bad.result.quantities[first].ok
