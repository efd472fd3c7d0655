"""The real command, as a user runs it: ``python tools/diff_against.py`` and ``python -m refppo diff``."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from oracle_helpers import make_inputs, naive_dump, save, setup_for

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "diff_against.py"
HANG_GUARD_S = 900
"""Only a guard against a hang, not a speed check: on a loaded 2-core machine starting the
interpreter alone took 87 s (measured 2026-11-30 at load 15), so 120 s was a flake risk."""


def _run(*args: str, module: bool = False) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "refppo", "diff", *args] if module else [sys.executable, str(TOOL), *args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=HANG_GUARD_S)


@pytest.fixture(scope="module")
def trl_dump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("trl")
    s = setup_for("trl")
    return save(tmp, naive_dump(make_inputs(seed=7), s, dtype=torch.float32), s)


def test_match_exit_0_and_json_schema(trl_dump: Path) -> None:
    p = _run(str(trl_dump), "--preset", "trl", "--json")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["match"] is True and rep["first_divergence"] is None
    assert set(rep) >= {"match", "first_divergence", "quantities", "convention", "diagnosis"}
    q = rep["quantities"]["advantages"]
    assert set(q) == {"max_abs_err", "max_rel_err", "tol", "ok"} and q["ok"] is True
    assert rep["convention"]["score_at"] == "after_last_valid"


def test_mismatch_exit_1_names_first_divergence(trl_dump: Path) -> None:
    p = _run(str(trl_dump), "--preset", "verl", "--set", "gamma=0.99", "--set", "lam=0.9", module=True)
    assert p.returncode == 1, p.stderr
    assert "MISMATCH: first divergence at token_rewards." in p.stdout
    # TRL's score slot explains token_rewards; its approx_kl (k2 over all positions) still differs
    moved = "score_at=after_last_valid (as in preset trl, deepspeed-chat)"
    assert f"{moved} explains token_rewards only" in p.stdout
    assert "approx_kl still differs" in p.stdout


def test_detect_json(trl_dump: Path) -> None:
    p = _run(
        str(trl_dump), "--preset", "verl", "--set", "gamma=0.99", "--set", "lam=0.9", "--detect", "--json"
    )
    assert p.returncode == 1, p.stderr  # the convention named (verl) mismatches: a CI gate fails ...
    rep = json.loads(p.stdout)
    assert rep["match"] is False
    assert rep["detected"] and all(
        c["score_at"] == "after_last_valid" for c in rep["detected"]
    )  # ... even though TRL's convention reproduces the dump
    assert rep["detected_count"] >= len(rep["detected"]) == len(rep["detected_changes"])
    for full, ch in zip(rep["detected"], rep["detected_changes"], strict=True):
        assert ch == {k: v for k, v in full.items() if v != rep["convention"].get(k)}
        assert ch["score_at"] == "after_last_valid"


def test_detect_exit_code_follows_the_named_convention(trl_dump: Path) -> None:
    """With --detect the exit code is still the checked convention's verdict (0 only on its match)."""
    ok = _run(str(trl_dump), "--preset", "trl", "--detect")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = _run(str(trl_dump), "--preset", "trl", "--set", "score_at=last_valid", "--detect")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    out = bad.stdout
    head = next(line for line in out.splitlines() if line.startswith("detect: "))
    n = int(head.split()[1])
    shown = [line for line in out.splitlines() if line.startswith("  * ")]
    assert f"{n} convention(s) reproduce the dump; showing {len(shown)}" in head
    assert 0 < len(shown) <= 10 and n >= len(shown)
    # only the keys that differ from the checked convention are printed
    assert all("score_at=after_last_valid" in line for line in shown)
    assert not any("kl_estimator=" in line or "whiten_variance=" in line for line in shown)


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        ("missing", "missing required keys"),
        ("unknown_type", "unknown file type"),
        ("bad_set", "expected KEY=VALUE"),
    ],
)
def test_bad_input_exit_2_one_line(tmp_path: Path, trl_dump: Path, make: str, needle: str) -> None:
    if make == "missing":
        d = naive_dump(make_inputs(), setup_for())
        d.pop("scores")
        args = [str(save(tmp_path, d))]
    elif make == "unknown_type":
        (tmp_path / "x.csv").write_text("1,2")
        args = [str(tmp_path / "x.csv")]
    else:
        args = [str(trl_dump), "--set", "score_at"]
    p = _run(*args)
    assert p.returncode == 2
    assert needle in p.stderr
    assert "Traceback" not in p.stderr and p.stderr.strip().count("\n") == 0
    assert p.stdout == ""


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    evil = tmp_path / "evil.pt"
    torch.save({"response_mask": _Evil(str(marker))}, evil)
    raw = tmp_path / "raw.pt"
    raw.write_bytes(pickle.dumps({"response_mask": _Evil(str(marker))}))
    for path in (evil, raw):
        p = _run(str(path))
        assert p.returncode == 2
        assert "refused" in p.stderr and "Traceback" not in p.stderr
    assert not marker.exists()


def test_preset_keeps_the_runs_kl_estimator_and_names_replaced_sidecar_conventions(tmp_path: Path) -> None:
    """A TRL run with kl_estimator=k3 (a TRL setting) matches `--preset trl` without `--set`; a sidecar
    convention that the preset replaces is named in the diagnosis, not dropped silently."""
    s = setup_for("trl", conv={"kl_estimator": "k3"})
    path = save(tmp_path, naive_dump(make_inputs(seed=8), s, dtype=torch.float32), s)
    sidecar = path.with_name(path.name + ".json")
    hp = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps({**hp, "kl_estimator": "k3"}))
    p = _run(str(path), "--preset", "trl", "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(p.stdout)["convention"]["kl_estimator"] == "k3"
    sidecar.write_text(json.dumps({**hp, "kl_estimator": "k3", "score_at": "last_valid"}))
    p = _run(str(path), "--preset", "trl", "--json")
    assert p.returncode == 0, p.stdout + p.stderr  # the preset's after_last_valid is what the dump used
    notes = [d for d in json.loads(p.stdout)["diagnosis"] if d.startswith("note: --preset trl")]
    assert len(notes) == 1 and "score_at=after_last_valid" in notes[0] and "score_at=last_valid" in notes[0]


def test_a_dump_without_trainer_outputs_is_bad_input_not_a_match(tmp_path: Path) -> None:
    """A dump script that forgot the outputs must not get a green "match" (exit 0) for nothing."""
    s = setup_for("trl")
    inputs = make_inputs(seed=4)
    path = save(
        tmp_path, {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in inputs.items()}, s
    )
    p = _run(str(path), "--preset", "trl")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "inputs only" in p.stderr and "nothing to compare" in p.stderr and "Traceback" not in p.stderr
