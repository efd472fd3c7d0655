"""Facts stated in two places agree (#12 item 9: README said Python >= 3.10, pyproject >= 3.11)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_python_version_matches_pyproject() -> None:
    required = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    m = re.fullmatch(r">=\s*(\d+\.\d+)", required)
    assert m, f"requires-python {required!r} is not of the form '>=X.Y'"
    stated = re.findall(r"Python ≥ (\d+\.\d+)", (ROOT / "README.md").read_text())
    assert stated, "README.md no longer states the minimum Python version"
    assert set(stated) == {m.group(1)}, f"README says Python ≥ {stated}, pyproject {required!r}"


def test_ruff_and_mypy_target_the_minimum_python() -> None:
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    minimum = doc["project"]["requires-python"].removeprefix(">=").strip()
    assert doc["tool"]["mypy"]["python_version"] == minimum
    assert doc["tool"]["ruff"]["target-version"] == "py" + minimum.replace(".", "")
