"""``--detect`` on a β = 0 dump without ``ref_logprobs`` (issue #23 item 4): the walk runs (it raised
``KeyError: 'ref_logprobs'`` in its kl step), finds the generating estimator, and leaves the KL keys
open — no dumped quantity reads them.

The dump comes from the naive twins (``test_oracle_no_reference._dump``), not from the pipeline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_oracle_no_reference import HP, _dump

from refppo.dump.write import write_dump
from refppo.oracle.cli import main


def _detect(tmp_path: Path, capsys: pytest.CaptureFixture[str], kl_in: str, *sets: str) -> dict[str, Any]:
    d = {k: v for k, v in _dump(kl_in).items() if k != "kl"}  # no reference: no KL a trainer could log
    assert "ref_logprobs" not in d
    path = tmp_path / "step.safetensors"
    write_dump(path, d, hparams={**HP, "kl_in": kl_in})
    argv = [str(path), "--detect", "--json"]
    for s in sets:
        argv += ["--set", s]
    rc = main(argv)
    rep: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert rc == (0 if rep["match"] else 1)
    return rep


@pytest.mark.parametrize("kl_in", ["reward", "loss"])
def test_detect_runs_without_reference_and_finds_the_estimator(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kl_in: str
) -> None:
    """Checked as Dr. GRPO (a mismatch): the walk lists GRPO, the dump's own estimator, and only it."""
    rep = _detect(tmp_path, capsys, kl_in, "advantage=dr-grpo")
    assert rep["match"] is False
    assert rep["detected"], "nothing listed"
    assert {c["advantage"] for c in rep["detected"]} == {"grpo"}
    # the KL's estimator is read by no stage at β = 0: several stay listed, none is "the" one
    assert len({c["kl_estimator"] for c in rep["detected"]}) > 1


def test_detect_without_reference_control(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Control: checked under its own estimator the dump matches, and RLOO is never listed."""
    rep = _detect(tmp_path, capsys, "reward", "advantage=grpo")
    assert rep["match"] is True
    assert all(c["advantage"] != "rloo" for c in rep["detected"])
