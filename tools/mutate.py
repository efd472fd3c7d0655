"""A small ``ast`` mutation tester for the vectorized functions of ``refppo/core`` and ``refppo/pipeline``.

Usage (from the repository root)::

    nice -n 5 .venv/bin/python tools/mutate.py                     # every module, report to stdout
    .venv/bin/python tools/mutate.py --list --module kl            # list kl.py's mutants, run nothing
    .venv/bin/python tools/mutate.py --module pipeline --module kl --json out.json
    .venv/bin/python tools/mutate.py --module policy --only 12 --only 40 --show   # rerun two, show output

Scope: in ``refppo/core/*.py`` every function whose name does not end in ``_naive`` (the naive twins
and their helper ``logprobs._log_sum_exp`` are skipped), *including* the validation-only helpers
(``kl.check_kl_clamps``, ``masked._check_dim``, ``logprobs._prepare``) and ``grad.py``'s per-token
helpers (``_pg_token``, ``_vf_token``, ``_kl_token``: the closed-form gradient twin's formulas;
``group_naive.py`` holds only naive twins and is not listed); in ``refppo/pipeline.py``
``value_mask``, ``reward_quantities``, ``rollout_quantities``, ``gae_by_rows``, ``critic_free_advantages``,
``Normalisers.kwargs``, ``policy_term``, ``update_quantities``, ``clipped_scores``,
``mapped_scores``, the ``__post_init__`` checks
of ``Convention`` and ``Hyperparams`` and their fields' numeric defaults (not the dict
(de)serialisation or ``stats``). The numeric/bool default values of the in-scope functions'
arguments are mutated too (``unbiased=True``, ``vf_coef=0.0``, ...). Statements
inside ``raise`` (error-message formatting) and docstrings are never mutated.

Operators (one change per mutant): arithmetic swap (``+ −``, ``* /``, ``** → *``), a dropped right
term of ``+``/``−``, a dropped unary minus, comparison boundary (``< ↔ <=``) and negation
(``< → >=``), ``== ↔ !=``, ``is ↔ is not``, ``and ↔ or``, ``& ↔ |``, a dropped ``~``/``not``,
numeric constants (``0 ↔ 1``, ``c → c+1``, ``c → −c``; not ``−c`` for an axis index, see
:func:`_axis_constants`), ``True ↔ False``, ``torch.where`` branch
swap and mask inversion, a dropped ``torch.clamp`` bound, min/max swap (``torch.minimum ↔
maximum``, ``amin ↔ amax``, builtin ``min ↔ max``), ``.detach()`` removal, slice bounds ±1, a
dropped keyword argument (``**kwargs`` included; not ``what=``/``dtype=``/``device=`` or a
dataclass field) and a dropped dict-entry assignment
(``d["k"] = v`` → ``pass``).

Each mutant runs in a forked child of a parent that has imported torch, hypothesis and pytest but
not refppo: the child installs an import hook that loads the mutated module (compiled from the
mutated tree: same file name and line numbers), then runs ``pytest -x -q -p no:cacheprovider`` on
that module's test subset (:func:`subset`) with the Hypothesis ``ci`` profile (derandomized: the same
examples as CI) minus its shrink phase (a failure needs no minimal example here). Tests run fastest
first (their durations are measured on the unmutated code; a test that fails there is excluded and
listed in the report). A child that runs past its timeout (2 × the subset's baseline + 20 s) is
killed and counted as ``timeout`` (neither killed nor survived). ``--killed-in`` carries the killed
mutants of an earlier ``--json`` result (valid when tests were only added since); survivors listed
in ``tools/mutate_equivalent.json`` (key and one-line reason) are reported as equivalent and left
out of the score's denominator. A key names the file, the function, the mutated line's *text*, the
change and, for a repeated one, its occurrence (:meth:`Mutant.key`), never the line number, so an
edit elsewhere in the file leaves the entries valid; an entry that matches no mutant any more is
listed as stale in the report (and fails ``tests/unit/test_mutate_keys.py``).
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib.abc
import importlib.util
import json
import os
import resource
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENT = ROOT / "tools" / "mutate_equivalent.json"
CORE = (
    "aggregate",
    "gae",
    "grad",
    "group",
    "gspo",
    "kl",
    "logprobs",
    "masked",
    "normalize",
    "objective",
    "policy",
    "rewards",
    "score_map",
    "value",
)
MODULES = (*CORE, "pipeline", "step_settings")
TOP_LEVEL = ("pipeline", "step_settings")
"""Modules directly under refppo/ (the others are refppo/core/); step_settings holds
``Convention`` and ``Hyperparams``, which refppo/pipeline.py re-exports."""
PIPELINE_FUNCS = {
    "value_mask",
    "reward_quantities",
    "rollout_quantities",
    "critic_free_advantages",
    "gae_by_rows",
    "Normalisers.kwargs",
    "policy_term",
    "update_quantities",
    "clipped_scores",
    "mapped_scores",
    "Convention.__post_init__",
    "Hyperparams.__post_init__",
}
NAIVE_HELPERS = {"_log_sum_exp"}
DEFAULT_CLASSES = {"Hyperparams", "Convention"}
"""step_settings.py classes whose field defaults (numeric/bool constants) are mutated too."""
# New tests that target gaps across modules (added with this tool); missing files are skipped.
GAP_TESTS = (
    "tests/unit/test_core_boundaries.py",
    "tests/unit/test_core_gradients.py",
    "tests/unit/test_core_defaults.py",
    "tests/unit/test_core_mutation_kills.py",
)
PIPELINE_TESTS = (
    "tests/unit/test_pipeline.py",
    "tests/unit/test_pipeline_normalisers.py",
    "tests/unit/test_pipeline_critic_free.py",
    "tests/unit/test_pipeline_score_map.py",
    "tests/property/test_gae_by_rows.py",
    "tests/unit/test_core_defaults.py",
    "tests/unit/test_core_boundaries.py",
    "tests/golden/test_golden_ppo.py",
    "tests/unit/test_core_mutation_kills.py",
)
"""The oracle's tests (tests/unit/test_oracle_*.py) also go through the pipeline but take minutes
per run on a shared 2-core machine; the golden replay covers the whole iteration."""
EXTRA_TESTS: dict[str, tuple[str, ...]] = {
    "logprobs": ("tests/property/test_logprobs_chunked.py",),
    "group": ("tests/property/test_group_more_estimators.py", "tests/property/test_group_std_level.py"),
    "kl": ("tests/property/test_kl_straight_through.py",),
    "score_map": ("tests/unit/test_pipeline_score_map.py",),
}
"""A core module's tests beyond ``test_core_<mod>.py`` and ``test_<mod>_properties.py``."""


