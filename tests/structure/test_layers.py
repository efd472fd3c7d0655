"""The package is layered: every module imports only from its own layer or below, and no two modules
import each other, directly or through others (a circle), counting imports inside functions and under
``TYPE_CHECKING`` too.

The layers (also in spec/README.md, "Layout")::

    0  refppo.errors < refppo.{types,atomic,cpu_numerics}
       < refppo.{conventions,rollout_conventions,group_conventions} < refppo.agg_conventions
    1  refppo.core               the pure steps, their naive twins and input checks
    2  refppo.pipeline           one PPO step composed from the core (and its naive twin)
    2  refppo.models             model roles, read-outs, rollout, their naive twins
    3  refppo.dump               the dump's key schema, write, load
    3  refppo.verify             `refppo verify`: every core step against its twin
    4  refppo.capture            StepRecorder and the peers' container adapters
    4  refppo.oracle.presets     the peers' conventions
    5  refppo.oracle.check       one check: recompute, compare, diagnose
    6  refppo.oracle.detect      --detect
    6  refppo.oracle.rescore     re-scoring with the trainer's models
    7  refppo.oracle             run, report, cli
    8  refppo.train              the trainer
    9  refppo.golden             golden trajectories
   10  refppo.{cli,testing} < refppo.__main__

Modules of one layer in different packages do not import each other (e.g. ``refppo.models`` and
``refppo.pipeline``): only downward, or within one package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

LAYERS: dict[str, float] = {
    "refppo.errors": 0,
    "refppo.types": 0.1,
    "refppo.atomic": 0.1,
    "refppo.cpu_numerics": 0.1,
    "refppo.conventions": 0.2,
    "refppo.rollout_conventions": 0.2,
    "refppo.group_conventions": 0.2,
    "refppo.agg_conventions": 0.25,
    "refppo.core": 1,
    "refppo.pipeline": 2,
    "refppo.models": 2,
    "refppo.dump": 3,
    "refppo.verify": 3,
    "refppo.capture": 4,
    "refppo.oracle.presets": 4,
    "refppo.oracle.check": 5,
    "refppo.oracle.detect": 6,
    "refppo.oracle.rescore": 6,
    "refppo.oracle": 7,
    "refppo.train": 8,
    "refppo.golden": 9,
    "refppo.cli": 10,
    "refppo.testing": 10,
    "refppo.__main__": 10.1,
    "refppo": 10,
}


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted((ROOT / "refppo").rglob("*.py")):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


MODULES = _modules()


def unit(module: str) -> str:
    """The package (key of :data:`LAYERS`) a module belongs to: the longest prefix."""
    parts = module.split(".")
    for k in range(len(parts), 0, -1):
        cand = ".".join(parts[:k])
        if cand in LAYERS:
            return cand
    raise AssertionError(f"{module}: in no layer of LAYERS (add its package)")


def imports_of(path: Path) -> set[str]:
    """Every ``refppo`` module imported anywhere in the file (top level, functions, TYPE_CHECKING)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != "refppo":
                continue
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in MODULES else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "refppo")
    return out


GRAPH = {m: {i for i in imports_of(p) if i != m} for m, p in MODULES.items()}


def test_every_module_is_in_a_layer() -> None:
    for m in MODULES:
        unit(m)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_only_downward(module: str) -> None:
    own = unit(module)
    bad = []
    for imp in sorted(GRAPH[module]):
        if imp not in MODULES:
            bad.append(f"{imp} (no such module)")
            continue
        target = unit(imp)
        if target == own or imp == "refppo":
            continue
        if LAYERS[target] >= LAYERS[own]:
            bad.append(f"{imp} (layer {LAYERS[target]}, this module's is {LAYERS[own]})")
    assert not bad, f"{module} imports upward or sideways: {', '.join(bad)}"


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


CIRCLES_LEFT: list[list[str]] = []
"""The circles left today; the list only shrinks (a listed circle that is gone fails: remove it)."""


def test_no_import_circles() -> None:
    found = _circles(GRAPH)
    assert [c for c in found if c not in CIRCLES_LEFT] == []
    assert [c for c in CIRCLES_LEFT if c not in found] == []


def test_the_circle_finder_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
