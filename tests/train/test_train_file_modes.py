"""Files refppo writes honour the process umask (issue #21, item 7): a run folder (metrics.jsonl,
plot.png, config.json, run.json, every checkpoint file, the step dump and its sidecar) and
``write_dump``'s dumps get ``0o666 & ~umask``, folders ``0o777 & ~umask`` — the modes ``open(2)``
and ``mkdir(2)`` give — so another user or a CI artifact uploader can read them under umask 022,
and nobody can under 077. ``tempfile.mkstemp`` alone would make every atomically written file 0600.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from refppo.dump.write import write_dump
from refppo.train.cli import main as train_main
from refppo.train.tasks.presets import TEST


@pytest.fixture(params=[0o022, 0o077, 0o002], ids=["022", "077", "002"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield int(request.param)
    finally:
        os.umask(old)


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in sorted(root.rglob("*"))}


def _check(root: Path, umask: int) -> None:
    got = _modes(root)
    assert got, root
    want = {k: (0o777 if (root / k).is_dir() else 0o666) & ~umask for k in got}
    wrong = {k: oct(v) for k, v in got.items() if v != want[k]}
    assert wrong == {}, f"umask {umask:03o}: expected {oct(0o666 & ~umask)} for files, got {wrong}"


def test_a_train_run_honours_the_umask(tmp_path: Path, umask: int) -> None:
    out = tmp_path / "run"
    argv = ["--out", str(out)]
    for s in (*TEST, "run.plot=true", "run.dump_iteration=2", "ppo.minibatches=1"):
        argv += ["--set", s]
    assert train_main(argv) == 0
    names = {p.name for p in out.rglob("*")}
    for name in ("metrics.jsonl", "plot.png", "config.json", "run.json", "COMPLETE", "policy.safetensors"):
        assert name in names, name
    assert sorted(p.name for p in (out / "dumps").iterdir()) == [
        "iter_000002.safetensors",
        "iter_000002.safetensors.json",
    ]
    _check(out, umask)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".npz"])
def test_write_dump_honours_the_umask(tmp_path: Path, umask: int, suffix: str) -> None:
    tensors = {
        k: torch.zeros(2, 3, dtype=torch.float64) for k in ("old_logprobs", "ref_logprobs", "old_values")
    }
    tensors.update(
        response_mask=torch.ones(2, 3, dtype=torch.uint8), scores=torch.zeros(2, dtype=torch.float64)
    )
    folder = tmp_path / "dumps"
    write_dump(folder / f"step{suffix}", tensors, hparams={"kl_coef": 0.05})
    assert len(list(folder.iterdir())) == 2  # the dump and its sidecar
    _check(folder, umask)
