"""Nothing lost, nothing mixed: `refppo train` and its output folder (issue 12, items 1–3 and 16).

* a fresh run refuses a non-empty out dir; ``--overwrite`` clears refppo's files only;
* ``--resume`` refuses a checkpoint of another run; a damaged checkpoint is one line naming the file
  (exit 2), and ``--resume-fallback`` skips it, saying which and why;
* a run ``SIGKILL``-ed in the middle of a checkpoint save or a metrics write leaves nothing that
  looks complete, and ``--resume`` continues it exactly (the kill points come from the test-only
  ``REFPPO_TEST_PAUSE_AT`` hook: deterministic, no timing);
* resuming a finished run says "nothing to do".
"""

from __future__ import annotations

import json
import os
import random
import selectors
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from refppo.train import checkpoint as ckpt
from refppo.train.cli import main as train_main
from refppo.train.rundir import read_identity
from refppo.train.runlog import deterministic, load_metrics, read_metrics
from refppo.train.tasks.presets import TEST

pytestmark = pytest.mark.e2e

TINY = (
    *(s for s in TEST if not s.startswith("run.iterations=")),
    "task.reward=rule",
    "run.checkpoint_every=1",
)
"""The test preset (less its run.iterations, which would override --iterations) with the rule reward
(no reward model to train) and a checkpoint per iteration."""


