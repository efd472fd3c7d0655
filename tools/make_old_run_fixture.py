"""Write the run directories of older refppo releases under tests/train/fixtures/old_runs/ (never run by the
tests).

Usage:
``python tools/make_old_run_fixture.py [--rev 648bff8 --rev 61be225] [--out tests/train/fixtures/old_runs]``
(run from the repository root with the project's venv; needs git and the release commits).

For each release ``REV``: ``git archive REV refppo`` is unpacked in a temporary folder and THAT code
(``PYTHONPATH`` = the unpacked folder; this venv's torch, numpy, safetensors) runs, in child
processes with the CPU kernels pinned (:data:`refppo.cpu_numerics.PINNED_CPU_ENV`, as under the
tests), the release's own ``test`` preset with ``task.reward=rule`` (no reward model: the smallest
run):

1. ``run.iterations=1``: the run directory stored as ``<out>/<REV>/run/`` (the fixture);
2. ``run.iterations=2`` uninterrupted: its iteration-2 metrics record (without the wall-clock
   ``time/`` keys) and a checksum of each model of its iteration-2 checkpoint;
3. a copy of (1) resumed by the same release to iteration 2, which must give (2) exactly (else this
   script stops: the release could not continue its own run, and (2) would prove nothing).

``<out>/<REV>/expected.json`` holds the release's commit, the ``--set`` overrides of the run (the
release's ``TEST`` preset + ``task.reward=rule``, so the test resumes with the command line the
release's user would have typed), the versions used, the machine's kernel path under the pin
(:func:`refppo.cpu_numerics.kernel_path`, read in a pinned child: the test is bit-exact only where
it is the same) and (2), with each model's parameter checksums ``[Σp, Σp², Σ|p|]`` (float64, as the
golden trajectories') for a comparison within tolerances elsewhere. The checksum of a model
(:func:`weights_sha256`) is SHA-256 over its tensors in name order: name, dtype, shape, raw bytes;
``tests/train/test_resume_old_release.py`` states the same formula independently.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

REVS = ("648bff8", "61be225")
"""The releases whose runs are stored: 648bff8 (2026-11-30 20:10 UTC) and its descendant 61be225
(21:02 UTC, the release that CHANGELOG.md calls the previous one)."""
EXTRA = ("task.reward=rule",)
"""Overrides on top of each release's ``test`` preset."""
MODELS = ("policy", "critic", "reference")
"""The models of a ``task.reward=rule`` checkpoint (no reward model)."""
PINNED_CPU_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}
"""Restated from refppo.cpu_numerics (this script must not import today's refppo into the children)."""

CHILD = """
import json, sys
import refppo
from refppo.tasks.presets import TEST, preset  # the release's layout, not today's
from refppo.trainer import Trainer
src, out, iterations, resume = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "resume"
assert refppo.__file__.startswith(src), (refppo.__file__, src)  # the release's code, not today's
extra = json.loads(sys.argv[5])
cfg = preset("test", *extra, f"run.iterations={iterations}", f"run.out_dir={out}")
Trainer(cfg, resume=resume).train()
print(json.dumps([*TEST, *extra]))
"""


def weights_sha256(path: Path) -> str:
    """SHA-256 over the tensors of the safetensors file ``path`` in name order: for each, the name,
    the dtype, the shape and the raw bytes (independent of the file's header layout)."""
    import torch
    from safetensors.torch import load_file

    h = hashlib.sha256()
    tensors = load_file(path)
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _unpack(rev: str, dest: Path) -> str:
    """``git archive REV refppo`` into ``dest``; returns the full commit hash."""
    commit = subprocess.run(
        ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], check=True, capture_output=True, text=True
    ).stdout.strip()
    archive = dest / "src.tar"
    with archive.open("wb") as f:
        subprocess.run(["git", "archive", commit, "refppo"], check=True, stdout=f)
    with tarfile.open(archive) as tar:
        tar.extractall(dest / "src", filter="data")
    archive.unlink()
    return commit


def _run(src: Path, out: Path, iterations: int, resume: bool) -> list[str]:
    env = {**os.environ, **PINNED_CPU_ENV, "PYTHONPATH": str(src)}
    mode = "resume" if resume else "fresh"
    argv = [sys.executable, "-c", CHILD, str(src), str(out), str(iterations), mode, json.dumps(EXTRA)]
    done = subprocess.run(argv, env=env, cwd=src, check=True, capture_output=True, text=True)
    sets: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return sets


def weights_checksums(path: Path) -> dict[str, list[float]]:
    """``{tensor name: [Σp, Σp², Σ|p|]}`` in float64 (the golden trajectories' parameter checksums)."""
    import torch
    from safetensors.torch import load_file

    out = {}
    for name, t in sorted(load_file(path).items()):
        p = t.to(torch.float64)
        out[name] = [float(p.sum()), float((p * p).sum()), float(p.abs().sum())]
    return out


def kernel_path() -> dict[str, str]:
    """:func:`refppo.cpu_numerics.kernel_path` of this machine, in a child with the pin applied
    (today's ``refppo.cpu_numerics``: it imports no other part of refppo)."""
    code = "import json; from refppo.cpu_numerics import kernel_path; print(json.dumps(kernel_path()))"
    env = {**os.environ, **PINNED_CPU_ENV, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    path: dict[str, str] = json.loads(done.stdout)
    return path


def _iteration(out: Path, iteration: int) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
    """The metrics record of ``iteration`` without ``time/`` keys, each model's SHA-256 and its
    parameter checksums."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    [rec] = [r for r in records if r["iteration"] == iteration]
    metrics = {k: v for k, v in rec.items() if not k.startswith("time/")}
    ckpt = out / "checkpoints" / f"iter_{iteration:06d}"
    sha = {m: weights_sha256(ckpt / f"{m}.safetensors") for m in MODELS}
    return metrics, sha, {m: weights_checksums(ckpt / f"{m}.safetensors") for m in MODELS}


def make(rev: str, out_root: Path) -> Path:
    """Write ``<out_root>/<rev>/{run/, expected.json}``; returns that folder."""
    import torch

    with tempfile.TemporaryDirectory(prefix="oldrun-") as tmp:
        work = Path(tmp)
        commit = _unpack(rev, work)
        src = work / "src"
        sets = _run(src, work / "one", 1, resume=False)
        _run(src, work / "two", 2, resume=False)
        shutil.copytree(work / "one", work / "own_resume")
        _run(src, work / "own_resume", 2, resume=True)
        straight = _iteration(work / "two", 2)
        if _iteration(work / "own_resume", 2) != straight:
            raise SystemExit(f"{rev}: the release's own resume differs from its uninterrupted run")
        dest = out_root / rev
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(work / "one", dest / "run")
    expected = {
        "release": rev,
        "commit": commit,
        "made_with": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpu_env": PINNED_CPU_ENV,
            "kernel_path": kernel_path(),
        },
        "overrides": sets,
        "fixture_iterations": 1,
        "iteration_2": {
            "metrics": straight[0],
            "weights_sha256": straight[1],
            "weights_checksums": straight[2],
        },
        "own_resume_equals_uninterrupted": True,
    }
    (dest / "expected.json").write_text(json.dumps(expected, indent=2, sort_keys=True) + "\n")
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", action="append", default=None, help=f"release commit (default: {REVS})")
    ap.add_argument("--out", default=os.path.join("tests", "train", "fixtures", "old_runs"))
    args = ap.parse_args(argv)
    for rev in args.rev or REVS:
        dest = make(rev, Path(args.out))
        size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
        print(f"{rev}: {dest} ({size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
