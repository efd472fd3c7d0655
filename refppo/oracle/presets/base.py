"""The preset's type: a peer's fixed convention keys and default hyperparameters, each value with
its source, and the rule giving its KL clamps (:mod:`refppo.oracle.presets.kl_clamps`).

Each peer module (:mod:`refppo.oracle.presets.verl`, ...) writes its values as ``(value, source)``
pairs (:data:`Sourced`), the source naming the peer's repository file and function or config key;
:func:`make_preset` splits them into the :class:`Preset`'s plain dicts and its
:attr:`Preset.value_sources`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from refppo.oracle.presets.kl_clamps import KlClamps

Sourced = tuple[Any, str]
"""``(value, source)``: a preset's value and where the peer's code has it."""

Variant = dict[str, Sourced]
"""A critic-free variant: ``{convention key: (value, source)}``
(:data:`refppo.oracle.presets.registry.VARIANTS`)."""


@dataclass(frozen=True)
class Preset:
    """One peer: fixed convention keys, a KL-clamp rule, default hyperparameters, sources."""

    name: str
    conventions: dict[str, Any]
    hparams: dict[str, Any]
    kl_clamps: Callable[[str], KlClamps]
    sources: tuple[str, ...] = field(default_factory=tuple)
    """The peer's files and functions the preset as a whole restates."""
    value_sources: dict[str, str] = field(default_factory=dict)
    """Every convention key and hyperparameter -> where the peer's code sets that value."""


def make_preset(
    name: str,
    conventions: dict[str, Sourced],
    hparams: dict[str, Sourced],
    kl_clamps: Callable[[str], KlClamps],
    sources: tuple[str, ...],
) -> Preset:
    """A :class:`Preset` from ``(value, source)`` pairs (the keys' order kept)."""
    return Preset(
        name=name,
        conventions={k: v for k, (v, _) in conventions.items()},
        hparams={k: v for k, (v, _) in hparams.items()},
        kl_clamps=kl_clamps,
        sources=sources,
        value_sources={k: src for k, (_, src) in {**conventions, **hparams}.items()},
    )


__all__ = ["Preset", "Sourced", "Variant", "make_preset"]
