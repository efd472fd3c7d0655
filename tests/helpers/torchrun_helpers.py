"""Launching ``torchrun`` from a test: shared by the tests that run ``refppo train`` on 2 gloo processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKER_TIMEOUT_S = 1200
"""Hang guard for torchrun (not a speed assertion)."""


def torchrun_train(
    log: Path, *args: str, nproc: int = 2, timeout: float = WORKER_TIMEOUT_S, err: Path | None = None
) -> None:
    """``torchrun --standalone --nproc-per-node NPROC -m refppo train ARGS`` (CPU, one intra-op thread)
    in its own session, output to ``log`` (stderr to ``err`` when given); a timeout kills the agent
    AND its workers; a non-zero exit fails the test with the logs' tails."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    argv += ["-m", "refppo", "train", *args]
    with log.open("wb") as fh, contextlib.ExitStack() as stack:
        fe = subprocess.STDOUT if err is None else stack.enter_context(err.open("wb"))
        proc = subprocess.Popen(
            argv, cwd=REPO, stdout=fh, stderr=fe,
            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    tails = [p.read_text(errors="replace")[-6000:] for p in (log, *([err] if err else []))]
    assert proc.returncode == 0, f"torchrun: exit {proc.returncode}\n" + "\n".join(tails)
