"""Resume under ``torchrun`` with the seam mode on (issue #22 item 5, "resume is exact, torchrun
works"): 2 gloo processes, a bfloat16 engine two iterations stale (its snapshots checkpointed) and
token TIS; 4 iterations straight == 2, stop, ``--resume``, 2 — bit for bit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

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
WORKER_TIMEOUT_S = 1200
"""Hang guard for torchrun (not a speed assertion), as tests/train/test_ddp.py."""


def _torchrun(tmp_path: Path, out: Path, iterations: int, *extra: str) -> None:
    """``torchrun --standalone --nproc-per-node 2 -m refppo train`` (gloo, CPU) in its own session;
    a timeout kills the agent and its workers."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    argv += ["-m", "refppo", "train", "--out", str(out), *extra]
    for s in (*TEST, *SEAM, f"run.iterations={iterations}"):
        argv += ["--set", s]
    log = tmp_path / f"{out.name}-{iterations}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            argv, cwd=Path(__file__).parents[2], stdout=fh, stderr=subprocess.STDOUT,
            start_new_session=True, env=env,
        )  # fmt: skip
    try:
        proc.wait(timeout=WORKER_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, (
        f"torchrun: exit {proc.returncode}\n" + log.read_text(errors="replace")[-6000:]
    )


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
