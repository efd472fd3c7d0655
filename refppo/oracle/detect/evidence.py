"""What a dump can say about a convention key or a solved constant: its evidence, from the stage table.

A key (or hyperparameter) ``k`` can change the outputs ``q`` whose upstream stages read it (for the
part of a stage's reads and keys an output depends on, and for the two gradients, the loss terms
each differentiates); the dumped ones among them are its evidence, and
each contributes its number of independent observations: 1 for a 0-dim scalar (``pg_loss``), the
number of valid response tokens for a ``[B, T]`` tensor (``advantages``, ``grad_logprobs``).

A constant solved from the data (``cliprange``, ``dual_clip``, the KL clamps, the score map) is one
free parameter. Free parameters are counted per class of listed conventions (a class fits only the
constants its members use: :func:`class_evidence`). When the solved constants of a class that share
an evidence set number ``k`` and their evidence holds ``n`` observations, each gets a label
(:attr:`Evidence.label`): ``n < k`` is *consistent, not determined* (underdetermined); ``n = k`` is
*fixed by one equation* (``k`` equations for ``k`` constants: any value fits such a system: a fit,
not a test); only ``n > k`` with a single value that reproduces the dump is *determined* (several
values: consistent, not determined). A walked key the dump leaves open (several of its values
reproduce the dump) is consistent, not determined. Nothing
is ever called determined with fewer observations than free parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from refppo.core.checks import count_true
from refppo.dump.load import Dump
from refppo.pipeline.stages import OUTPUTS, STAGES

GRADIENT_TERMS: dict[str, tuple[str, ...]] = {
    "grad_logprobs": ("pg_loss", "entropy_loss", "kl_loss"),
    "grad_values": ("vf_loss",),
}
"""The terms of ``loss = pg + c_v·vf − c_e·H + β·kl_loss`` (spec/ppo.md, the total) that each gradient
differentiates: ``∂loss/∂ℓ`` only the policy, entropy and KL terms, ``∂loss/∂V`` only the value term."""
GRADIENT_COEFS = {"grad_logprobs": ("ent_coef", "kl_coef"), "grad_values": ("vf_coef",)}


@functools.cache
def _keys_of(q: str, given: frozenset[str] = frozenset()) -> frozenset[str]:
    """The convention keys and hyperparameters that can change output ``q`` through the stage table
    (each stage's :attr:`Stage.output_reads` and :attr:`Stage.output_keys` where it has them), with
    the quantities ``given`` held fixed (a dumped quantity that matched: nothing upstream of it can
    change ``q`` through it)."""
    if q in GRADIENT_TERMS:
        return frozenset(GRADIENT_COEFS[q]).union(*(_keys_of(t, given) for t in GRADIENT_TERMS[q]))
    made = [s for s in STAGES if q in s.makes]
    if not made:
        return frozenset()  # an input of the step
    s = made[0]
    own = s.output_keys.get(q, (*s.keys, *s.hparams))
    reads = [r for r in s.output_reads.get(q, s.reads) if r != q and r not in given]
    return frozenset(own).union(*(_keys_of(r, given) for r in reads))


def pinned_by(key: str, given: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """The outputs (in report order) that ``key`` — a flat convention key or a hyperparameter — can
    change (with the quantities ``given`` held fixed)."""
    return tuple(q for q in OUTPUTS if key in _keys_of(q, given))


def first_undumped(key: str, dumped: frozenset[str]) -> str | None:
    """The first output (report order) that ``key`` can change with the ``dumped`` quantities held
    fixed and that the dump lacks: what to dump to tell its values apart (None: every output it can
    change is dumped)."""
    return next((q for q in pinned_by(key, dumped) if q not in dumped), None)


def observations(dump: Dump, name: str) -> int:
    """Independent numbers the dumped ``name`` holds: 1 for a scalar, the valid tokens of a ``[B, T]``."""
    t = dump.tensors[name]
    return 1 if t.dim() == 0 else int(count_true(dump.mask))


DETERMINED = "determined"
FIT = "fixed by one equation"
OPEN = "consistent, not determined"


@dataclass(frozen=True)
class Evidence:
    """What fixes one key or solved constant in one dump."""

    key: str
    dumped: dict[str, int]
    """The dumped outputs it can change, with their observations."""
    missing: tuple[str, ...]
    """The outputs the dump lacks that it can change with the dumped outputs held fixed (what to
    dump to pin it; empty: on these inputs every option gives the dumped values)."""
    free: int = 0
    """Solved constants sharing this evidence (0 for a key that is walked, not solved)."""
    values: int = 0
    """How many solved values of it reproduce the dump."""
    interval: bool = False
    """A bound of a masking correction (:data:`MASK_BOUNDS` under ``rollout_is_mode=mask``) or a
    gate's threshold (:data:`GATE_BOUNDS` with ``rollout_rs`` on): it keeps or drops tokens, so
    every value between two observed weights (statistics) gives the same step: fixed only to an
    interval, never determined."""

    @property
    def n(self) -> int:
        return sum(self.dumped.values())

    @property
    def determined(self) -> bool:
        """More observations than free parameters and one value (never for a walked key)."""
        return self.free > 0 and self.n > self.free and self.values == 1 and not self.interval

    @property
    def label(self) -> str:
        """``determined`` (:attr:`determined`), ``fixed by one equation`` (as many observations as
        free parameters: a fit) or ``consistent, not determined`` (fewer observations, several
        values that reproduce the dump, or a walked key the dump leaves open)."""
        if self.determined:
            return DETERMINED
        return FIT if self.free > 0 and self.n == self.free and not self.interval else OPEN

    def json(self) -> dict[str, Any]:
        return {
            "observations": self.n, "from": self.dumped, "free_parameters": self.free,
            "values": self.values, "determined": self.determined, "label": self.label,
            "interval": self.interval,
            "to_pin_it_dump": list(self.missing),
        }  # fmt: skip

    def text(self) -> str:
        src = ", ".join(f"{q}: {n} {_kind(q, n)}" for q, n in self.dumped.items())
        what = f"{self.n} observation(s) ({src or 'nothing dumped'})"
        if self.free:
            what += f" for {self.free} solved constant(s): {self.label}"
            if self.n < self.free:
                what += " (underdetermined: fewer observations than constants)"
            elif self.n == self.free:
                eqs = "" if self.n == 1 else f" ({self.n} equations for {self.free} constants)"
                what += f"{eqs}: a fit, not a test"
            elif self.values > 1:
                what += f" ({self.values} values reproduce the dump)"
            if self.interval and self.key in GATE_BOUNDS:
                what += " (a gate threshold: fixed only to the interval between two observed statistics)"
            elif self.interval:
                what += " (a mask bound: fixed only to the interval between two observed weights)"
        if self.missing and not self.determined:
            what += f"; dump {', '.join(self.missing[:3])} to pin it"
        return f"{self.key}: {what}"


def _kind(q: str, n: int) -> str:
    """What one observation of output ``q`` is: a scalar, a token's value, a token's gradient entry."""
    return "scalar" if n == 1 else ("gradient entries" if q in GRADIENT_TERMS else "tokens")


def _sets(dump: Dump, k: str) -> tuple[dict[str, int], tuple[str, ...]]:
    """The dumped outputs ``k`` can change with their observations, and what to dump to pin it (the
    outputs it can still change with every dumped quantity held fixed)."""
    dumped = frozenset(q for q in OUTPUTS if dump.has(q))
    free = pinned_by(k, dumped)
    obs = {q: observations(dump, q) for q in pinned_by(k) if q in dumped}
    return obs, tuple(q for q in free if q not in dumped)


MASK_BOUNDS = ("rollout_is_low", "rollout_is_high")
"""The correction's bounds: under ``rollout_is_mode=mask`` a step function of the observed weights."""


GATE_BOUNDS = ("rollout_rs_low", "rollout_rs_high")
"""The rejection gate's thresholds: a gate keeps or drops tokens, a step function of the observed
statistics (whenever ``rollout_rs`` is on)."""


Differing = Mapping[str, list[Any]]


def _values(k: str, conv: Mapping[str, Any], differing: Differing) -> list[Any]:
    return [conv.get(k), *differing.get(k, [])]


def _masked(k: str, conv: Mapping[str, Any], differing: Differing) -> bool:
    if k in GATE_BOUNDS:
        return any(v is not None for v in _values("rollout_rs", conv, differing))
    return k in MASK_BOUNDS and "mask" in _values("rollout_is_mode", conv, differing)


def uses(
    conv: Mapping[str, Any], solved: Mapping[str, list[Any]], differing: Differing | None = None
) -> list[str]:
    """The solved constants a class uses (``conv``: its representative, ``differing``: the values
    its other members take): some member's value of the key is one the solver read off."""
    d = differing or {}
    return [k for k, vs in solved.items() if any(v is not None and v in vs for v in _values(k, conv, d))]


def _free(on: list[str], sets: Mapping[str, tuple[dict[str, int], tuple[str, ...]]], k: str) -> int:
    """Solved constants among ``on`` that share ``k``'s dumped outputs (``k`` included)."""
    return sum(1 for j in on if set(sets[j][0]) == set(sets[k][0]))


def evidence(
    dump: Dump,
    keys: list[str],
    solved: dict[str, list[Any]],
    classes: Sequence[tuple[Mapping[str, Any], Differing]] | None = None,
) -> list[Evidence]:
    """The :class:`Evidence` of each of ``keys`` (walked keys the dump does not pin down) and of each
    solved constant, with the number of free parameters fitted beside it to the same dumped outputs.

    Free parameters are counted per class of listed conventions (``classes``: each class's
    representative and its differing keys; :func:`class_evidence`): a constant's count is the
    largest among the classes that use it (never fewer than any convention listed with it fits).
    Without ``classes`` (or where no class uses it), every solved constant that shares its outputs
    counts."""
    out = []
    sets = {k: _sets(dump, k) for k in solved}
    reps = list(classes or [])
    per_class = [uses(c, solved, d) for c, d in reps]
    for k, (obs, missing) in sets.items():
        free = max((_free(on, sets, k) for on in per_class if k in on), default=_free(list(solved), sets, k))
        masked = any(_masked(k, *cd) for cd, on in zip(reps, per_class, strict=True) if k in on)
        out.append(Evidence(k, obs, missing, free, len(solved[k]), masked))
    out += [Evidence(k, *_sets(dump, k)) for k in keys if k not in solved]
    return out


def class_evidence(
    dump: Dump, conv: Mapping[str, Any], differing: Mapping[str, list[Any]], solved: Mapping[str, list[Any]]
) -> list[Evidence]:
    """The :class:`Evidence` of the solved constants one class uses (``conv``: its representative;
    ``differing``: the keys whose values differ among its members): the free parameters are that
    class's own constants sharing the dumped outputs, the values those its members take."""
    on = uses(conv, solved, differing)
    sets = {k: _sets(dump, k) for k in on}
    return [
        Evidence(
            k, *sets[k], _free(on, sets, k), len(differing.get(k, [conv.get(k)])), _masked(k, conv, differing)
        )
        for k in on
    ]


__all__ = [
    "DETERMINED",
    "FIT",
    "GATE_BOUNDS",
    "MASK_BOUNDS",
    "OPEN",
    "Evidence",
    "class_evidence",
    "evidence",
    "first_undumped",
    "observations",
    "pinned_by",
    "uses",
]
