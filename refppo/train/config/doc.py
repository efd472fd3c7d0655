"""Every ``--set SECTION.KEY`` of :class:`refppo.train.config.schema.TrainConfig`, described
(``--help-config``).

The descriptions are the field docstrings of the config dataclasses (the string literal under each
field, CleanRL style), read from the source with :mod:`ast` — one text for the code, the docs and
the command line — with the reStructuredText roles and literals turned into plain text.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re
import textwrap
import typing
from enum import Enum
from functools import cache
from typing import Any

from refppo.pipeline.groups import GROUPS
from refppo.pipeline.settings import FLAT, Convention
from refppo.train.config.codec import sub_hints
from refppo.train.config.schema import TrainConfig

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def plain(text: str) -> str:
    """``text`` without reStructuredText markup: ``:class:`a.B``` → ``a.B``, double-backquoted
    literals → their content; whitespace collapsed to single spaces."""
    return " ".join(_LITERAL.sub(r"\1", _ROLE.sub(r"\1", text)).split())


@cache
def field_docs(cls: type[Any]) -> dict[str, str]:
    """``{field name: its docstring}`` of a dataclass (the string literal right under the field)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    out: dict[str, str] = {}
    for stmt, nxt in itertools.pairwise(body):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            out[stmt.target.id] = nxt.value.value
    return out


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and issubclass(tp, Enum):
        return "{" + "|".join(str(m.value) for m in tp) + "}"
    if isinstance(tp, type):
        return tp.__name__
    args = typing.get_args(tp)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return " | ".join([*(_type_name(a) for a in rest), "none"])
    if typing.get_origin(tp) is tuple:
        return "[" + ", ".join(_type_name(a) for a in args) + "]"
    return str(tp)


def _value_text(value: Any) -> str:
    if isinstance(value, Enum):
        return str(value.value)
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(_value_text(v) for v in value) + "]"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def _owner(cls: Any, key: str) -> tuple[Any, str]:
    """The dataclass and field that document flat key ``key`` of the flattened class ``cls``: a
    :class:`refppo.pipeline.settings.Convention` key's group and field, else ``cls`` itself."""
    if cls is Convention:
        fk = FLAT[key]
        return GROUPS[fk.group], fk.name
    return cls, key


def sections() -> list[str]:
    """The config's sections, in order: ``model``, ``task``, ..., ``run``."""
    return [f.name for f in dataclasses.fields(TrainConfig)]


def config_keys() -> list[tuple[str, str, str, str]]:
    """``(SECTION.KEY, type, default, description)`` of every key ``--set`` accepts, in
    declaration order (the flattened ``[ppo]`` fields of Hyperparams and Convention included)."""
    rows: list[tuple[str, str, str, str]] = []
    default = TrainConfig()
    for section in dataclasses.fields(TrainConfig):
        cls = typing.get_type_hints(TrainConfig)[section.name]
        obj = getattr(default, section.name)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("flatten"):
                sub_obj = getattr(obj, f.name)
                for key, tp in sub_hints(hints[f.name]).items():
                    owner, name = _owner(hints[f.name], key)
                    value = sub_obj.get(key) if owner is not hints[f.name] else getattr(sub_obj, key)
                    rows.append(
                        (
                            f"{section.name}.{key}",
                            _type_name(tp),
                            _value_text(value),
                            plain(field_docs(owner).get(name, "")),
                        )
                    )
                continue
            rows.append(
                (
                    f"{section.name}.{f.name}",
                    _type_name(hints[f.name]),
                    _value_text(getattr(obj, f.name)),
                    plain(field_docs(cls).get(f.name, "")),
                )
            )
    return rows


def describe_config(section: str | None = None, width: int = 100) -> str:
    """The ``--help-config`` text: one entry per key (``SECTION.KEY  type = default`` and its
    description, wrapped), optionally only the keys of ``section``."""
    rows = config_keys()
    if section:
        rows = [r for r in rows if r[0].split(".")[0] == section]
    lines = [
        "Every config key: set it in a TOML file ([section] key = value) or with --set SECTION.KEY=VALUE "
        "(values parse as TOML; none for an unset optional).",
    ]
    current = ""
    for key, tp, default, doc in rows:
        sec = key.split(".")[0]
        if sec != current:
            lines += ["", f"[{sec}]"]
            current = sec
        lines.append(f"  {key}  ({tp}, default {default})")
        lines += textwrap.wrap(
            doc or "(undocumented)", width, initial_indent="      ", subsequent_indent="      "
        )
    return "\n".join(lines)


__all__ = ["config_keys", "describe_config", "field_docs", "plain", "sections"]
