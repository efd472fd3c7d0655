"""Mixed staleness under ``torchrun`` (issue #22 item 5, ``seam.staleness_min``): 2 gloo processes,
each rank's rows sampled by policies of different ages (k = 2, j = 0: staleness 0, 1, 2, 0 over a
rank's 4 rows), a bfloat16 engine and token TIS. The dump of iteration 3 records each row's
``policy_version`` and ``refppo diff`` matches it (the correction off mismatches); 3 iterations
straight == 2, stop, ``--resume``, 1 — metrics, weights, snapshots and the dump, bit for bit."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torchrun_helpers import torchrun_train

from refppo.oracle.cli import main as refppo_diff
from refppo.train.runlog import deterministic, read_metrics
from refppo.train.tasks.presets import TEST

pytestmark = pytest.mark.e2e

MIXED = (
    "task.reward=rule",
    "task.sft_steps=3",
    "ppo.minibatches=1",
    "run.checkpoint_every=1",
    "seam.enabled=true",
    "seam.staleness=2",
    "seam.staleness_min=0",
    "ppo.rollout_is=token",
    "ppo.rollout_is_low=0.98",
    "ppo.rollout_is_high=1.02",
)
"""TEST preset (8 rollouts, 2 epochs), one minibatch (a dump needs it), k = 2, j = 0, token TIS."""


def _torchrun(tmp_path: Path, out: Path, *sets: str, resume: bool = False) -> None:
    """``torchrun`` (2 gloo processes) ``refppo train --out OUT`` with :data:`MIXED` and ``sets``."""
    args = ["--out", str(out), *(["--resume"] if resume else [])]
    for s in (*TEST, *MIXED, *sets):
        args += ["--set", s]
    torchrun_train(tmp_path / f"{out.name}-{len(list(tmp_path.glob('*.log')))}.log", *args)


def _diff(path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = refppo_diff([str(path), "--json", *extra])
    return code, json.loads(buf.getvalue())


def _same_tensors(a: Path, b: Path) -> bool:
    ta, tb = load_file(str(a)), load_file(str(b))
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_torchrun_mixed_staleness_dump_matches_and_resume_is_exact(tmp_path: Path) -> None:
    """Iteration 3 (version 2): each rank's rows 0..3 are 0, 1, 2, 0 iterations old, so sampled by
    versions 2, 1, 0, 2 (a hand count); the stale rows' engine log-probs are far from the trainer's,
    the fresh rows' only by bfloat16. The checkpoint of iteration 2 holds snapshots [0, 1]."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    _torchrun(tmp_path, straight, "run.iterations=3", "run.dump_iteration=3")
    _torchrun(tmp_path, split, "run.iterations=2")
    state2 = json.loads((split / "checkpoints" / "iter_000002" / "state.json").read_text())
    assert state2["seam"] == {"versions": [0, 1]} and state2["world_size"] == 2
    _torchrun(tmp_path, split, "run.iterations=3", "run.dump_iteration=3", resume=True)

    path = straight / "dumps" / "iter_000003.safetensors"
    d = load_file(str(path))
    for rank in (0, 1):
        rows = (d["rank"] == rank).nonzero().flatten()
        order = rows[d["group_index"][rows].argsort()]  # the rank's rows in rollout order
        assert d["policy_version"][order].tolist() == [2, 1, 0, 2], rank
    m = d["response_mask"].bool()
    gap = (d["old_logprobs"] - d["rollout_logprobs"]).abs()
    fresh, stale = d["policy_version"] == 2, d["policy_version"] < 2
    assert float(gap[stale.unsqueeze(1) & m].max()) > 10 * float(gap[fresh.unsqueeze(1) & m].max())
    code, rep = _diff(path)
    assert code == 0, rep["diagnosis"]
    code, rep = _diff(path, "--set", "rollout_is=none")  # control: the correction off
    assert code == 1 and not rep["quantities"]["pg_loss"]["ok"]

    a = [deterministic(r) for r in read_metrics(straight / "metrics.jsonl")]
    b = [deterministic(r) for r in read_metrics(split / "metrics.jsonl")]
    assert [r["iteration"] for r in b] == [1, 2, 3] and a == b
    assert _same_tensors(path, split / "dumps" / "iter_000003.safetensors")
    ca, cb = straight / "checkpoints" / "iter_000003", split / "checkpoints" / "iter_000003"
    for name in ("policy", "critic", "seam_stale_0", "seam_stale_1"):
        assert _same_tensors(ca / f"{name}.safetensors", cb / f"{name}.safetensors"), name
    for rank in (0, 1):
        ra = torch.load(ca / f"rng_rank{rank}.pt", weights_only=True)
        rb = torch.load(cb / f"rng_rank{rank}.pt", weights_only=True)
        assert torch.equal(ra["generator"], rb["generator"]) and ra["task"] == rb["task"], rank
        assert torch.equal(ra["torch"], rb["torch"]), rank
