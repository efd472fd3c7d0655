"""``tools/mutate.py``'s mutant keys and ``tools/mutate_equivalent.json`` (issue #9).

The equivalent survivors were keyed by line number, so every edit above a listed line made its
entry stale (11 of 58 were, found by this test). A key now names the function, the mutated line's
text and the change (plus an occurrence number for repeats): an edit elsewhere in the file leaves
it valid, and an entry that no mutant matches any more fails here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import mutate  # noqa: E402  (tools/ is not a package)
import mutate_scope  # noqa: E402  (mutate's scope part: where list_mutants reads module_path)


def _entries() -> list[dict[str, str]]:
    data: list[dict[str, str]] = json.loads(mutate.EQUIVALENT.read_text())
    return data


def test_every_equivalent_entry_names_a_current_mutant() -> None:
    keys = {mu.key() for mod in mutate.MODULES for mu in mutate.list_mutants(mod)}
    stale = [e["key"] for e in _entries() if e["key"] not in keys]
    assert not stale, f"{len(stale)} stale entries (refresh tools/mutate_equivalent.json): {stale[:5]}"


def test_equivalent_entries_are_unique_and_give_a_reason() -> None:
    keys = [e["key"] for e in _entries()]
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)
    assert all(len(e["reason"]) > 15 for e in _entries())


def test_keys_do_not_move_with_lines_above(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same module with three lines inserted at the top: every mutant keeps its key (its line
    number moves by 3) and the keys stay distinct (repeats are numbered)."""
    before = mutate.list_mutants("rewards")
    moved = tmp_path / "rewards.py"
    moved.write_text("# one\n# two\n# three\n" + mutate.module_path("rewards").read_text())
    monkeypatch.setattr(mutate_scope, "module_path", lambda mod: moved)
    after = mutate.list_mutants("rewards")
    assert [m.line + 3 for m in before] == [m.line for m in after]
    assert [m.key() for m in before] == [m.key() for m in after]
    assert len({m.key() for m in after}) == len(after)
