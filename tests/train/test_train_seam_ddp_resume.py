"""Resume under ``torchrun`` with the seam mode on (issue #22 item 5, "resume is exact, torchrun
works"): 2 gloo processes, a bfloat16 engine two iterations stale (its snapshots checkpointed) and
token TIS; 4 iterations straight == 2, stop, ``--resume``, 2 — bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torchrun_helpers import torchrun_train

from refppo.train.runlog import deterministic, read_metrics
from refppo.train.tasks.presets import TEST

pytestmark = pytest.mark.e2e

SEAM = (
    "task.reward=rule",
    "task.sft_steps=3",
    "run.checkpoint_every=1",
    "seam.enabled=true",
    "seam.staleness=2",
    "ppo.rollout_is=token",
    "ppo.rollout_is_high=2",
)
"""TEST preset (8 rollouts, 2 epochs, 2 micro-batches) with the seam: k = 2, bfloat16, token TIS cap 2."""


def _torchrun(tmp_path: Path, out: Path, iterations: int, *extra: str) -> None:
    """``torchrun`` (2 gloo processes) ``refppo train --out OUT EXTRA`` with :data:`SEAM`."""
    args = ["--out", str(out), *extra]
    for s in (*TEST, *SEAM, f"run.iterations={iterations}"):
        args += ["--set", s]
    torchrun_train(tmp_path / f"{out.name}-{iterations}.log", *args)


def _same_weights(a: Path, b: Path) -> bool:
    wa, wb = load_file(a), load_file(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_torchrun_resume_with_the_seam_on_is_exact(tmp_path: Path) -> None:
    """Every metric of every iteration, the final policy, critic and the two engine snapshots and
    each rank's RNG state are those of the uninterrupted run; the checkpoint of iteration 2 holds the
    snapshot versions [0, 1] and those of iteration 4 the policy after iterations 2 and 3."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    _torchrun(tmp_path, straight, 4)
    _torchrun(tmp_path, split, 2)
    state2 = json.loads((split / "checkpoints" / "iter_000002" / "state.json").read_text())
    assert state2["seam"] == {"versions": [0, 1]} and state2["world_size"] == 2
    _torchrun(tmp_path, split, 4, "--resume")
    a = [deterministic(r) for r in read_metrics(straight / "metrics.jsonl")]
    b = [deterministic(r) for r in read_metrics(split / "metrics.jsonl")]
    assert [r["iteration"] for r in b] == [1, 2, 3, 4]
    assert [r["rollout/seam_staleness"] for r in a] == [0.0, 1.0, 2.0, 2.0]
    assert min(float(r["rollout/seam_abs_log_ratio"]) for r in a[1:]) > 1e-3  # off-policy rows
    assert a == b
    ca, cb = straight / "checkpoints" / "iter_000004", split / "checkpoints" / "iter_000004"
    for name in ("policy", "critic", "seam_stale_0", "seam_stale_1"):
        assert _same_weights(ca / f"{name}.safetensors", cb / f"{name}.safetensors"), name
    for rank in (0, 1):
        ra = torch.load(ca / f"rng_rank{rank}.pt", weights_only=True)
        rb = torch.load(cb / f"rng_rank{rank}.pt", weights_only=True)
        assert torch.equal(ra["generator"], rb["generator"]) and ra["task"] == rb["task"], rank
        assert torch.equal(ra["torch"], rb["torch"]), rank
    for j, n in ((0, 2), (1, 3)):
        snap = ca / f"seam_stale_{j}.safetensors"
        assert _same_weights(snap, straight / "checkpoints" / f"iter_{n:06d}" / "policy.safetensors"), (j, n)
