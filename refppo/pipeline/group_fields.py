"""The helpers of the convention groups' fields (:mod:`refppo.pipeline.groups`,
:mod:`refppo.pipeline.groups_gate`): the flat-key metadata and the parsing of enum fields."""

from __future__ import annotations

import typing
from dataclasses import Field, fields
from enum import Enum
from typing import Any

from refppo.conventions import parse


def flat_key(name: str | None = None, *, omit: bool = False, config: bool = True) -> dict[str, Any]:
    """A group field's metadata: its flat key ``name`` (None: the field's own name); ``omit``: left out
    of :meth:`Convention.to_dict` while at its default (keys added after the golden cases in
    ``spec/golden`` were written, so those stored dicts stay exact); ``config`` False: not a key of
    the trainer's ``[ppo]`` section (how an observed trainer logs or masks, not a choice of refppo's)."""
    return {"key": name, "omit": omit, "config": config}


def _parse_enums(obj: Any) -> None:
    """Each enum field of the frozen dataclass ``obj`` (or ``Enum | None``) parsed from its name."""
    for f, cls in _enum_fields(type(obj)):
        value = getattr(obj, f.name)
        if value is not None:
            object.__setattr__(obj, f.name, parse(cls, value, what=f.metadata.get("key") or f.name))


_ENUM_FIELDS: dict[type[Any], tuple[tuple[Field[Any], type[Enum]], ...]] = {}


def _enum_fields(cls: type[Any]) -> tuple[tuple[Field[Any], type[Enum]], ...]:
    """The enum-typed fields of the dataclass ``cls`` and their enums (cached per class)."""
    if cls in _ENUM_FIELDS:
        return _ENUM_FIELDS[cls]
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        tp = hints[f.name]
        args = typing.get_args(tp) or (tp,)
        enums = [a for a in args if isinstance(a, type) and issubclass(a, Enum)]
        if enums:
            out.append((f, enums[0]))
    _ENUM_FIELDS[cls] = tuple(out)
    return _ENUM_FIELDS[cls]


__all__ = ["flat_key"]
