"""``refppo train`` with ``ppo.advantage=grpo`` under ``ppo.rollout_rs_effect=drop_mask`` (issue #22):
a row the gate empties stays in GRPO's group statistics (verl 0.9.1; pipeline.row_subset) and leaves
the update's counts; the run's dump matches its oracle, the gate as a ``weight`` does not."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from refppo.oracle.cli import main as refppo_diff
from refppo.train.loop import Trainer
from refppo.train.tasks.presets import preset

pytestmark = pytest.mark.e2e

SETS = (
    "task.reward=rule", "task.sft_steps=3", "ppo.minibatches=1", "seam.enabled=true", "seam.staleness=1",
    "ppo.rollout_rs=token", "ppo.rollout_rs_effect=drop_mask", "ppo.rollout_rs_low=0.98",
    "ppo.rollout_rs_high=1.02", "rollout.group_size=2", "ppo.advantage=grpo", "run.iterations=3",
    "run.dump_iteration=3",
)  # fmt: skip
"""tests/train/test_train_split_runs.py's DROP gate (a bfloat16 engine one iteration stale, verl's
token gate in [0.98, 1.02]) under GRPO, 4 prompts × 2 responses; iteration 3 empties a row."""


def _diff(path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = refppo_diff([str(path), "--json", *extra])
    return code, json.loads(buf.getvalue())


def test_a_grpo_drop_mask_run_that_empties_a_row_matches_its_oracle(tmp_path: Path) -> None:
    Trainer(preset("test", *SETS, f"run.out_dir={tmp_path}")).train()
    path = tmp_path / "dumps" / "iter_000003.safetensors"
    d = load_file(str(path))
    m = d["response_mask"].bool()
    ratio = (d["old_logprobs"].double() - d["rollout_logprobs"].double()).exp()
    kept = m & (ratio >= 0.98) & (ratio <= 1.02)
    assert int((~kept.any(dim=1)).sum()) >= 1  # a row the gate empties, inside a group of 2
    assert float(d["advantages"][~kept.any(dim=1)].abs().max()) == 0.0
    code, rep = _diff(path)
    assert code == 0, rep["diagnosis"]
    code, rep = _diff(path, "--set", "rollout_rs_effect=weight")
    assert code == 1 and not rep["quantities"]["advantages"]["ok"]
