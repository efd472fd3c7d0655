"""End-to-end tests of ``refppo verify`` (refppo/verify/)."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from refppo.verify.cases import CASES
from refppo.verify.cli import main

pytestmark = pytest.mark.e2e

STEPS = list(CASES)


def _rows(out: str) -> dict[tuple[str, str, str], str]:
    """(step, device, dtype) -> result cell, parsed from the printed table."""
    rows = {}
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) >= 7 and cells[0] in STEPS:
            rows[(cells[0], cells[1], cells[2])] = cells[6]
    return rows


def test_verify_cli_passes_and_prints_the_table() -> None:
    # Through the real entry point (`refppo verify` = refppo.cli -> refppo.verify.cli.main).
    proc = subprocess.run(
        [sys.executable, "-m", "refppo.cli", "verify", "--seeds", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    header = proc.stdout.splitlines()[0].split()
    assert header[:3] == ["step", "device", "dtype"] and "tolerance" in header and "result" in header
    # the tolerance column is explained under the table (issue #21): the rule and the scale S
    assert "|vectorized − naive| ≤ atol·S + rtol·|naive|" in proc.stdout
    assert "S = max(1, max |naive|)" in proc.stdout
    rows = _rows(proc.stdout)
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    for step in STEPS:
        for device in devices:
            for dtype in ("float64", "float32"):
                assert rows.get((step, device, dtype)) == "PASS", (step, device, dtype, proc.stdout)


def _broken(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrong(*args: Any, **kwargs: Any) -> Any:
        adv, ret = fn(*args, **kwargs)
        return adv * 1.001, ret  # a 0.1 % error in the advantages

    return wrong


def test_verify_fails_when_a_vectorized_step_is_broken(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    gae_module = importlib.import_module("refppo.core.gae")
    monkeypatch.setattr(gae_module, "gae", _broken(gae_module.gae))
    assert main(["--seeds", "2", "--device", "cpu"]) != 0
    rows = _rows(capsys.readouterr().out)
    assert rows[("gae", "cpu", "float64")].startswith("FAIL")
    assert rows[("gae", "cpu", "float32")].startswith("FAIL")
    # Only the broken step fails.
    assert all(v == "PASS" for (step, _, _), v in rows.items() if step != "gae")


def test_verify_reports_a_crashing_step_as_failure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    kl_module = importlib.import_module("refppo.core.kl")

    def crash(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(kl_module, "token_kl", crash)
    assert main(["--seeds", "1", "--device", "cpu"]) == 1
    rows = _rows(capsys.readouterr().out)
    assert (
        rows[("token_kl", "cpu", "float64")].startswith("FAIL")
        and "boom" in rows[("token_kl", "cpu", "float64")]
    )


@pytest.mark.gpu
def test_verify_passes_on_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--seeds", "2", "--device", "cuda"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows and all(v == "PASS" for v in rows.values())


@pytest.mark.parametrize("name", ["cuda", "cuda:7", "xpu", "nonsense"])
def test_verify_unusable_device_is_one_line_and_exit_2(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """#12 item 8: without CUDA, ``--device cuda`` used to print 30 FAIL rows; now one line, exit 2."""
    usable = {"cuda": torch.cuda.is_available(), "cuda:7": torch.cuda.device_count() > 7}
    if usable.get(name, False):
        pytest.skip(f"{name} is usable on this machine; its refusal cannot be observed here")
    assert main(["--seeds", "1", "--device", "cpu", "--device", name]) == 2
    out, err = capsys.readouterr()
    assert out == "", "no table is printed for an unusable device"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("refppo verify: --device "), err
    assert repr(name) in lines[0]
