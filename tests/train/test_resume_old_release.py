"""``refppo train --resume`` of run directories written by the REAL older releases.

``tests/train/fixtures/old_runs/<REV>/run/`` is a one-iteration run written by release ``REV``'s own code
(``git archive REV refppo``, its ``test`` preset with ``task.reward=rule``; made by
``tools/make_old_run_fixture.py``, never by the tests). Every checkpoint file is the release's:
weights, optimizer states, RNG states, ``state.json``, ``COMPLETE``, ``run.json``, ``config.json``,
``metrics.jsonl``. ``expected.json`` holds what the release computed when it continued its own run
to iteration 2 (uninterrupted; its own resume gave the same, checked by the script): the
iteration-2 metrics (without ``time/`` keys) and a checksum of each model's iteration-2 weights.

Today's refppo resumes a copy with the release's command line for one more iteration: exit 0, the
config keys added since are named as accepted at their defaults, the metrics continue at
iteration 2 after the release's own iteration 1, the run keeps its identity, and iteration 2 is
BIT-IDENTICAL to the release's (same torch pin, CPU kernels pinned as under every test by
``tests/conftest.py``, one thread: the update math has not changed between these releases and
today). A release that changes the math on purpose must regenerate nothing here: it states the
new tolerance in this test, since the release's numbers are the reference.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from refppo.train.cli import main as train_main
from refppo.train.runlog import deterministic, read_metrics

pytestmark = pytest.mark.e2e

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "old_runs"
ABSENT = {
    "648bff8": {
        "rollout.group_size",
        "ppo.group_std_level",
        "ppo.score_bias",
        "ppo.score_scale",
        "ppo.score_clip",
    },
    "61be225": {"ppo.group_std_level", "ppo.score_bias", "ppo.score_scale", "ppo.score_clip"},
}
"""The keys each release's saved config lacks, measured: 648bff8's five were found by the reviewer
who resumed a run of that release (finding TEST-1); 61be225's four are CHANGELOG.md's ("61be225:
four keys") and its pinned key list in ``test_resume_compat.py``."""


def weights_sha256(path: Path) -> str:
    """SHA-256 over the tensors in name order, each as ``name|dtype|shape|`` then its raw bytes (the
    formula of ``tools/make_old_run_fixture.py``'s docstring, restated here)."""
    h = hashlib.sha256()
    tensors = load_file(path)
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _resume(rev: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, dict[str, Any], str]:
    expected = json.loads((FIXTURES / rev / "expected.json").read_text())
    out = tmp_path / "run"
    shutil.copytree(FIXTURES / rev / "run", out)
    argv = ["--out", str(out), "--iterations", "2", "--resume"]
    for s in expected["overrides"]:  # the release's `test` preset + task.reward=rule, as its user typed them
        argv += ["--set", s]
    assert train_main(argv) == 0
    return out, expected, capsys.readouterr().out


@pytest.mark.parametrize("rev", sorted(ABSENT))
def test_a_real_older_release_run_resumes_to_what_that_release_computed(
    rev: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = json.loads((FIXTURES / rev / "run" / "run.json").read_text())
    first = (FIXTURES / rev / "run" / "metrics.jsonl").read_text().splitlines()
    out, expected, printed = _resume(rev, tmp_path, capsys)
    assert expected["commit"].startswith(rev) and expected["fixture_iterations"] == 1

    assert f"resumed from {out / 'checkpoints' / 'iter_000001'} (iteration 1)" in printed
    said = [ln for ln in printed.splitlines() if "older refppo" in ln]
    assert len(said) == 1, f"the absent keys are not named in one line: {printed!r}"
    line = said[0]
    head, _, names = line.partition("accepted at their defaults: ")
    assert (
        head == f"--resume: checkpoint written by an older refppo without {len(ABSENT[rev])} config key(s), "
    )
    assert set(names.split(", ")) == ABSENT[rev]

    # the metrics continue: the release's own iteration 1 kept as written, then iteration 2
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert lines[0] == first[0] and len(first) == 1
    records = read_metrics(out / "metrics.jsonl")
    assert [r["iteration"] for r in records] == [1, 2]

    # iteration 2 is the release's own iteration 2, bit for bit
    want = expected["iteration_2"]["metrics"]
    got = deterministic(records[1])
    assert sorted(k for k in want if k not in got) == []  # no metric of the release lost
    assert {k: got[k] for k in want} == want
    ckpt = out / "checkpoints" / "iter_000002"
    for model, sha in expected["iteration_2"]["weights_sha256"].items():
        assert weights_sha256(ckpt / f"{model}.safetensors") == sha, model

    # the run keeps its identity: the checkpoint written after the resume carries the release's hash
    state = json.loads((ckpt / "state.json").read_text())
    assert json.loads((out / "run.json").read_text()) == run_id
    assert state["run_id"] == run_id["run_id"] and state["config_hash"] == run_id["config_hash"]
    assert not any(k.split(".")[1] in state["config"].get(k.split(".")[0], {}) for k in ABSENT[rev])
