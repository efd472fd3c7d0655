"""The mutation points of ``tools/mutate.py`` (split out of it): :class:`Mutant`, the operators
(module docstring of ``tools/mutate.py``), the ``ast`` walker and the mutated code of one mutant."""

from __future__ import annotations

import ast
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import CodeType
from typing import Any

import mutate_scope as scope  # tools/ is not a package: a sibling module
from mutate_scope import DEFAULT_CLASSES, NAIVE_HELPERS, PIPELINE_FUNCS, TOP_LEVEL

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
            f"{scope.module_path(self.module).name}::{self.function} `{self.source}` "
            f"{self.operator} `{self.before}` → `{self.after}`"
        )
        return base if self.occurrence == 1 else f"{base} #{self.occurrence}"

    def label(self) -> str:
        """``kl.py:63 [#12 compare] `a < b` → `a <= b``` (for reports)."""
        where = f"{scope.module_path(self.module).name}:{self.line}"
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
    text = scope.module_path(mod).read_text()
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
    path = str(scope.module_path(mod))
    tree = ast.parse(Path(path).read_text(), filename=path)
    m = _Mutator(mod, index)
    new = ast.fix_missing_locations(m.visit(tree))
    code: CodeType = compile(new, path, "exec")
    return code
