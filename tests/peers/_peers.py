"""Shared by the tests that run the peer validators (``tools/peers``, package ``peers``).

:func:`require` skips a test, with the reason, when a side venv is not built under
``$REFPPO_PEERS_ROOT`` (a skip is never a pass: the validators themselves exit 1 when nothing ran);
:func:`run` runs one validator in a fresh interpreter and returns its process and JSON report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools"
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

from peers.harness import not_built, peers_python  # noqa: E402  (tools/ is not a package)


def require(venv: str) -> Path:
    """The interpreter of side venv ``venv``; skips the test (with the reason) when it is not built."""
    py = peers_python(venv)
    if py is None:
        pytest.skip(not_built(venv))
    return py


def run(
    validator: str, *args: str, tmp_path: Path, timeout: float = 1800
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """``python tools/peers VALIDATOR ARGS --json-out FILE``: the process and the report's JSON."""
    out = tmp_path / f"{validator}-{os.getpid()}-{len(list(tmp_path.glob('*.json')))}.json"
    proc = subprocess.run(
        [sys.executable, str(TOOLS / "peers"), validator, *args, "--json-out", str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=timeout,
        cwd=REPO,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    doc: dict[str, Any] = json.loads(out.read_text())
    return proc, doc


def cases_of(doc: dict[str, Any], unit: str | None = None) -> dict[str, dict[str, Any]]:
    """The report's cases by name (those of ``unit`` only, when given)."""
    return {c["name"]: c for c in doc["cases"] if unit is None or c["unit"] == unit}
