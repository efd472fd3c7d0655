"""One composition of the PPO step (#20): outside ``refppo/core/``, ``refppo/pipeline/`` and
``refppo/verify/`` (which checks each core step against its twin), no module of ``refppo/`` imports a
core *step* module, so none can combine core steps into a loss, an advantage or a reward of its own:
the trainer, the oracle's check, the diagnosis and ``--detect`` reach the step through the stage
table. The exceptions are listed with their reasons; a new import fails, and so does an exception
that is no longer used.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEP_MODULES = frozenset(
    "refppo.core." + m
    for m in (
        "aggregate", "by_rows", "gae", "grad", "group", "gspo", "kl", "normalize", "objective", "policy",
        "rewards", "score_map", "value", "rollout_correction", "rollout_losses", "cispo",
    )
)  # fmt: skip
"""The core modules that compute a step of PPO (not the checks, masked reductions, log-prob
read-outs or the estimators' name tables)."""
INSIDE = ("refppo/core/", "refppo/pipeline/", "refppo/verify/")
ALLOWED: dict[tuple[str, str, str], str] = {
    ("refppo/oracle/check/ties.py", "refppo.core.by_rows", "row_blocks"): "slices rows into blocks",
    ("refppo/oracle/check/ties.py", "refppo.core.value", "clipped_value"): (
        "the clipped value of a tie mask: the core's function called, not restated"
    ),
    ("refppo/oracle/check/diagnose.py", "refppo.core.gae", "has_holes"): "a mask predicate",
    ("refppo/train/update_naive.py", "refppo.core.aggregate", "agg_weights_naive"): (
        "the naive closed-form gradient's weights (a naive twin, not a composition)"
    ),
}


def step_imports() -> set[tuple[str, str, str]]:
    """``(file, module, name)`` of every import of a core step module outside :data:`INSIDE`."""
    out: set[tuple[str, str, str]] = set()
    for path in sorted((ROOT / "refppo").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(INSIDE):
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.ImportFrom) and node.module in STEP_MODULES:
                out.update((rel, node.module, a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module == "refppo.core":
                out.update(
                    (rel, f"refppo.core.{a.name}", "*")
                    for a in node.names
                    if f"refppo.core.{a.name}" in STEP_MODULES
                )
            elif isinstance(node, ast.Import):
                out.update((rel, a.name, "*") for a in node.names if a.name in STEP_MODULES)
    return out


def test_no_module_outside_the_core_and_pipeline_imports_a_core_step() -> None:
    found = step_imports()
    new = sorted(found - set(ALLOWED))
    assert not new, f"core steps imported outside core/pipeline (compose through the stage table): {new}"
    stale = sorted(set(ALLOWED) - found)
    assert not stale, f"ALLOWED entries no longer used (remove them): {stale}"


def test_the_scan_sees_each_import_form(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scanner is able to fail: each import form of a step module in a scratch tree is found, and
    the same import inside pipeline/ is not."""
    pkg = tmp_path / "refppo" / "oracle"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("from refppo.core.policy import clipped_policy_loss\n")
    (pkg / "b.py").write_text("import refppo.core.gae\n")
    (pkg / "c.py").write_text("from refppo.core import value, checks\n")
    (tmp_path / "refppo" / "pipeline").mkdir()
    (tmp_path / "refppo" / "pipeline" / "d.py").write_text("from refppo.core.gae import gae\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert step_imports() == {
        ("refppo/oracle/a.py", "refppo.core.policy", "clipped_policy_loss"),
        ("refppo/oracle/b.py", "refppo.core.gae", "*"),
        ("refppo/oracle/c.py", "refppo.core.value", "*"),
    }
