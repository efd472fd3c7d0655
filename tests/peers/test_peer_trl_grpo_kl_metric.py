"""``kl_metric_agg`` against TRL 1.16.0's own ``GRPOTrainer._compute_loss`` (``trl-grpo`` venv; SKIPPED
with the reason when it is not built): the loss's ``β·k3`` term is aggregated per sequence
(``loss_type="grpo"``), the logged ``kl`` is a token mean (issue #23 item 5).

The dump (``tools/peers/makers/trl_grpo_kl_metric.py``, ragged float64 rows) holds TRL's advantages,
its loss and its logged ``kl`` as ``kl_loss``. ``--preset trl --set advantage=grpo`` with
``loss_agg=seq-mean-token-mean`` (the variant carries ``kl_metric_agg=token-mean``) must match all
three; controls: ``kl_metric_agg=none`` (one aggregation for both) mismatches at ``kl_loss``, and a
token-mean term (``loss_agg=token-mean``) mismatches at ``loss``: no single ``kl_loss_agg`` does.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from _peers import REPO, TOOLS, require

from refppo.oracle.run import check_step

SETS = {"advantage": "grpo", "loss_agg": "seq-mean-token-mean"}


def test_trl_grpo_logged_kl_is_a_token_mean_of_a_sequence_mean_term(tmp_path: Path) -> None:
    py = require("trl-grpo")
    proc = subprocess.run(
        [str(py), str(TOOLS / "peers" / "makers" / "trl_grpo_kl_metric.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(TOOLS)},
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    path = tmp_path / "trl_grpo_kl_metric.pt"
    out = check_step(path, preset="trl", overrides=SETS)
    assert out.match, out.text()
    assert {"advantages", "kl_loss", "loss"} <= set(out.result.quantities)
    assert out.result.quantities["kl_loss"].max_abs_err <= 1e-12
    one_agg = check_step(path, preset="trl", overrides={**SETS, "kl_metric_agg": "none"})
    assert not one_agg.result.quantities["kl_loss"].ok
    assert one_agg.result.quantities["loss"].ok
    token_term = check_step(
        path, preset="trl", overrides={**SETS, "loss_agg": "token-mean", "kl_metric_agg": "none"}
    )
    assert token_term.result.quantities["kl_loss"].ok
    assert not token_term.result.quantities["loss"].ok