def module_path(mod: str) -> Path:
    """Source file of a module short name (``kl`` → ``refppo/core/kl.py``)."""
    return ROOT / (f"refppo/{mod}.py" if mod in TOP_LEVEL else f"refppo/core/{mod}.py")


def module_name(mod: str) -> str:
    """Dotted import name of a module short name."""
    return f"refppo.{mod}" if mod in TOP_LEVEL else f"refppo.core.{mod}"


def subset(mod: str) -> list[str]:
    """The test files run against ``mod``'s mutants (those that exist)."""
    if mod in TOP_LEVEL:
        files: tuple[str, ...] = PIPELINE_TESTS
    else:
        extra = EXTRA_TESTS.get(mod, ())
        own = (f"tests/unit/test_core_{mod}.py", f"tests/property/test_{mod}_properties.py", *extra)
        files = (*own, "tests/unit/test_core_inputs.py", *GAP_TESTS)
    return [f for f in files if (ROOT / f).exists()]


# ----------------------------------------------------------------------------------------------
# Mutation points
# ----------------------------------------------------------------------------------------------


@dataclass
class Mutant:
    """One single-point change of one module."""

    module: str
    index: int
    line: int
    function: str
    operator: str
    before: str
    after: str
    status: str = "pending"
    seconds: float = 0.0
    source: str = ""
    """The text of the mutated source line (``line``), whitespace collapsed."""
    occurrence: int = 1
    """1 + how many earlier mutants of the module have the same key (the same change of the same
    text in the same function): tells apart repeated lines without their number."""

    def key(self) -> str:
        """Identity across runs and edits elsewhere in the file: file, function, the mutated line's
        text, operator and change, and the occurrence when those repeat. Line numbers are not part
        of it (they move whenever a line above changes: the line-keyed entries of
        ``tools/mutate_equivalent.json`` went stale that way)."""
        base = (
            f"{module_path(self.module).name}::{self.function} `{self.source}` "
            f"{self.operator} `{self.before}` → `{self.after}`"
        )
        return base if self.occurrence == 1 else f"{base} #{self.occurrence}"

    def label(self) -> str:
        """``kl.py:63 [#12 compare] `a < b` → `a <= b``` (for reports)."""
        where = f"{module_path(self.module).name}:{self.line}"
        return f"{where} [#{self.index} {self.operator} in {self.function}] `{self.before}` → `{self.after}`"


