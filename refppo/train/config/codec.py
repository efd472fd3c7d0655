"""A config dataclass to and from plain data: TOML tables, JSON, ``--set SECTION.KEY=VALUE``.

Generic over the ROOT dataclass (:class:`refppo.train.config.schema.TrainConfig`): one field per
section, each a dataclass of typed fields, some of them flattened (``metadata={"flatten": True}``:
their own fields sit directly in the section, as ``[ppo] cliprange``)::

    to_plain(obj)                       -> nested dict (enums as their values, tuples as lists)
    from_plain(root, data)              -> root(...)  (an unknown section / key: one ConfigError)
    apply_overrides(root, data, items)  -> data with the SECTION.KEY=VALUE items applied
    coerce(value, type hint, key)       -> the value checked / converted against its field's type

Every bad value is ONE :class:`refppo.train.config.sections.ConfigError` naming ``section.key``.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from dataclasses import fields, replace
from enum import Enum
from typing import Any, TypeVar, Union

from refppo.conventions import parse
from refppo.errors import RefPPOError
from refppo.train.config.sections import ConfigError

D = TypeVar("D")


def section_names(root: type[Any]) -> list[str]:
    """The sections of ``root``, in declaration order."""
    return [f.name for f in fields(root)]


def sub_hints(sub: type[Any]) -> dict[str, Any]:
    """``key -> type hint`` of the keys a flattened field of class ``sub`` contributes: its own
    ``config_hints()`` when it has one (a class of groups with flat keys:
    :meth:`refppo.pipeline.settings.Convention.config_hints`), else its fields."""
    hook = getattr(sub, "config_hints", None)
    if callable(hook):
        hints: dict[str, Any] = hook()
        return hints
    own = typing.get_type_hints(sub)
    return {g.name: own[g.name] for g in fields(sub)}


def _flat_value(obj: Any, key: str) -> Any:
    get = getattr(obj, "get", None)
    return get(key) if callable(get) and hasattr(type(obj), "config_hints") else getattr(obj, key)


def _flat_build(sub: type[Any], values: dict[str, Any]) -> Any:
    if hasattr(sub, "config_hints"):
        return sub().with_updates(values)
    return replace(sub(), **values)


def flat_fields(cls: type[Any]) -> dict[str, tuple[str | None, Any]]:
    """``name -> (flattened sub-field or None, type hint)`` of the keys a section accepts."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[str | None, Any]] = {}
    for f in fields(cls):
        if f.metadata.get("flatten"):
            for name, tp in sub_hints(hints[f.name]).items():
                out[name] = (f.name, tp)
        else:
            out[f.name] = (None, hints[f.name])
    return out


def field_types(root: type[Any], section: str) -> dict[str, Any]:
    """``key -> type hint`` of every key ``[section]`` of ``root`` accepts (flattened ones included)."""
    cls = typing.get_type_hints(root)[section]
    return {k: tp for k, (_, tp) in flat_fields(cls).items()}


