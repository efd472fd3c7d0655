"""The peer validators never read a skip or a crash as a pass (rev4 STD-1).

Rule (tools/validate_grpo_peers.py, tools/validate_detect.py, tools/validate_kl_straight_through.py,
tools/validate_presets.py):
a side venv that is not built (no ``READY`` stamp) is a skip with the reason; a built venv whose
makers crash (non-zero exit, or a maker recorded as raised in its status file) is a failure, exit
1, whatever another venv did; nothing run at all is exit 1 (or 2 with one line). No real peer venv
is needed: a fake peers root holds a ``READY`` stamp and a ``bin/python`` shell script that crashes
(or writes a status file saying its maker raised), and the venv that "passed" is a stand-in.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import validate_detect  # noqa: E402  (tools/ is not a package)
import validate_grpo_peers  # noqa: E402
import validate_presets  # noqa: E402

CRASH = "#!/bin/sh\necho 'Traceback: boom in the maker' >&2\nexit 1\n"
"""A built venv's interpreter whose makers crash (non-zero exit, no status file)."""
RAISED = """#!/bin/sh
# argv: SCRIPT --make OUT [--venv V | --group G]; write OUT/status-NAME.json saying the maker raised
case "$1" in *validate_grpo_peers.py) name="$5";; *) name=fake-peer;; esac
[ "$2" = "--make" ] || exit 0
printf '{"%s": {"skipped": "ImportError: boom", "tb": []}}' "$name" > "$3/status-$name.json"
"""
"""A built venv's interpreter whose maker raised: exit 0, but the status file records the error."""


def _venv(root: Path, name: str, script: str, ready: bool = True) -> None:
    py = root / name / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(script)
    py.chmod(0o755)
    if ready:
        (root / name / "READY").write_text("")


def _passing_elsewhere(real: Any, crashing: str) -> Any:
    """``run_venv`` that runs the real one for ``crashing`` and a passing case for any other venv."""

    def run_venv(venv: str, py: Path, out: Path, only: str | None, *rest: Any) -> dict[str, Any]:
        if venv == crashing:
            return dict(real(venv, py, out, only, *rest))
        return {"cases": {f"{venv}_ok": {"ok": True, "verdict": "MATCH", "max_abs_err": 0.0}}}

    return run_venv


