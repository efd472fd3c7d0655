"""``approx_kl=k2_all_positions`` (½·(l − l_old)² averaged over every position of the frame, issue #23
item 5) against TRL 1.12.0's own ``PPOTrainer.train`` (``trl`` venv; SKIPPED with the reason when it
is not built), with the control the preset validation lacked.

The dump (``tools/peers/makers/trl_approx_kl.py``) is TRL's second PPO epoch on right-padded rows of
different lengths, so ``d = l − l_old ≠ 0`` and the frame (``B·T``) holds more positions than the
valid tokens. Its ``approx_kl`` is TRL's logged ``approxkl``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from _peers import REPO, TOOLS, require

from refppo.dump.load import load_dump
from refppo.oracle.run import check_step


def test_trl_approxkl_is_half_d_squared_over_the_whole_frame(tmp_path: Path) -> None:
    """By hand from the dump's log-probs: TRL's ``approxkl`` is ``½·Σ_valid d²/(B·T)`` (not the mean
    over the valid tokens); ``--preset trl`` (``k2_all_positions``) matches it, and the control
    ``approx_kl=k1`` (verl's ``ppo_kl``) mismatches at ``approx_kl``."""
    py = require("trl")
    proc = subprocess.run(
        [str(py), str(TOOLS / "peers" / "makers" / "trl_approx_kl.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TOOLS)])},
        timeout=900,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    path = tmp_path / "trl_approx_kl.safetensors"
    d = load_dump(path)
    m = d.tensors["response_mask"].bool()
    lp, old = d.tensors["logprobs"].double(), d.tensors["old_logprobs"].double()
    sq = (0.5 * (lp - old) ** 2).masked_fill(~m, 0.0)
    frame = float(sq.sum()) / m.numel()
    valid = float(sq.sum()) / int(m.sum())
    logged = float(d.tensors["approx_kl"])
    assert int(m.sum()) < m.numel()  # ragged rows: the two means differ
    assert abs(logged - frame) <= 1e-6 * abs(frame)
    assert abs(logged - valid) > 1e-3 * abs(valid)
    out = check_step(path, preset="trl", overrides={"kl_estimator": "k3"})
    assert out.match, out.text()
    assert "approx_kl" in out.result.quantities
    control = check_step(path, preset="trl", overrides={"kl_estimator": "k3", "approx_kl": "k1"})
    assert not control.result.quantities["approx_kl"].ok
