"""The peer validators never read a skip or a crash as a pass (rev4 STD-1).

Rule (``tools/peers/harness.py``, one for every validator of ``tools/peers``): a side venv that is
not built (no ``READY`` stamp) is a skip with the reason; a built venv whose interpreter crashes
(non-zero exit, no status file) or whose unit raised (recorded in its status file) is a failure,
exit 1, whatever another venv did; nothing run at all is exit 1. No real peer venv is needed: a
fake peers root holds a ``READY`` stamp and a ``bin/python`` that crashes, or that writes a status
saying each requested unit raised; the venv that "passes" runs refppo's own interpreter on a
trivial unit.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
from peers import VALIDATORS  # noqa: E402  (tools/ is not a package)
from peers.harness import Case, Control, Report, Unit, peers_python, run_venvs  # noqa: E402

CRASH = "#!/bin/sh\necho 'Traceback: boom in the maker' >&2\nexit 1\n"
"""A built venv's interpreter whose makers crash (non-zero exit, no status file)."""
RAISED = f"""#!/bin/sh
# argv: tools/peers --peer-side OUT: every unit of OUT/request.json raised (exit 0, status written)
exec {sys.executable} -c '
import json, sys
out = sys.argv[3]
req = json.load(open(out + "/request.json"))
st = {{u: {{"error": "ImportError: boom", "tb": ["line"]}} for u in req["units"]}}
json.dump(st, open(out + "/status.json", "w"))
' "$@"
"""
"""A built venv's interpreter whose units raised: exit 0, but the status file records the errors."""
TRIVIAL = Unit("pytest", "os.path:basename")
"""A unit refppo's own interpreter runs: ``basename(OUT)`` (JSON), version of ``pytest``."""


def _venv(root: Path, name: str, script: str | None, ready: bool = True) -> None:
    py = root / name / "bin" / "python"
    py.parent.mkdir(parents=True)
    if script is None:
        py.symlink_to(sys.executable)
    else:
        py.write_text(script)
        py.chmod(0o755)
    if ready:
        (root / name / "READY").write_text("")


def test_the_rule_a_skip_or_a_crash_is_never_a_pass(capsys: pytest.CaptureFixture[str]) -> None:
    ok = Case("u", "c", True, {"abs": 0.0}, [Control("flip", True)])
    r = Report("t")
    assert r.exit_code() == 1  # nothing ran
    r.skip("venv-a", "not built")
    assert r.exit_code() == 1  # a skip alone is not a pass
    r.add(ok)
    assert r.exit_code() == 0  # a skip next to a passing case: named, not a failure
    r.add(Case("u", "d", True, {}, [Control("flip", False)]))
    assert r.exit_code() == 1  # a control that still matches
    r2 = Report("t")
    r2.add(ok)
    r2.fail("venv-b", "crashed")
    assert r2.exit_code() == 1  # a crash, whatever passed elsewhere
    r3 = Report("t")
    r3.add(Case("u", "e", False, {"abs": 1.0}))
    assert r3.exit_code() == 1  # a mismatch
    log = capsys.readouterr().out
    assert "venv-a: SKIPPED (not built)" in log and "venv-b: FAILED (crashed)" in log, log


@pytest.mark.parametrize("script", [CRASH, RAISED], ids=["maker-exits-1", "maker-raised"])
def test_a_built_venv_whose_makers_crash_fails_even_if_another_passed(
    script: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _venv(tmp_path, "bad", script)
    _venv(tmp_path, "good", None)  # refppo's own interpreter: its unit runs and passes
    venvs = {"bad": {"bad-unit": TRIVIAL}, "good": {"good-unit": TRIVIAL}}
    report = Report("t")
    ran = []
    for unit, out, st in run_venvs(report, venvs, tmp_path, tmp_path / "work"):
        ran.append(unit)
        assert st["result"] == out.name  # os.path.basename(OUT) came back through status.json
        report.add(Case(unit, "c", True))
    log = capsys.readouterr().out
    assert ran == ["good-unit"], (ran, log)
    assert report.exit_code() == 1, log
    assert ("bad" if script == CRASH else "bad-unit") in report.failed, report.failed
    assert "FAILED (" in log and "SKIPPED" not in log, log
    assert report.versions["good-unit"].startswith("pytest "), report.versions


def test_a_venv_without_ready_is_a_skip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _venv(tmp_path, "half", None, ready=False)  # interpreter present, no READY stamp: not built
    assert peers_python("half", tmp_path) is None
    report = Report("t")
    assert list(run_venvs(report, {"half": {"u": TRIVIAL}}, tmp_path, tmp_path / "work")) == []
    log = capsys.readouterr().out
    assert "half: SKIPPED (no side venv" in log and "READY" in log, log
    assert report.exit_code() == 1  # nothing ran


def test_the_root_is_read_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _venv(tmp_path, "v", None)
    monkeypatch.setenv("REFPPO_PEERS_ROOT", str(tmp_path))
    assert peers_python("v") == tmp_path / "v" / "bin" / "python"
    monkeypatch.setenv("REFPPO_PEERS_ROOT", str(tmp_path / "empty"))
    assert peers_python("v") is None


@pytest.mark.parametrize("name", sorted(VALIDATORS))
def test_every_validator_with_no_venv_skips_each_and_exits_1(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib

    monkeypatch.setenv("REFPPO_PEERS_ROOT", str(tmp_path))  # an empty root: no venv built
    monkeypatch.chdir(tmp_path)
    main = importlib.import_module(VALIDATORS[name]).main
    rc = main([])
    log = capsys.readouterr().out
    assert rc == 1, log  # nothing ran: never a pass
    assert "SKIPPED (no side venv" in log and "FAILED" not in log and "no case ran" in log, log


@pytest.mark.parametrize("script", [CRASH, RAISED], ids=["maker-exits-1", "maker-raised"])
@pytest.mark.parametrize("name", sorted(VALIDATORS))
def test_every_validator_with_crashing_venvs_fails(
    name: str,
    script: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import importlib

    for venv in ("verl-openrlhf", "skyrl-areal", "trl", "trl-grpo", "oat", "skyrl04", "torchtune", "trinity"):
        _venv(tmp_path, venv, script)
    monkeypatch.setenv("REFPPO_PEERS_ROOT", str(tmp_path))
    main = importlib.import_module(VALIDATORS[name]).main
    rc = main(["--json-out", os.devnull])
    log = capsys.readouterr().out
    assert rc == 1, log
    assert "FAILED (" in log and "SKIPPED" not in log, log