def to_plain(obj: Any) -> Any:
    """A dataclass as nested plain data (flattened fields merged into their section)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: dict[str, Any] = {}
        for f in fields(obj):
            v = getattr(obj, f.name)
            if f.metadata.get("flatten"):
                out.update({k: to_plain(_flat_value(v, k)) for k in sub_hints(type(v))})
            else:
                out[f.name] = to_plain(v)
        return out
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, tuple):
        return [to_plain(v) for v in obj]
    return obj


def from_plain(root: type[D], data: Any) -> D:
    """``root`` built from a nested dict of sections; an unknown section raises a ConfigError
    listing the valid ones (each section checks its own keys and values)."""
    if not isinstance(data, dict):
        raise ConfigError(f"the top level: expected a table, got {type(data).__name__}")
    valid_top = section_names(root)
    unknown = sorted(set(data) - set(valid_top))
    if unknown:
        raise ConfigError(f"unknown config sections {unknown}; valid sections are {valid_top}")
    hints = typing.get_type_hints(root)
    kwargs = {k: _section_from_plain(hints[k], v, k) for k, v in data.items()}
    return root(**kwargs)


def _section_from_plain(cls: type[D], data: Any, where: str) -> D:
    """Section ``[where]`` (a ``cls``) from its table: unknown keys, wrong types, and the checks of
    Hyperparams / Convention, each one ConfigError."""
    label = f"[{where}]"
    if not isinstance(data, dict):
        raise ConfigError(f"{label}: expected a table, got {type(data).__name__}")
    accepted = flat_fields(cls)
    unknown = sorted(set(data) - set(accepted))
    if unknown:
        close = "".join(
            f" ({k!r}:{suggest(k, sorted(accepted))[1:]})" for k in unknown if suggest(k, sorted(accepted))
        )
        raise ConfigError(
            f"unknown keys {unknown} in {label}{close}; refppo train --help-config {where} lists its keys"
        )
    own: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for key, value in data.items():
        parent, tp = accepted[key]
        coerced = coerce(value, tp, f"{where}.{key}")
        if parent is None:
            own[key] = coerced
        else:
            nested.setdefault(parent, {})[key] = coerced
    hints = typing.get_type_hints(cls)
    try:
        for parent, sub in nested.items():
            own[parent] = _flat_build(hints[parent], sub)
        return cls(**own)
    except ConfigError:
        raise
    except RefPPOError as e:  # Hyperparams / Convention validation: "KEY: ..." named section.key
        key = str(e).split(":", 1)[0]
        raise ConfigError(f"{where}.{e}" if key in accepted else f"[{where}]: {e}") from e


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert one value against its field's type hint."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        is_none = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
        if is_none and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: {value!r} does not match {tp}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    if isinstance(tp, type) and issubclass(tp, Enum):
        try:
            return parse(tp, value, what=key)
        except RefPPOError as e:
            raise ConfigError(str(e)) from e
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} values, got {value!r}")
        return tuple(coerce(v, a, key) for v, a in zip(value, args, strict=True))
    raise ConfigError(f"{key}: unsupported field type {tp}")  # pragma: no cover - config bug


def parse_cli_value(raw: str, hint: Any) -> Any:
    """A command-line value: strings stay raw (``none`` → None); the rest parse as a TOML value."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    if raw.lower() in ("none", "null") and type(None) in args:
        return None
    stringy = str in args or any(isinstance(a, type) and issubclass(a, Enum) for a in args)
    if stringy and not raw.startswith(('"', "'")):
        return raw
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def suggest(name: str, candidates: list[str] | tuple[str, ...]) -> str:
    """``"; did you mean 'x'?"`` for the closest candidates (``difflib``, at most 3), else ``""``."""
    close = difflib.get_close_matches(name, list(candidates), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def unknown_key(root: type[Any], section: str, name: str) -> str:
    """One line for the unknown key ``name`` of ``[section]``: the closest keys of the section, or
    the sections that do hold ``name`` (``rollout.kl_coef`` → ``ppo.kl_coef``), and where the
    full list is (``--help-config``), instead of every key of the section."""
    own = suggest(name, sorted(field_types(root, section)))
    if not own:
        elsewhere = [f"{s}.{name}" for s in section_names(root) if name in field_types(root, s)]
        own = f"; did you mean {' or '.join(elsewhere)}?" if elsewhere else ""
    return f"unknown key {name!r} in [{section}]{own} (refppo train --help-config {section} lists its keys)"


def _bare_key(root: type[Any], item: str, key: str) -> str:
    """``--set KEY=VALUE`` without a section: the sections holding ``KEY`` (or a close one)."""
    full = [f"{s}.{k}" for s in section_names(root) for k in field_types(root, s)]
    holders = [f for f in full if f.split(".", 1)[1] == key]
    hint = f"; did you mean {' or '.join(holders)}?" if holders else suggest(key, full)
    return f"--set {item!r}: expected SECTION.KEY=VALUE (e.g. ppo.cliprange=0.1){hint}"


def apply_overrides(
    root: type[Any], data: dict[str, Any], overrides: list[str] | tuple[str, ...]
) -> dict[str, Any]:
    """``data`` (plain, as :func:`to_plain` gives it) with the ``SECTION.KEY=VALUE`` overrides
    applied in order (values: :func:`parse_cli_value`); changed in place and returned."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected SECTION.KEY=VALUE, e.g. ppo.cliprange=0.1")
        path = key.strip().split(".")
        if len(path) == 1:
            raise ConfigError(_bare_key(root, item, path[0]))
        if len(path) != 2:
            raise ConfigError(
                f"--set {item!r}: expected SECTION.KEY with one dot; sections: {section_names(root)}"
            )
        section, name = path
        if section not in data:
            raise ConfigError(
                f"unknown config section {section!r}{suggest(section, section_names(root))} "
                f"(valid sections are {section_names(root)})"
            )
        hint = field_types(root, section).get(name)
        if hint is None:
            raise ConfigError(unknown_key(root, section, name))
        data[section][name] = parse_cli_value(raw.strip(), hint)
    return data


__all__ = [
    "apply_overrides",
    "coerce",
    "field_types",
    "flat_fields",
    "from_plain",
    "parse_cli_value",
    "section_names",
    "sub_hints",
    "to_plain",
]
