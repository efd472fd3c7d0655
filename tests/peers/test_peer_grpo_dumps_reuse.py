"""``--dumps DIR`` (``tools/peers/harness.py::run_peer``, ``reuse``): a peer's dumps are made once in a
folder and read back by later runs of the same request, interpreter and ``tools/peers`` code; any of
them changed, or ``reuse`` off, runs the peer again. No side venv needed: a fake interpreter counts
its runs in a file and writes a status."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
from peers import harness  # noqa: E402  (tools/ is not a package)
from peers.harness import Unit, run_peer  # noqa: E402

COUNTING = f"""#!/bin/sh
# argv: tools/peers --peer-side OUT: one line appended to OUT/runs, a status naming the run
exec {sys.executable} -c '
import json, sys
out = sys.argv[3]
with open(out + "/runs", "a") as fh:
    fh.write("run\\n")
n = len(open(out + "/runs").read().splitlines())
json.dump({{"u": {{"version": "1", "result": {{"run": n}}}}}}, open(out + "/status.json", "w"))
' "$@"
"""
UNITS = {"u": Unit("pytest", "m:f")}


def _runs(out: Path) -> int:
    return len((out / "runs").read_text().splitlines())


@pytest.fixture
def fake_py(tmp_path: Path) -> Path:
    py = tmp_path / "python"
    py.write_text(COUNTING)
    py.chmod(0o755)
    return py


def test_the_same_request_is_made_once(
    tmp_path: Path, fake_py: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "dumps"
    out.mkdir()
    first, why = run_peer(fake_py, out, UNITS, reuse=True)
    assert first == {"u": {"version": "1", "result": {"run": 1}}}, why
    again, _ = run_peer(fake_py, out, UNITS, reuse=True)
    assert again == first and _runs(out) == 1  # read back, the peer not run
    other, _ = run_peer(fake_py, out, UNITS, options={"k": 1}, reuse=True)
    assert other is not None and other["u"]["result"] == {"run": 2}  # another request: made again
    back, _ = run_peer(fake_py, out, UNITS, reuse=True)
    assert back is not None and back["u"]["result"] == {"run": 3}  # the folder holds the last only
    monkeypatch.setattr(harness, "_peers_code_digest", lambda: "changed")
    changed, _ = run_peer(fake_py, out, UNITS, reuse=True)
    assert changed is not None and changed["u"]["result"] == {"run": 4}  # the makers changed
    assert run_peer(fake_py, out, UNITS, reuse=True)[0] == changed and _runs(out) == 4


def test_without_reuse_the_peer_always_runs(tmp_path: Path, fake_py: Path) -> None:
    out = tmp_path / "dumps"
    out.mkdir()
    run_peer(fake_py, out, UNITS, reuse=True)
    st, _ = run_peer(fake_py, out, UNITS)
    assert st is not None and st["u"]["result"] == {"run": 2}
    st, _ = run_peer(fake_py, out, UNITS, reuse=True)  # a run without reuse leaves no stale stamp
    assert st is not None and st["u"]["result"] == {"run": 3}


def test_a_failed_make_is_not_reused(tmp_path: Path, fake_py: Path) -> None:
    """A peer that exits non-zero (its status written first) leaves nothing to reuse: the next run
    makes the dumps."""
    fake_py.write_text('#!/bin/sh\necho \'{"u": {"version": "bad"}}\' > "$3/status.json"\nexit 1\n')
    out = tmp_path / "dumps"
    out.mkdir()
    assert run_peer(fake_py, out, UNITS, reuse=True)[0] is None
    fake_py.write_text(COUNTING)  # the same interpreter, working now
    st, _ = run_peer(fake_py, out, UNITS, reuse=True)
    assert st is not None and st["u"]["result"] == {"run": 1}