@pytest.mark.parametrize("script", [CRASH, RAISED], ids=["maker-exits-1", "maker-raised"])
def test_grpo_peers_a_built_venv_whose_makers_crash_fails_even_if_another_passed(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _venv(tmp_path, "trl", script)
    _venv(tmp_path, "skyrl-areal", CRASH)  # built; its stand-in run_venv passes
    monkeypatch.setattr(
        validate_grpo_peers, "run_venv", _passing_elsewhere(validate_grpo_peers.run_venv, "trl")
    )
    out = tmp_path / "res.json"
    rc = validate_grpo_peers.validate(["trl", "skyrl-areal"], tmp_path, None, None, out)
    log = capsys.readouterr().out
    assert rc == 1, log
    res = json.loads(out.read_text())
    assert "failed" in res["trl"] and "skipped" not in res["trl"], res["trl"]
    assert "trl: FAILED (" in log, log
    assert res["skyrl-areal"]["cases"], res  # the other venv did run and pass


def test_grpo_peers_a_venv_without_ready_is_a_skip_and_nothing_run_is_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _venv(tmp_path, "trl", CRASH, ready=False)  # interpreter present, no READY stamp: not built
    rc = validate_grpo_peers.validate(["trl"], tmp_path, None, None, None)
    log = capsys.readouterr().out
    assert rc == 1, log  # nothing ran: never a pass
    assert "trl: SKIPPED (no side venv" in log and "READY" in log, log


@pytest.mark.parametrize("script", [CRASH, RAISED], ids=["maker-exits-1", "maker-raised"])
def test_detect_a_built_group_whose_makers_crash_fails_even_if_other_cases_pass(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "peers"
    _venv(root, "skyrl-areal", script)
    monkeypatch.delenv("REFPPO_PEERS_PYTHON", raising=False)
    # the cases that did run (another group's) all pass
    monkeypatch.setattr(validate_detect, "validate", lambda *a, **k: {"other_case": {"verdict": "found"}})
    argv = ["validate_detect.py", "--group", "skyrl-areal", "--peers-root", str(root)]
    monkeypatch.setattr(sys, "argv", argv)
    rc = validate_detect.main()
    log = capsys.readouterr().out
    assert rc == 1, log
    assert "FAILED (" in log and "SKIPPED" not in log, log


def test_detect_a_group_without_ready_is_a_skip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "peers"
    _venv(root, "skyrl-areal", CRASH, ready=False)
    monkeypatch.delenv("REFPPO_PEERS_PYTHON", raising=False)
    monkeypatch.setattr(validate_detect, "validate", lambda *a, **k: {"other_case": {"verdict": "found"}})
    monkeypatch.setattr(
        sys, "argv", ["validate_detect.py", "--group", "skyrl-areal", "--peers-root", str(root)]
    )
    rc = validate_detect.main()
    log = capsys.readouterr().out
    assert rc == 0, log  # the skipped group is named; the cases that ran passed
    assert "skyrl-areal: SKIPPED (no side venv" in log and "FAILED" not in log, log


def test_kl_straight_through_without_an_interpreter_exits_2_with_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-venv" / "bin" / "python"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "validate_kl_straight_through.py"),
            "--peers-python",
            str(missing),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(missing) in lines[0], proc.stderr
    assert "SKIPPED" not in proc.stdout, proc.stdout


def _presets_with_a_passing_group(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, script: str, ready: bool = True
) -> None:
    """Group ``fake`` (maker ``fake-peer``) runs ``script``; group ``good``'s stand-in passes."""
    monkeypatch.delenv("REFPPO_PEERS_PYTHON", raising=False)
    monkeypatch.setattr(validate_presets, "GROUPS", {"fake": ("fake-peer",), "good": ("good-peer",)})
    _venv(tmp_path, "fake", script, ready=ready)
    _venv(tmp_path, "good", CRASH)  # built; its stand-in run_group passes
    real = validate_presets.run_group
    ok = {"name": "c", "ok": True, "max_abs_err": 0.0, "quantities": {}, "command": "refppo diff c"}

    def run_group(group: str, py: Path, out: Path) -> dict[str, Any]:
        return real(group, py, out) if group == "fake" else {"good-peer": {"cases": [ok]}}

    monkeypatch.setattr(validate_presets, "run_group", run_group)


@pytest.mark.parametrize("script", [CRASH, RAISED], ids=["maker-exits-1", "maker-raised"])
def test_presets_a_built_venv_whose_makers_crash_fails_even_if_another_passed(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _presets_with_a_passing_group(monkeypatch, tmp_path, script)
    out = tmp_path / "res.json"
    rc = validate_presets.validate(["fake", "good"], tmp_path, None, False, out)
    log = capsys.readouterr().out
    assert rc == 1, log
    res = json.loads(out.read_text())
    assert "failed" in res["fake-peer"] and "skipped" not in res["fake-peer"], res
    assert "fake-peer: FAILED (" in log and "SKIPPED" not in log, log
    assert res["good-peer"]["cases"], res  # the other venv did run and pass


def test_presets_a_venv_without_ready_is_a_skip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _presets_with_a_passing_group(monkeypatch, tmp_path, CRASH, ready=False)
    rc = validate_presets.validate(["fake", "good"], tmp_path, None, False, None)
    log = capsys.readouterr().out
    assert rc == 0, log  # the skipped venv is named; the cases that ran passed
    assert "fake-peer: SKIPPED (no side venv" in log and "FAILED" not in log, log
    assert validate_presets.validate(["fake"], tmp_path, None, False, None) == 1  # nothing ran