def _argv(out: Path, *extra: str) -> list[str]:
    argv = ["--out", str(out)]
    for s in TINY:
        argv += ["--set", s]
    return argv + list(extra)


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("refppo train: error:")]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-iteration run with checkpoints at 1 and 2 (copied, never changed, by the tests)."""
    out = tmp_path_factory.mktemp("base") / "run"
    assert train_main(_argv(out, "--iterations", "2")) == 0
    assert [p.name for p in ckpt.complete_checkpoints(out / "checkpoints")] == ["iter_000001", "iter_000002"]
    return out


def _copy(base: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(base, out)
    return out


# ------------------------------------------------------------------------ 1. one run per out dir


def test_fresh_run_into_a_used_out_dir_is_refused(
    base_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _copy(base_run, tmp_path)
    before = _snapshot(out)
    capsys.readouterr()
    assert train_main(_argv(out, "--iterations", "1", "--seed", "7")) == 2
    err = capsys.readouterr().err
    [line] = _error_lines(err)
    assert f"run.out_dir {str(out)!r} is not empty" in line and "--overwrite" in line and "--resume" in line
    assert _snapshot(out) == before  # nothing written, nothing deleted


def test_overwrite_replaces_the_run_and_keeps_foreign_files(
    base_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _copy(base_run, tmp_path)
    old_id = read_identity(out)
    assert old_id is not None
    (out / "notes.txt").write_text("mine")
    (out / "checkpoints" / "mine.txt").write_text("mine too")
    assert train_main(_argv(out, "--iterations", "1", "--seed", "7", "--overwrite")) == 0
    assert "--overwrite: kept 2 entries not refppo's: checkpoints, notes.txt" in capsys.readouterr().out
    new_id = read_identity(out)
    assert new_id is not None and new_id.run_id != old_id.run_id
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["iter_000001", "mine.txt"]
    assert [r["iteration"] for r in read_metrics(out / "metrics.jsonl")] == [1]
    assert json.loads((out / "config.json").read_text())["run"]["seed"] == 7
    # the new run resumes from its own checkpoint (not the old run's iter_000002)
    assert train_main(_argv(out, "--iterations", "2", "--seed", "7", "--resume")) == 0
    assert "resumed from" in capsys.readouterr().out
    assert [r["iteration"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]


def test_overwrite_never_deletes_what_is_not_a_refppo_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "someone-elses"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "model.bin").write_text("precious")
    (out / "config.json").write_text("{}")
    before = _snapshot(out)
    assert train_main(_argv(out, "--overwrite")) == 2
    [line] = _error_lines(capsys.readouterr().err)
    assert "no run.json" in line and "deletes nothing" in line
    assert _snapshot(out) == before
    assert train_main(_argv(out, "--overwrite", "--resume")) == 2  # contradictory flags
    [line] = _error_lines(capsys.readouterr().err)
    assert "--overwrite" in line and "--resume" in line


def test_resume_refuses_a_checkpoint_of_another_run(
    base_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _copy(base_run, tmp_path)
    other = tmp_path / "other"
    assert train_main(_argv(other, "--iterations", "3")) == 0  # same config, another run
    shutil.copytree(other / "checkpoints" / "iter_000003", out / "checkpoints" / "iter_000003")
    capsys.readouterr()
    assert train_main(_argv(out, "--iterations", "4", "--resume")) == 2
    [line] = _error_lines(capsys.readouterr().err)
    assert "iter_000003" in line and "belongs to another run" in line
    # a run dir without its identity cannot show that its checkpoints are one run's
    shutil.rmtree(out / "checkpoints" / "iter_000003")
    (out / "run.json").unlink()
    assert train_main(_argv(out, "--iterations", "4", "--resume")) == 2
    [line] = _error_lines(capsys.readouterr().err)
    assert "has no run.json" in line


# ----------------------------------------------------------------------- 2. damaged checkpoints

DAMAGE = {
    "truncated policy.safetensors": (
        lambda p: (p / "policy.safetensors").write_bytes((p / "policy.safetensors").read_bytes()[:100]),
        "policy.safetensors is 100 bytes, COMPLETE recorded",
    ),
    "garbage optim_policy.pt": (
        lambda p: (p / "optim_policy.pt").write_bytes(
            random.Random(0).randbytes((p / "optim_policy.pt").stat().st_size)
        ),
        "optim_policy.pt is not a readable weights-only torch file (UnpicklingError)",
    ),
    "broken state.json": (
        lambda p: (p / "state.json").write_bytes(b"#" + (p / "state.json").read_bytes()[1:]),
        "state.json is not valid JSON",
    ),
    "missing critic.safetensors": (
        lambda p: (p / "critic.safetensors").unlink(),
        "critic.safetensors is missing",
    ),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_checkpoint_is_one_line_and_fallback_is_opt_in(
    base_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    out = _copy(base_run, tmp_path)
    damage, message = DAMAGE[kind]
    damage(out / "checkpoints" / "iter_000002")
    capsys.readouterr()
    assert train_main(_argv(out, "--iterations", "3", "--resume")) == 2
    cap = capsys.readouterr()
    [line] = _error_lines(cap.err)
    assert "iter_000002" in line and message in line and "--resume-fallback" in line
    assert "weights_only" not in (cap.err + cap.out).replace("weights-only", "")
    if kind != "truncated policy.safetensors":
        return  # the fallback itself is the same for every kind of damage: checked once
    assert train_main(_argv(out, "--iterations", "3", "--resume", "--resume-fallback")) == 0
    text = capsys.readouterr().out
    assert (
        f"--resume-fallback: skipped iter_000002: checkpoint {str(out / 'checkpoints' / 'iter_000002')!r}"
        in text
    )
    assert message in text and "(iteration 1)" in text
    recs = read_metrics(out / "metrics.jsonl")
    assert [r["iteration"] for r in recs] == [1, 2, 3]
    base = [deterministic(r) for r in read_metrics(base_run / "metrics.jsonl")]
    assert [deterministic(r) for r in recs[:2]] == base  # iteration 2 redone exactly
    # the damaged checkpoint was replaced by the redone one
    assert ckpt.read_state(out / "checkpoints" / "iter_000002")["iteration"] == 2


def test_fallback_needs_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert train_main(_argv(tmp_path / "o", "--resume-fallback")) == 2
    [line] = _error_lines(capsys.readouterr().err)
    assert "--resume-fallback only applies with --resume" in line


# ------------------------------------------------------------------------- 16. nothing to do


def test_resume_at_the_target_iteration_says_nothing_to_do(
    base_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _copy(base_run, tmp_path)
    before = _snapshot(out)
    capsys.readouterr()
    assert train_main(_argv(out, "--iterations", "2", "--resume")) == 0
    text = capsys.readouterr().out
    assert "nothing to do: the checkpoint is at iteration 2 and run.iterations=2" in text
    assert "done:" not in text
    assert _snapshot(out) == before


# ------------------------------------------------------------------------- 3. kill -9 mid-write


def _run_until_paused(out: Path, point: str, *extra: str) -> None:
    """Run `refppo train` in a subprocess that stops at ``point`` (REFPPO_TEST_PAUSE_AT) and SIGKILL it
    there. Fails (never hangs: bounded by a generous guard) if the run does not reach the point."""
    env = {**os.environ, "REFPPO_TEST_PAUSE_AT": point, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "refppo", "train", *_argv(out, *extra)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    assert proc.stderr is not None
    seen: list[str] = []
    paused = False
    try:
        sel = selectors.DefaultSelector()
        sel.register(proc.stderr, selectors.EVENT_READ)
        guard = time.monotonic() + 600  # hang guard only (a paused run sleeps forever), not a timing check
        while time.monotonic() < guard and not paused:
            if not sel.select(timeout=5):
                continue
            line = proc.stderr.readline().decode(errors="replace")
            if not line:  # EOF: the run ended without reaching the point
                break
            seen.append(line)
            paused = line.strip() == f"REFPPO_TEST_PAUSED {point}"
        sel.close()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
    assert paused, f"the run never paused at {point}: {''.join(seen)[-2000:]}"
    assert proc.returncode == -signal.SIGKILL


def test_kill_during_checkpoint_save_leaves_nothing_that_looks_complete(
    base_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    _run_until_paused(out, "checkpoint:2", "--iterations", "2")
    root = out / "checkpoints"
    # killed with every file of iteration 2 written but not sealed: no iter_000002 exists at all
    staged = ckpt.staging_dir(root, 2)
    assert (staged / "policy.safetensors").is_file() and not (staged / "COMPLETE").exists()
    assert sorted(p.name for p in root.glob("iter_*")) == ["iter_000001"]
    assert all((p / "COMPLETE").is_file() for p in root.glob("iter_*"))
    assert ckpt.latest_checkpoint(root) == root / "iter_000001"
    capsys.readouterr()
    assert train_main(_argv(out, "--iterations", "2", "--resume")) == 0
    assert "(iteration 1)" in capsys.readouterr().out
    assert not staged.exists()
    # the resumed run is the uninterrupted one, metric for metric and checkpoint for checkpoint
    got = [deterministic(r) for r in read_metrics(out / "metrics.jsonl")]
    assert got == [deterministic(r) for r in read_metrics(base_run / "metrics.jsonl")]
    for name in ("policy.safetensors", "critic.safetensors", "reference.safetensors"):
        a = (root / "iter_000002" / name).read_bytes()
        assert a == (base_run / "checkpoints" / "iter_000002" / name).read_bytes(), name


def test_kill_during_a_metrics_write_leaves_a_torn_line_that_is_never_read(
    base_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    _run_until_paused(out, "metrics:2", "--iterations", "2")
    m = load_metrics(out / "metrics.jsonl")
    assert [r["iteration"] for r in m.records] == [1] and m.torn > 0  # half of record 2, no newline
    capsys.readouterr()
    assert train_main(_argv(out, "--iterations", "2", "--resume")) == 0
    assert "metrics.jsonl: dropped a torn last line" in capsys.readouterr().out
    m = load_metrics(out / "metrics.jsonl")
    assert m.torn == 0
    assert [deterministic(r) for r in m.records] == [
        deterministic(r) for r in read_metrics(base_run / "metrics.jsonl")
    ]