Alternative = tuple[str, Callable[[], ast.AST]]
_ARITH: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.Pow: ast.Mult,
    ast.BitAnd: ast.BitOr,
    ast.BitOr: ast.BitAnd,
}
_BOUNDARY: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
_NEGATE: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.GtE,
    ast.LtE: ast.Gt,
    ast.Gt: ast.LtE,
    ast.GtE: ast.Lt,
}
_KEEP_KWARGS = {"what", "dtype", "device"}
"""Keyword arguments never dropped: error-message names and the dtype/device of constants."""
_MINMAX = {
    "minimum": "maximum",
    "maximum": "minimum",
    "amin": "amax",
    "amax": "amin",
    "min": "max",
    "max": "min",
}


def _short(node: ast.AST) -> str:
    text = ast.unparse(node).replace("\n", " ")
    return text if len(text) <= 90 else text[:87] + "..."


def _attr_name(func: ast.expr) -> str | None:
    """``torch.where`` → ``where``; ``x.detach`` → ``detach``; ``min`` → ``min``."""
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return None


def _with(node: ast.AST, **changes: Any) -> ast.AST:
    new = copy.copy(node)
    for k, v in changes.items():
        setattr(new, k, v)
    return new


def _binop_alternatives(node: ast.BinOp) -> list[Alternative]:
    out: list[Alternative] = []
    swapped = _ARITH.get(type(node.op))
    if swapped is not None:
        out.append(("arith", lambda: _with(node, op=swapped())))
    if isinstance(node.op, (ast.Add, ast.Sub)):
        out.append(("drop-term", lambda: node.left))
    return out


AXIS_FUNCS = {"sum", "unsqueeze", "squeeze", "count_true", "amax", "amin", "argsort", "gather", "scatter"}
"""Calls whose integer arguments are axes of the core's fixed-rank ``[B, T]``/``[B]`` tensors."""


def _axis_constants(tree: ast.AST) -> set[int]:
    """ids of the constants that index an axis (``dim=1``, ``x.sum(1)``, ``x.shape[1]``).

    For them ``c → −c`` is not generated: axis ``−1`` *is* axis ``1`` of a 2-dim tensor (and
    ``−0 = 0``), an equivalent mutant by construction. The other constant changes still are.
    """
    marked: set[int] = set()

    def mark(e: ast.expr) -> None:
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
            e = e.operand
        if isinstance(e, ast.Constant):
            marked.add(id(e))

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == "dim":
                    mark(kw.value)
            if _attr_name(node.func) in AXIS_FUNCS:
                for a in node.args:
                    mark(a)
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "shape"
        ):
            mark(node.slice)
    return marked


