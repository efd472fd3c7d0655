"""``ppo.rollout_rs_effect=drop_mask`` and ``loss_agg=prompt-mean`` under ``torchrun`` (2 gloo
processes, 4 rows per rank in 2 micro-batches): the split step's counts — the gate's kept tokens and
rows, each prompt's tokens ``N_p`` and the number of prompts ``P`` — are the whole step's, summed over
the ranks by the one all-reduce of counts (``refppo/train/split.py``). Rank 0 writes one dump of both
ranks' rows at iteration 3; ``refppo diff`` matches it and a control setting mismatches."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file
from torchrun_helpers import torchrun_train

from refppo.oracle.cli import main as refppo_diff
from refppo.train.tasks.presets import TEST

pytestmark = pytest.mark.e2e

BASE = (
    "task.reward=rule",
    "task.sft_steps=3",
    "ppo.minibatches=1",
    "run.iterations=3",
    "run.dump_iteration=3",
)
CASES = {
    "drop_mask": (
        "seam.enabled=true",
        "seam.staleness=1",
        "ppo.rollout_rs=token",
        "ppo.rollout_rs_effect=drop_mask",
        "ppo.rollout_rs_low=0.98",
        "ppo.rollout_rs_high=1.02",
    ),
    "prompt-mean": ("rollout.group_size=2", "ppo.loss_agg=prompt-mean", "ppo.value_loss_agg=token-mean"),
}
CONTROLS = {"drop_mask": "rollout_rs_effect=weight", "prompt-mean": "loss_agg=seq-mean-token-mean"}


def _diff(path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = refppo_diff([str(path), "--json", *extra])
    return code, json.loads(buf.getvalue())


@pytest.mark.parametrize("case", sorted(CASES))
def test_torchrun_split_modes_dump_matches_its_oracle(tmp_path: Path, case: str) -> None:
    """drop_mask: the gate (counted by hand from the dump) rejects tokens on both ranks;
    prompt-mean: 2 prompts of 2 rows on each rank, 4 in the step (``P`` all-reduced)."""
    out = tmp_path / "run"
    args = ["--out", str(out)]
    for s in (*TEST, *BASE, *CASES[case]):
        args += ["--set", s]
    torchrun_train(tmp_path / "torchrun.log", *args)
    path = out / "dumps" / "iter_000003.safetensors"
    d = load_file(str(path))
    assert d["response_mask"].shape[0] == 8 and sorted(set(d["rank"].tolist())) == [0, 1]
    m = d["response_mask"].bool()
    if case == "drop_mask":
        ratio = (d["old_logprobs"].double() - d["rollout_logprobs"].double()).exp()
        rejected = m & ((ratio < 0.98) | (ratio > 1.02))
        assert all(bool(rejected[d["rank"] == r].any()) for r in (0, 1))
    else:
        for r in (0, 1):
            g = d["group_index"][d["rank"] == r].tolist()
            assert sorted(g.count(x) for x in set(g)) == [2, 2], (r, g)
        assert len(set(d["group_index"].tolist())) == 4
    code, rep = _diff(path)
    assert code == 0, rep["diagnosis"]
    code, rep = _diff(path, "--set", CONTROLS[case])
    assert code == 1 and not rep["quantities"]["pg_loss"]["ok"], CONTROLS[case]
