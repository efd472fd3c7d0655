"""``truncated_rows=mask_in_loss`` against TRL 1.16.0's own GRPOTrainer code with
``mask_truncated_completions=True`` (``trl-grpo`` venv; SKIPPED with the reason when it is not built).

The dumps (``tools/peers/makers/trl_grpo_mask_truncated.py``, float64, three of twelve rows truncated,
in three groups): TRL's advantages (every row in the group statistics), its loss over the zeroed
``completion_mask`` and that loss's gradient ``grad_logprobs`` for ``loss_type`` grpo, bnpo, dr_grpo
and dapo. Each matches under ``--preset trl`` + its ``.set.json`` (``truncated_rows=mask_in_loss``);
controls: ``keep`` mismatches at the loss and the gradient for every type, ``drop`` (out of the row
count too) for the types that divide by ``B`` (grpo, dr_grpo) and matches for the token-count ones
(bnpo, dapo: the row count is not read); the dump with the truncated rows removed mismatches at the
advantages (the group statistics lost them).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from _peers import REPO, TOOLS, require

from refppo.oracle.run import check_step

DIVIDES_BY_ROWS = {"grpo": True, "bnpo": False, "dr_grpo": True, "dapo": False}


def test_trl_mask_truncated_completions_is_mask_in_loss(tmp_path: Path) -> None:
    py = require("trl-grpo")
    proc = subprocess.run(
        [str(py), str(TOOLS / "peers" / "makers" / "trl_grpo_mask_truncated.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(TOOLS)},
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for loss_type, by_rows in DIVIDES_BY_ROWS.items():
        path = tmp_path / f"trl_grpo_mask_truncated_{loss_type}.pt"
        sets = json.loads(path.with_suffix(".set.json").read_text())
        assert sets["truncated_rows"] == "mask_in_loss"
        out = check_step(path, preset="trl", overrides=sets)
        assert out.match, (loss_type, out.text())
        q = out.result.quantities
        assert q["loss"].max_abs_err <= 1e-7, (loss_type, q["loss"].max_abs_err)
        assert q["grad_logprobs"].max_abs_err <= 1e-8, (loss_type, q["grad_logprobs"].max_abs_err)
        keep = check_step(path, preset="trl", overrides={**sets, "truncated_rows": "keep"})
        assert q["advantages"].ok and not keep.result.quantities["loss"].ok, loss_type
        assert not keep.result.quantities["grad_logprobs"].ok, loss_type
        drop = check_step(path, preset="trl", overrides={**sets, "truncated_rows": "drop"})
        assert drop.result.quantities["loss"].ok is not by_rows, loss_type
    dropped = tmp_path / "trl_grpo_mask_truncated_dapo_rows_dropped.pt"
    sets = json.loads(dropped.with_suffix(".set.json").read_text())
    gone = check_step(dropped, preset="trl", overrides=sets)
    assert not gone.match and not gone.result.quantities["advantages"].ok