def _const_alternatives(node: ast.Constant, axis: bool = False) -> list[Alternative]:
    v = node.value
    if isinstance(v, bool):
        return [("constant", lambda: ast.Constant(not v))]
    if not isinstance(v, (int, float)):
        return []
    values: list[int | float] = []
    for c in ((1 if v == 0 else 0), v + 1, -v):
        if c != v and c not in values and not (axis and c == -v):
            values.append(c)
    return [("constant", partial(ast.Constant, c)) for c in values]


def _call_alternatives(node: ast.Call) -> list[Alternative]:
    out: list[Alternative] = []
    name = _attr_name(node.func)
    if name == "where" and len(node.args) == 3:
        c, a, b = node.args
        out.append(("where-swap", lambda: _with(node, args=[c, b, a])))
        inv = ast.UnaryOp(op=ast.Invert(), operand=c)
        out.append(("where-invert", lambda: _with(node, args=[inv, a, b])))
    if name == "clamp":
        out.extend(_clamp_alternatives(node))
    if name in _MINMAX:
        other = _MINMAX[name]
        func: ast.expr
        if isinstance(node.func, ast.Attribute):
            func = ast.Attribute(value=node.func.value, attr=other, ctx=ast.Load())
        else:
            func = ast.Name(id=other, ctx=ast.Load())
        out.append(("min-max", lambda: _with(node, func=func)))
    if name == "detach" and isinstance(node.func, ast.Attribute) and not node.args:
        receiver = node.func.value
        out.append(("detach", lambda: receiver))
    constructor = name is not None and name[:1].isupper()  # a dataclass: a dropped field is a TypeError
    for i, kw in enumerate(node.keywords):
        if constructor or kw.arg in _KEEP_KWARGS or (name == "clamp" and kw.arg in ("min", "max")):
            continue  # noise (message text, dtype/device of a zero) or covered by the clamp operator
        kws = node.keywords[:i] + node.keywords[i + 1 :]
        out.append(("drop-arg", partial(_with, node, keywords=kws)))
    return out


def _clamp_alternatives(node: ast.Call) -> list[Alternative]:
    """Drop one bound of ``torch.clamp(x, lo, hi)`` / ``clamp(x, min=, max=)`` (the input if none left)."""
    out: list[Alternative] = []
    pos = node.args[1:]
    bounds = [("pos", i) for i in range(len(pos))] + [
        ("kw", i) for i, k in enumerate(node.keywords) if k.arg in ("min", "max")
    ]
    if not node.args:
        return out
    x = node.args[0]
    for kind, i in bounds:
        if len(bounds) == 1:
            out.append(("clamp", lambda: x))
        elif kind == "pos":
            args = list(node.args)
            args[1 + i] = ast.Constant(None)
            out.append(("clamp", partial(_with, node, args=args)))
        else:
            kws = node.keywords[:i] + node.keywords[i + 1 :]
            out.append(("clamp", partial(_with, node, keywords=kws)))
    return out


def _slice_alternatives(node: ast.Slice) -> list[Alternative]:
    out: list[Alternative] = []
    for part in ("lower", "upper"):
        bound = getattr(node, part)
        if bound is None:
            continue
        for op in (ast.Add, ast.Sub):
            new = ast.BinOp(left=bound, op=op(), right=ast.Constant(1))
            out.append(("slice", partial(_with, node, **{part: new})))
    return out


