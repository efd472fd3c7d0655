"""Size limits over the whole tree (STYLE.md: modules under ~400 lines, functions under ~60): every
module of ``refppo/`` and ``tools/`` and every function in them, no hand-picked list.

Lines of a function: ``end_lineno − lineno + 1`` of its ``def`` in the AST (signature and docstring
included); of a module: its newline count.

:data:`OVER` lists what is over the limit today, each entry with its size; it only shrinks: an entry
that is no longer over the limit fails (remove it), and so does a size that grew.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULE_LINES = 400
FUNCTION_LINES = 60
TREES = ("refppo", "tools")

OVER: dict[str, int] = {}


def sizes() -> dict[str, int]:
    """Every module's and function's size, keyed ``path`` and ``path::name`` (methods ``Class.name``)."""
    out: dict[str, int] = {}
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            text = path.read_text(encoding="utf-8")
            out[rel] = text.count("\n")
            for node, owner in _functions(ast.parse(text)):
                name = f"{owner}.{node.name}" if owner else node.name
                out[f"{rel}::{name}"] = node.end_lineno - node.lineno + 1 if node.end_lineno else 0
    return out


def _functions(tree: ast.Module) -> list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, str]]:
    found: list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, str]] = []

    def walk(node: ast.AST, owner: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((child, owner))
                walk(child, owner)
            elif isinstance(child, ast.ClassDef):
                walk(child, child.name)
            else:
                walk(child, owner)

    walk(tree, "")
    return found


def _limit(key: str) -> int:
    return FUNCTION_LINES if "::" in key else MODULE_LINES


def test_nothing_over_the_limits_but_the_listed() -> None:
    over = {k: n for k, n in sizes().items() if n > _limit(k) and k not in OVER}
    assert not over, f"over {MODULE_LINES} lines (module) / {FUNCTION_LINES} (function): {over}"


def test_the_listed_are_still_over_and_did_not_grow() -> None:
    now = sizes()
    stale = {k: now.get(k) for k, n in OVER.items() if now.get(k, 0) <= _limit(k)}
    grew = {k: (OVER[k], now[k]) for k in OVER if now.get(k, 0) > OVER[k]}
    assert not stale, f"no longer over the limit (remove from OVER): {stale}"
    assert not grew, f"grew (listed, now): {grew}"


def test_the_size_reader_counts_functions_and_methods() -> None:
    tree = ast.parse("def f():\n    pass\n\nclass C:\n    def g(self):\n        x = 1\n        return x\n")
    got = {(f"{o}.{n.name}" if o else n.name): n.end_lineno - n.lineno + 1 for n, o in _functions(tree)}
    assert got == {"f": 2, "C.g": 3}
