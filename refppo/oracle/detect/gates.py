"""The rejection gates of ``--detect``'s correction step: ``rollout_rs*`` walked, thresholds solved.

On a dump with ``rollout_logprobs`` the correction step (:mod:`refppo.oracle.detect.correction`)
adds these settings to its walk: each gate family ``(rollout_rs, rollout_rs_stat, rollout_rs_order,
rollout_rs_reduce)`` of :data:`GATE_FAMILIES` on each base weight of :data:`BASE_WEIGHTS` (no
``rollout_is``: verl's ``rollout_rs`` alone; the raw token weight: AReaL 1.0.4 ``rejection_sampling``
and OpenRLHF 0.11.2's ``seq`` gate, which gate the unbounded ratio; the row's geometric-mean weight:
AReaL's sequence-level ``metric: ratio`` gates, e.g. its veto ``agg: max``), with the thresholds
solved from the data. As the caps of ``rollout_is``, a gate's weight is the stage's own output; the
policy step's ``pg_loss`` (and the re-check's gradient) decide.

The solver (exact, on stage outputs): with the gate's statistic ``u_t`` (the token's, or its row's:
:func:`refppo.pipeline.correction.gate_statistic_of`), the base weight ``w_t`` and ``c_t = a_t·ℓ_t``
(the policy stage's unweighted loss times the aggregation's weights, as
:func:`refppo.oracle.detect.correction.solve_caps`)::

    upper H        pg(H) = Σ_{t: u_t ≤ H} c_t·w_t        a step function of H
    lower L        pg(L) = Σ_{t: u_t ≥ L} c_t·w_t
    ratio [1/H, H] pg(H) = Σ_{t: max(u_t, 1/u_t) ≤ H} c_t·w_t

Each fixes the threshold to an interval between two consecutive observed statistics; the value with
the fewest significant digits in it is proposed (:func:`~refppo.oracle.detect.correction.nicest_in`),
and the evidence report calls it fixed only to that interval, never determined
(:data:`refppo.oracle.detect.evidence.GATE_BOUNDS`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from refppo.errors import RefPPOError
from refppo.oracle.detect.adv_states import loss_terms
from refppo.oracle.detect.groups import Group
from refppo.oracle.detect.search import Search
from refppo.oracle.detect.states import AdvState
from refppo.pipeline.correction import gate_statistic_of
from refppo.pipeline.settings import Convention
from refppo.rollout_conventions import ISLevel, RSOrder, RSReduce, RSStat

GateFamily = tuple[ISLevel, RSStat, RSOrder, RSReduce]
GATE_FAMILIES: tuple[GateFamily, ...] = tuple(
    [(ISLevel.TOKEN, st, od, RSReduce.MEAN) for st in RSStat for od in RSOrder]
    + [(ISLevel.SEQUENCE, st, od, rd) for st in RSStat for od in RSOrder for rd in RSReduce]
)
"""Every gate: token level (the reduction unread) and sequence level × reduction, each statistic
and order."""
_RAW = {"rollout_is_mode": "truncate", "rollout_is_low": None, "rollout_is_high": None}
BASE_WEIGHTS: tuple[dict[str, Any], ...] = (
    {"rollout_is": None},
    {"rollout_is": "token", **_RAW},
    {"rollout_is": "sequence", "rollout_is_agg": "geometric", **_RAW},
)
"""The weights a gate multiplies: none (verl's ``rollout_rs`` without ``rollout_is``), the raw token
weight (AReaL, OpenRLHF), the row's geometric-mean weight ``exp(mean_t log(π^prox/π^beh))`` on
each of its tokens (AReaL 1.0.4 ``areal/utils/functional/functional.py::apply_rejection_sampling``:
``level: sequence`` with ``metric: ratio`` sets ``behave_imp_weight`` to it, whatever ``agg``; the
sequence-level ratio veto ``agg: max`` multiplies it)."""
_T, _S = ISLevel.TOKEN, ISLevel.SEQUENCE
_P, _B = RSOrder.PROXIMAL, RSOrder.BEHAVIOUR
NAMED_GATES: tuple[tuple[GateFamily, float | None, float | None], ...] = (
    ((_T, RSStat.RATIO, _P, RSReduce.MEAN), 0.5, 2.0),
    ((_S, RSStat.RATIO, _P, RSReduce.MEAN), 0.5, 2.0),
    ((_S, RSStat.RATIO, _B, RSReduce.MAX), None, 2.0),
    ((_T, RSStat.K2, _B, RSReduce.MEAN), None, 0.08),
    ((_S, RSStat.K3, _B, RSReduce.MEAN), None, 0.05),
    ((_S, RSStat.K1, _P, RSReduce.SUM), -0.5, 0.5),
)
"""Gates walked without solving, on each base weight: the band ``[0.5, 2]`` of the token ratio and of
the row's geometric-mean ratio (verl's ``"0.5_2.0"`` form; OpenRLHF's ``seq`` gate); the veto "no
token with ``w_t < 0.5``" (``max_t π^beh/π^prox ≤ 2``); verl's ``token_k2`` at 0.08 and ``seq_mean_k3`` at
0.05, AReaL's signed ``kl_k1`` sum in ``[−0.5, 0.5]`` (the thresholds the core was checked at against
those peers: ``tools/peers/rollout_correction.py``). Every statistic, order and reduction is walked."""
MAX_SOLVED = 4
"""Solved thresholds kept per gate family, base weight and bound form."""


def gate_keys(fam: GateFamily, low: float | None, high: float | None) -> dict[str, Any]:
    level, stat, order, reduce = fam
    return {
        "rollout_rs": level.value, "rollout_rs_stat": stat.value, "rollout_rs_order": order.value,
        "rollout_rs_reduce": reduce.value, "rollout_rs_low": low, "rollout_rs_high": high,
    }  # fmt: skip


Intervals = Callable[[Tensor, Tensor, float, float], list[tuple[float, float]]]
""":func:`refppo.oracle.detect.correction.step_intervals` (passed in: that module calls this one)."""
Nicest = Callable[[float, float], float | None]
""":func:`refppo.oracle.detect.correction.nicest_in`."""


def nicest_signed(nicest_in: Nicest, a: float, b: float) -> float:
    if a > 0:
        return nicest_in(a, b) or a
    if b < 0:
        got = nicest_in(-b, -a)
        return -got if got is not None else a
    return 0.0 if a < 0.0 < b else a


def _thresholds(
    u: Tensor, cw: Tensor, target: float, tol: float, ratio: bool, solvers: tuple[Intervals, Nicest]
) -> list[tuple[Any, Any]]:
    """``(low, high)`` pairs whose gate reproduces ``target`` (module docstring)."""
    step_intervals, nicest_in = solvers
    out: list[tuple[Any, Any]] = []
    for a, b in step_intervals(u, cw, target, tol)[:MAX_SOLVED]:
        out.append((None, nicest_signed(nicest_in, a, b)))
    for a, b in step_intervals(-u, cw, target, tol)[:MAX_SOLVED]:
        out.append((-nicest_signed(nicest_in, a, b), None))
    if ratio:
        pos = u.clamp(min=1e-300)
        for a, b in step_intervals(torch.maximum(pos, 1.0 / pos), cw, target, tol)[:MAX_SOLVED]:
            cap = nicest_signed(nicest_in, a, b)
            out.append((float(f"{1.0 / cap:.12g}"), cap))
    return out


def _base_weight(s: Search, base: dict[str, Any]) -> Tensor | None:
    q = {"old_logprobs": s.t["old_logprobs"], "rollout_logprobs": s.t["rollout_logprobs"], "mask": s.m}
    try:
        st = s.setting("rollout_correction", **base, rollout_rs=None)
        w: Tensor | None = s.evaluate("rollout_correction", q, st)["is_weights"]
    except RefPPOError:
        return None
    return torch.where(s.m, 1.0, 0.0).double() if w is None else w.double()


@dataclass(frozen=True)
class Dropped:
    """The ``rollout_rs_effect=drop_mask`` gate a search walks under from its returns step on
    (:mod:`refppo.oracle.detect.drop_gate`): the correction step then walks weights only."""

    mask: Tensor
    """``m' = m ∧ keep`` ``[B, T]`` (the original batch's rows)."""
    keys: tuple[dict[str, Any], ...]
    """Its equivalent gate settings, read off the data (empty: the checked setting's gate)."""


DROPPED: weakref.WeakKeyDictionary[Search, Dropped] = weakref.WeakKeyDictionary()
"""The gate of each search under one (set by :func:`refppo.oracle.detect.drop_gate.regate`)."""


def dropped(s: Search) -> Dropped | None:
    """The drop_mask gate ``s`` walks under since its returns step (None: none)."""
    return DROPPED.get(s)


def correction_on(s: Search, upd: dict[str, Any]) -> bool:
    """Whether a setting (the checked one updated by ``upd``) weights the surrogate: ``rollout_is``
    or ``rollout_rs`` on (a ``drop_mask`` gate rewrites the mask instead: not a weight)."""
    g = s.base.conv.gate
    merged = {"rollout_is": s.base.conv.rollout.level, "rollout_rs": g.level, **upd}
    effect = upd.get("rollout_rs_effect", g.effect.value)
    gate = merged["rollout_rs"] is not None and effect != "drop_mask"  # drop_mask: the mask, no weight
    return merged["rollout_is"] is not None or gate


def gate_settings(
    s: Search, groups: list[Group[AdvState]], solvers: tuple[Intervals, Nicest]
) -> list[dict[str, Any]]:
    """:data:`NAMED_GATES`, then the gate settings whose solved thresholds reproduce ``pg_loss``
    under the checked policy setting, per base weight and gate family (module docstring); each
    solved threshold is recorded (:meth:`Search.propose_value`). ``solvers``: the correction step's
    ``(step_intervals, nicest_in)``."""
    t, m = s.t, s.m
    if "pg_loss" not in t or "logprobs" not in t or "rollout_logprobs" not in t:
        return []
    target = float(t["pg_loss"])
    tol = s.tol.of(abs(target))
    q = {"old_logprobs": t["old_logprobs"], "rollout_logprobs": t["rollout_logprobs"], "mask": m}
    stats = {
        fam: gate_statistic_of(q, Convention.of(**gate_keys(fam, None, None)))[m].double()
        for fam in GATE_FAMILIES
    }
    bases = [(b, w[m]) for b in BASE_WEIGHTS if (w := _base_weight(s, b)) is not None]
    out: list[dict[str, Any]] = [
        {**base, **gate_keys(fam, lo, hi)} for base in BASE_WEIGHTS for fam, lo, hi in NAMED_GATES
    ]
    for _st, _dual, _agg, c in loss_terms(s, groups):
        for base, w in bases:
            for fam, u in stats.items():
                for lo, hi in _thresholds(u, c * w, target, tol, fam[1] is RSStat.RATIO, solvers):
                    out.append({**base, **gate_keys(fam, lo, hi)})
                    s.propose_value("rollout_rs_low", lo)
                    s.propose_value("rollout_rs_high", hi)
    return list({tuple(sorted(d.items())): d for d in out}.values())


__all__ = [
    "BASE_WEIGHTS",
    "DROPPED",
    "GATE_FAMILIES",
    "NAMED_GATES",
    "Dropped",
    "correction_on",
    "dropped",
    "gate_keys",
    "gate_settings",
    "nicest_signed",
]