class _Mutator(ast.NodeTransformer):
    """Walks the in-scope functions in a fixed order; lists the mutation points or applies one."""

    def __init__(self, mod: str, target: int | None) -> None:
        self.mod = mod
        self.target = target
        self.count = 0
        self.found: list[Mutant] = []
        self.scope: list[str] = []
        self.active = False
        self.axis: set[int] = set()

    def visit_Module(self, node: ast.Module) -> ast.AST:
        self.axis = _axis_constants(node)
        return self.generic_visit(node)

    def _in_scope(self, qualname: str, name: str) -> bool:
        if self.mod in TOP_LEVEL:
            return qualname in PIPELINE_FUNCS
        return not name.endswith("_naive") and name not in NAIVE_HELPERS and len(self.scope) == 0

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:
        self.scope.append(node.name)
        fields = self.mod in TOP_LEVEL and node.name in DEFAULT_CLASSES
        for i, s in enumerate(node.body):
            if fields and isinstance(s, ast.AnnAssign) and s.value is not None:
                self.active = True  # a documented default of a field (constants only)
                s.value = self.visit(s.value)
                self.active = False
            else:
                node.body[i] = self.visit(s)
        self.scope.pop()
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        qualname = ".".join([*self.scope, node.name])
        outer = self.active
        if not outer:
            self.active = self._in_scope(qualname, node.name)
        self.scope.append(node.name)
        body = node.body
        start = 1 if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else 0
        node.body = body[:start] + [self.visit(s) for s in body[start:]]
        # Default argument values last (so adding them did not renumber the body's mutants).
        a = node.args
        a.defaults = [self.visit(d) for d in a.defaults]
        a.kw_defaults = [None if d is None else self.visit(d) for d in a.kw_defaults]
        self.scope.pop()
        self.active = outer
        return node

    def visit_Raise(self, node: ast.Raise) -> ast.AST:
        return node  # error-message formatting is not mutated

    def visit_JoinedStr(self, node: ast.JoinedStr) -> ast.AST:
        return node  # nor f-strings

    def visit_Assign(self, node: ast.Assign) -> ast.AST:
        new = self.generic_visit(node)
        if len(node.targets) == 1 and isinstance(node.targets[0], ast.Subscript):
            return self._offer(node, new, [("drop-stmt", lambda: ast.Pass())])
        return new

    def generic_visit(self, node: ast.AST) -> ast.AST:
        new = super().generic_visit(node)
        alternatives: list[Alternative] = []
        if isinstance(node, ast.BinOp):
            alternatives = _binop_alternatives(node)
        elif isinstance(node, ast.Compare) and len(node.ops) == 1:
            alternatives = self._compare_alternatives(node)
        elif isinstance(node, ast.BoolOp):
            other: ast.boolop = ast.Or() if isinstance(node.op, ast.And) else ast.And()
            alternatives = [("bool", lambda: _with(node, op=other))]
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Invert, ast.Not)):
            operand = node.operand
            alternatives = [("unary", lambda: operand)]
        elif isinstance(node, ast.Constant):
            alternatives = _const_alternatives(node, id(node) in self.axis)
        elif isinstance(node, ast.Call):
            alternatives = _call_alternatives(node)
        elif isinstance(node, ast.Slice):
            alternatives = _slice_alternatives(node)
        return self._offer(node, new, alternatives)

    @staticmethod
    def _compare_alternatives(node: ast.Compare) -> list[Alternative]:
        out: list[Alternative] = []
        op = type(node.ops[0])
        if op in _BOUNDARY:
            b = _BOUNDARY[op]
            out.append(("compare", lambda: _with(node, ops=[b()])))
        if op in _NEGATE:
            n = _NEGATE[op]
            out.append(("compare-negate", lambda: _with(node, ops=[n()])))
        return out

    def _offer(self, original: ast.AST, current: ast.AST, alternatives: Sequence[Alternative]) -> ast.AST:
        if not self.active:
            return current
        result = current
        for operator, make in alternatives:
            idx = self.count
            self.count += 1
            if self.target is None:
                mutated = make()
                line = getattr(original, "lineno", 0)
                fn = ".".join(self.scope)
                self.found.append(
                    Mutant(self.mod, idx, line, fn, operator, _short(original), _short(mutated))
                )
            elif idx == self.target:
                result = make()
        return result


def list_mutants(mod: str) -> list[Mutant]:
    """Every mutation point of ``mod`` in walk order (``Mutant.index`` = position)."""
    text = module_path(mod).read_text()
    lines = text.splitlines()
    m = _Mutator(mod, None)
    m.visit(ast.parse(text))
    seen: dict[str, int] = {}
    for mu in m.found:
        mu.source = " ".join(lines[mu.line - 1].split()) if 0 < mu.line <= len(lines) else ""
        k = mu.key()
        seen[k] = seen.get(k, 0) + 1
        mu.occurrence = seen[k]
    return m.found


def mutated_code(mod: str, index: int) -> CodeType:
    """``mod`` compiled with mutation ``index`` applied (original file name and line numbers)."""
    path = str(module_path(mod))
    tree = ast.parse(Path(path).read_text(), filename=path)
    m = _Mutator(mod, index)
    new = ast.fix_missing_locations(m.visit(tree))
    code: CodeType = compile(new, path, "exec")
    return code


# ----------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------


class _CodeLoader(importlib.abc.Loader):
    def __init__(self, code: CodeType) -> None:
        self.code = code

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        exec(self.code, module.__dict__)


class _OneModuleFinder(importlib.abc.MetaPathFinder):
    """Serves one module name from the given code; everything else imports normally."""

    def __init__(self, name: str, code: CodeType, path: str) -> None:
        self.name, self.code, self.path = name, code, path

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        return importlib.util.spec_from_file_location(fullname, self.path, loader=_CodeLoader(self.code))


class _Plugin:
    """pytest plugin: no shrinking, fastest tests first, ``exclude`` deselected, durations recorded."""

    def __init__(self, durations: dict[str, float], exclude: set[str]) -> None:
        self.durations = durations
        self.exclude = exclude
        self.measured: dict[str, float] = {}
        self.failed: list[str] = []

    def pytest_configure(self, config: Any) -> None:
        from hypothesis import Phase, settings

        base = os.environ.get("HYPOTHESIS_PROFILE", "ci")
        phases = [Phase.explicit, Phase.reuse, Phase.generate]
        settings.register_profile("mutation", parent=settings.get_profile(base), phases=phases)
        settings.load_profile("mutation")

    def pytest_collection_modifyitems(self, config: Any, items: list[Any]) -> None:
        dropped = [it for it in items if it.nodeid in self.exclude]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [it for it in items if it.nodeid not in self.exclude]
        items.sort(key=lambda it: self.durations.get(it.nodeid, 0.0))

    def pytest_runtest_logreport(self, report: Any) -> None:
        self.measured[report.nodeid] = self.measured.get(report.nodeid, 0.0) + report.duration
        if report.failed and report.nodeid not in self.failed:
            self.failed.append(report.nodeid)


def _child(
    files: list[str],
    durations: dict[str, float],
    exclude: set[str],
    log: str,
    source: tuple[str, CodeType, str] | None,
) -> int:
    """Body of the forked child: install the mutant, run pytest, return its exit code.

    Without a mutant (the baseline) every test runs (no ``-x``) and the durations and failures are
    written to ``log + ".json"``.
    """
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    if source is not None:
        sys.meta_path.insert(0, _OneModuleFinder(*source))
    import pytest

    plugin = _Plugin(durations, exclude)
    stop = ["-x"] if source is not None else []
    args = [*stop, "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *files]
    rc = int(pytest.main(args, plugins=[plugin]))
    if source is None:
        with open(log + ".json", "w") as f:
            json.dump({"durations": plugin.measured, "failed": plugin.failed}, f)
    sys.stdout.flush()
    sys.stderr.flush()
    return rc


def run_forked(
    files: list[str],
    durations: dict[str, float],
    exclude: set[str],
    log: str,
    source: tuple[str, CodeType, str] | None,
    timeout: float,
) -> tuple[str, float]:
    """Run the subset in a forked child: ``("pass" | "fail" | "timeout", seconds)``."""
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            code = _child(files, durations, exclude, log, source)
        finally:
            os._exit(code)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - t0 > timeout:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout", time.monotonic() - t0
        time.sleep(0.05)
    rc = os.waitstatus_to_exitcode(status)
    return ("pass" if rc == 0 else "fail"), time.monotonic() - t0


@dataclass
class ModuleResult:
    """All mutants of one module with the baseline time."""

    module: str
    files: list[str]
    baseline_s: float
    excluded: list[str] = field(default_factory=list)
    """Tests of the subset that fail on the unmutated code (deselected for the mutants)."""
    mutants: list[Mutant] = field(default_factory=list)


def run_module(mod: str, only: set[int] | None, tmp: str, show: bool, carried: set[str]) -> ModuleResult:
    """Baseline the subset on the unmutated code, then run every (selected) mutant.

    Mutants whose :meth:`Mutant.key` is in ``carried`` (killed in an earlier run) are not rerun.
    """
    files = subset(mod)
    log = os.path.join(tmp, f"{mod}.log")
    status, base_s = run_forked(files, {}, set(), log, None, timeout=1800)
    base = json.loads(Path(log + ".json").read_text()) if Path(log + ".json").exists() else None
    if status != "pass" and not (base and base["failed"]):
        sys.exit(
            f"mutate: the unmutated {mod} subset did not run; see {log}:\n{Path(log).read_text()[-3000:]}"
        )
    assert base is not None
    durations: dict[str, float] = base["durations"]
    excluded: list[str] = base["failed"]
    print(f"== {mod}: baseline {base_s:.1f} s, files {files}", flush=True)
    for nodeid in excluded:  # a test that fails on the unmutated code cannot tell mutants apart
        print(f"  EXCLUDED (fails on the unmutated code): {nodeid}", flush=True)
    result = ModuleResult(mod, files, base_s, excluded)
    path = str(module_path(mod))
    for mu in list_mutants(mod):
        if only is not None and mu.index not in only:
            continue
        if mu.key() in carried:
            mu.status = "killed"
            result.mutants.append(mu)
            continue
        src = mutated_code(mod, mu.index)
        mlog = os.path.join(tmp, f"{mod}-{mu.index}.log")
        mutant = (module_name(mod), src, path)
        st, secs = run_forked(files, durations, set(excluded), mlog, mutant, 2.0 * base_s + 20.0)
        mu.status = {"pass": "survived", "fail": "killed", "timeout": "timeout"}[st]
        mu.seconds = secs
        result.mutants.append(mu)
        if mu.status != "killed" or show:
            print(f"  {mu.status:8s} {secs:6.1f}s {mu.label()}", flush=True)
            if show:
                print(Path(mlog).read_text()[-4000:], flush=True)
    return result


def report(results: list[ModuleResult], wall: float, cpu: float, equivalent: dict[str, str]) -> str:
    """Markdown summary: totals per module, then every survivor (equivalent ones with the reason)."""
    lines = [
        "| module | mutants | killed | equivalent | survived | timeout | baseline s |",
        "|---|---|---|---|---|---|---|",
    ]
    tot = [0, 0, 0, 0, 0]
    for r in results:
        st = [m.status for m in r.mutants]
        eq = sum(s == "survived" and m.key() in equivalent for s, m in zip(st, r.mutants, strict=True))
        c = [len(st), st.count("killed"), eq, st.count("survived") - eq, st.count("timeout")]
        tot = [a + b for a, b in zip(tot, c, strict=True)]
        lines.append(f"| {r.module} | {' | '.join(map(str, c))} | {r.baseline_s:.1f} |")
    lines.append(f"| **total** | {' | '.join(map(str, tot))} | |")
    scored = tot[0] - tot[2] - tot[4]
    lines += [
        "",
        f"killed {tot[1]}/{tot[0] - tot[4]} = {100.0 * tot[1] / max(tot[0] - tot[4], 1):.1f}% of all "
        f"(timeouts excluded); {tot[1]}/{scored} = {100.0 * tot[1] / max(scored, 1):.1f}% of the "
        f"non-equivalent; wall {wall / 60:.1f} min, CPU {cpu / 60:.1f} min",
        "",
        "Survivors (not marked equivalent):",
    ]
    survivors = [m for r in results for m in r.mutants if m.status == "survived"]
    lines += [f"- {m.label()}" for m in survivors if m.key() not in equivalent]
    lines += ["", "Equivalent survivors:"]
    lines += [f"- {m.label()}: {equivalent[m.key()]}" for m in survivors if m.key() in equivalent]
    stale = stale_entries(equivalent, [r.module for r in results])
    if stale:
        lines += ["", "Stale entries of the equivalent list (no mutant of these modules has the key):"]
        lines += [f"- {k}" for k in stale]
    excluded = [f"- {r.module}: {t}" for r in results for t in r.excluded]
    if excluded:
        lines += ["", "Tests excluded (failing on the unmutated code):", *excluded]
    timeouts = [m for r in results for m in r.mutants if m.status == "timeout"]
    if timeouts:
        lines += ["", "Timeouts:"] + [f"- {m.label()}" for m in timeouts]
    return "\n".join(lines)


def stale_entries(equivalent: dict[str, str], modules: Sequence[str]) -> list[str]:
    """Keys of ``equivalent`` that name a file of ``modules`` but no current mutant of it."""
    files = {module_path(m).name: m for m in modules}
    keys = {mu.key() for m in modules for mu in list_mutants(m)}
    return [k for k in equivalent if k.split("::", 1)[0].split(":", 1)[0] in files and k not in keys]


def _load_equivalent(path: Path) -> dict[str, str]:
    """``key → reason`` from a JSON list of ``{"key": ..., "reason": ...}`` (missing file: none)."""
    if not path.exists():
        return {}
    return {e["key"]: e["reason"] for e in json.loads(path.read_text())}


def _load_killed(path: str | None) -> set[str]:
    if path is None:
        return set()
    data = json.loads(Path(path).read_text())
    return {Mutant(**m).key() for r in data for m in r["mutants"] if m["status"] == "killed"}


def _iter_modules(selected: list[str] | None) -> Iterator[str]:
    for mod in selected or MODULES:
        if mod not in MODULES:
            sys.exit(f"mutate: unknown module {mod!r}; valid: {', '.join(MODULES)}")
        yield mod


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--module", action="append", help=f"one of {', '.join(MODULES)} (repeatable; default all)")
    p.add_argument("--list", action="store_true", help="list the mutants and their subsets; run nothing")
    p.add_argument(
        "--only", action="append", type=int, help="run only these mutant indices (with one --module)"
    )
    p.add_argument("--show", action="store_true", help="print every mutant's pytest output tail")
    p.add_argument("--json", help="also write the results as JSON to this path")
    p.add_argument(
        "--killed-in",
        help="a previous --json result: its killed mutants are not rerun (valid when tests were only added)",
    )
    p.add_argument(
        "--equivalent",
        default=str(EQUIVALENT),
        help="JSON list of {key, reason}: survivors judged equivalent (default tools/mutate_equivalent.json)",
    )
    a = p.parse_args(argv)
    modules = list(_iter_modules(a.module))
    if a.list:
        for mod in modules:
            mutants = list_mutants(mod)
            print(f"== {mod}: {len(mutants)} mutants; tests {subset(mod)}")
            for mu in mutants:
                print(f"  {mu.label()}")
        return 0
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))  # test the tree this file sits in, whatever is installed
    os.environ.setdefault("HYPOTHESIS_PROFILE", "ci")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import hypothesis  # noqa: F401  # imported once in the parent, shared by every forked child
    import pytest  # noqa: F401
    import torch

    torch.set_num_threads(1)
    t0 = time.monotonic()
    only = set(a.only) if a.only else None
    carried = _load_killed(a.killed_in)
    results: list[ModuleResult] = []
    with tempfile.TemporaryDirectory(prefix="refppo-mutate-") as tmp:
        for mod in modules:
            results.append(run_module(mod, only, tmp, a.show, carried))
            if a.json:  # after every module, so an interrupted run keeps what it measured
                _write_json(a.json, results)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    text = report(
        results, time.monotonic() - t0, usage.ru_utime + usage.ru_stime, _load_equivalent(Path(a.equivalent))
    )
    print(text)
    return 0


def _write_json(path: str, results: list[ModuleResult]) -> None:
    data = [dict(asdict(r), mutants=[asdict(m) for m in r.mutants]) for r in results]
    tmp = path + ".tmp"
    Path(tmp).write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
