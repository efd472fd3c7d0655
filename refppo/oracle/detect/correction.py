"""The correction step of ``--detect``: the rollout_correction stage's keys walked, its caps solved.

On a dump with ``rollout_logprobs`` the step walks the correction off and on: ``rollout_is`` token
or sequence, ``rollout_is_agg`` product or geometric (sequence level), ``rollout_is_mode`` truncate
or mask, and the bounds ``(rollout_is_low, rollout_is_high)`` of :data:`NAMED_BOUNDS` together with
the ones :func:`solve_caps` reads off ``pg_loss``. Each option's weight ``w'`` is the stage's own
output (``BY_NAME["rollout_correction"].run`` through :meth:`Search.evaluate`, once per setting: it
reads no advantage) and rides on the group's :class:`~refppo.oracle.detect.states.AdvState`; the
policy step multiplies its per-token loss by it. The weight is not a dumped quantity, so this step
checks nothing itself: the policy step's ``pg_loss`` (and the re-check's ``grad_logprobs``) decide.
For that reason its solver runs before its walk (not after a failed one): it proposes, the
pipeline confirms.

A dump without ``rollout_logprobs`` is not walked (the stage cannot run on it: the correction stays
at the checked setting, off); when its policy step then reproduces nothing, a note says that a
correction could not be tried and why (a matching dump's report is unchanged).

The solver (exact, on stage outputs): under the checked policy setting (its dual clip, none, or
verl's 3), ``ℓ_t`` is the policy
stage's unweighted per-token loss and ``a_t = ∂pg_loss/∂ℓ_t`` the policy_agg stage's weights (every
aggregation is linear), so with the raw weight ``w_t`` (the stage with no bounds) and ``c_t = a_t·ℓ_t``

    truncate, upper C    pg(C) = Σ_t c_t·min(v_t, C),  v_t = max(w_t, C_low)     hinge sum in C
    truncate, lower L    pg(L) = Σ_t c_t·max(u_t, L),  u_t = min(w_t, C_high)    hinge sum in −L
    mask, upper C        pg(C) = Σ_{t: w_t ≤ C} c_t·w_t  (tokens below C_low out)  a step function
    mask, lower L        pg(L) = Σ_{t: w_t ≥ L} c_t·w_t  (tokens above C_high out)
    mask, [1/C, C]       pg(C) = Σ_{t: max(w_t, 1/w_t) ≤ C} c_t·w_t

with breakpoints at the observed weights. A hinge sum is solved exactly
(:func:`refppo.oracle.detect.solve.solve_min_hinge`); a step function fixes ``C`` only to an interval
between two consecutive observed weights, and the value with the fewest significant digits in it
is proposed (:func:`nicest_in`). One scalar fixes one bound: the other is taken from the checked
setting, :data:`NAMED_BOUNDS`, none, or its reciprocal (mask). How many observations fix each solved
bound is the evidence report's (:mod:`refppo.oracle.detect.evidence`: ``pg_loss``, ``loss`` and,
when dumped, ``grad_logprobs`` per token, through the re-check).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from refppo.errors import RefPPOError
from refppo.oracle.detect.adv_states import loss_terms
from refppo.oracle.detect.correction_grad import (
    interval_note,
    kept_range,
    mask_consistent,
    readings,
    truncation_caps,
)
from refppo.oracle.detect.gates import correction_on, dropped, gate_settings
from refppo.oracle.detect.groups import Group, Option
from refppo.oracle.detect.search import Search
from refppo.oracle.detect.solve import solve_min_hinge
from refppo.oracle.detect.states import AdvState, digest
from refppo.pipeline.stages import BY_NAME
from refppo.rollout_conventions import ISAgg, ISLevel, ISMode

Bounds = tuple[float | None, float | None]
NAMED_BOUNDS: tuple[Bounds, ...] = ((None, None), (None, 2.0), (None, 3.0), (0.5, 2.0))
"""The bounds walked without solving: none (the raw weight); verl 0.9.1's default
``rollout_is_threshold`` 2.0 (``RolloutCorrectionConfig``, upper truncation); TRL 1.16.0's default
``clip_max`` 3.0 (:data:`refppo.oracle.check.alternatives.CORRECTION_BUNDLES`); the two-sided band
``[0.5, 2]`` (verl's ``"lo_hi"`` threshold form with the reciprocal of its default)."""
FAMILIES: tuple[tuple[ISLevel, ISAgg | None], ...] = (
    (ISLevel.TOKEN, None),
    (ISLevel.SEQUENCE, ISAgg.PRODUCT),
    (ISLevel.SEQUENCE, ISAgg.GEOMETRIC),
)
"""``(rollout_is, rollout_is_agg)`` walked (the aggregation is read at sequence level only)."""
NAMED_DUAL = 3.0
"""verl's dual-clip constant ``clip_ratio_c`` (the policy step walks it too): the caps are solved
under the checked dual clip, none and this one (``ℓ`` differs where the dual clip binds)."""
MAX_SOLVED = 48
"""Solved bound pairs kept per family and mode."""
OFF: dict[str, Any] = {"rollout_is": None, "rollout_rs": None}


def nicest_in(a: float, b: float) -> float | None:
    """The number with the fewest significant digits strictly inside ``(a, b)`` (``0 < a``), the
    smallest such; None when the interval is empty. A trainer configures round numbers."""
    if not (0.0 < a < b) or not math.isfinite(b):
        return None
    for d in range(1, 13):
        step = 10.0 ** (math.floor(math.log10(b)) - d + 1)
        k = a / step
        k = round(k) if abs(k - round(k)) < 1e-9 else math.floor(k)  # 1.2/0.1 = 11.999…: 12
        r = float(f"{(k + 1) * step:.{d + 1}g}")
        if a < r < b:
            return r
    return None


def step_intervals(u: Tensor, coef: Tensor, target: float, tol: float) -> list[tuple[float, float]]:
    """The intervals ``[u_(k), u_(k+1))`` of ``x`` on which ``Σ_{i: u_i ≤ x} coef_i`` is within
    ``tol`` of ``target`` (``u`` sorted ascending, consecutive distinct values; neither the empty
    sum below every ``u`` nor the full sum above them: a bound that drops or keeps every token is
    the off / unbounded option, walked already)."""
    us, order = torch.sort(u.to(torch.float64))
    cum = torch.cumsum(coef.to(torch.float64)[order], 0)
    out: list[tuple[float, float]] = []
    for k in range(us.numel() - 1):
        lo, hi = float(us[k]), float(us[k + 1])
        if hi > lo and abs(float(cum[k]) - target) <= tol:
            out.append((lo, hi))
    return out


def _truncate_caps(
    w: Tensor, c: Tensor, target: float, lows: list[float | None], highs: list[float | None]
) -> list[Bounds]:
    out: list[Bounds] = []
    for lo in lows:  # the upper cap, the lower bound fixed
        v = w if lo is None else torch.clamp(w, min=lo)
        vmin, vmax = float(v.min()), float(v.max())
        for x in solve_min_hinge(v, c, 0.0, target, vmin, vmax):
            if x < vmax:  # a cap at or above every weight acts on none: the unbounded option
                out.append((lo, _round(x)))
    for hi in highs:  # the lower bound, the upper cap fixed: max(u, L) = −min(−u, −L)
        u = w if hi is None else torch.clamp(w, max=hi)
        umin, umax = float(u.min()), float(u.max())
        for x in solve_min_hinge(-u, -c, 0.0, target, -umax, -umin):
            if -x > umin:
                out.append((_round(-x), hi))
    return out


def _mask_caps(
    w: Tensor, c: Tensor, target: float, tol: float, lows: list[float | None], highs: list[float | None]
) -> list[Bounds]:
    out: list[Bounds] = []
    cw = c * w
    for lo in lows:  # the upper bound: tokens below the lower bound are out
        keep = torch.ones_like(w, dtype=torch.bool) if lo is None else w >= lo
        for a, b in step_intervals(w[keep], cw[keep], target, tol):
            out.append((lo, nicest_in(a, b) or a))
    for hi in highs:  # the lower bound: Σ_{w ≥ L} in x = −L
        keep = torch.ones_like(w, dtype=torch.bool) if hi is None else w <= hi
        for a, b in step_intervals(-w[keep], cw[keep], target, tol):
            lo_b = nicest_in(-b, -a) or -a  # L in (−b, −a]
            out.append((lo_b, hi))
    for a, b in step_intervals(torch.maximum(w, 1.0 / w), cw, target, tol):  # the band [1/C, C]
        cap = nicest_in(a, b) or a
        out.append((float(f"{1.0 / cap:.12g}"), cap))
    return out


def _round(x: float) -> float:
    """A solved hinge root rounded to the fewest digits within 1e-6 relative (rounding noise of
    the trainer), else 9 significant digits."""
    for d in range(1, 9):
        r = float(f"{x:.{d}g}")
        if abs(r - x) <= 1e-6 * abs(x):
            return r
    return float(f"{x:.9g}")


def _upd(s: Search, level: ISLevel, agg: ISAgg | None, mode: ISMode, b: Bounds) -> dict[str, Any]:
    """An option's keys: the aggregation at the checked value where it is not read (token level)."""
    ag = agg if agg is not None else s.base.conv.rollout.agg
    return {
        "rollout_is": level.value, "rollout_is_agg": ag.value, "rollout_is_mode": mode.value,
        "rollout_is_low": b[0], "rollout_is_high": b[1],
    }  # fmt: skip


class _Weights:
    """The rollout_correction stage's ``w'`` per setting, memoised (it reads no advantage):
    ``(digest, weight)``; None for a setting the stage refuses."""

    def __init__(self, s: Search) -> None:
        self.s = s
        self.q = {
            "old_logprobs": s.t["old_logprobs"],
            "rollout_logprobs": s.t["rollout_logprobs"],
            "mask": s.m,
        }
        self.memo: dict[tuple[Any, ...], tuple[bytes, Tensor] | None] = {}

    def of(self, upd: dict[str, Any]) -> tuple[bytes, Tensor] | None:
        k = tuple(sorted(upd.items()))
        if k not in self.memo:
            try:
                st = self.s.setting("rollout_correction", **upd)
                w: Tensor = self.s.evaluate("rollout_correction", self.q, st)["is_weights"]
                self.memo[k] = (digest(w), w)
            except RefPPOError:
                self.memo[k] = None
        return self.memo[k]


def solve_caps(
    s: Search, groups: list[Group[AdvState]], weights: _Weights, front: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """The correction settings whose bounds reproduce ``pg_loss`` under the checked policy setting
    (module docstring), per family and mode, for the distinct advantage variants of the first
    :data:`~refppo.oracle.detect.search.SOLVE_GROUPS` groups
    and every aggregation mode; each solved bound is recorded (:meth:`Search.propose_value`). With
    ``grad_logprobs`` (:mod:`refppo.oracle.detect.correction_grad`): the truncation caps read off
    the gradient go to ``front`` (walked first: the policy step's solver reads its first groups),
    and a mask bound is kept only when it keeps every token the gradient reads as kept."""
    t, m = s.t, s.m
    if "pg_loss" not in t or "logprobs" not in t:
        return []
    target = float(t["pg_loss"])
    tol = s.tol.of(abs(target))
    rc = s.base.conv.rollout
    lows = list(dict.fromkeys([None, rc.low, *(b[0] for b in NAMED_BOUNDS)]))
    highs = list(dict.fromkeys([None, rc.high, *(b[1] for b in NAMED_BOUNDS)]))
    raws = {}
    for level, agg in FAMILIES:
        got = weights.of(_upd(s, level, agg, ISMode.TRUNCATE, (None, None)))
        if got is not None:
            raws[(level, agg)] = got[1][m].double()
    found: dict[tuple[Any, ...], list[Bounds]] = {}
    kept = _from_gradient(s, groups, raws, front)
    duals = dict.fromkeys([s.base.conv.policy.dual_clip, None, NAMED_DUAL])
    for _st, _dual, _agg, c in loss_terms(s, groups, duals):
        for fam, w in raws.items():
            found.setdefault((*fam, ISMode.TRUNCATE), []).extend(_truncate_caps(w, c, target, lows, highs))
            found.setdefault((*fam, ISMode.MASK), []).extend(_mask_caps(w, c, target, tol, lows, highs))
    out: list[dict[str, Any]] = []
    for (level, agg, mode), bounds in found.items():
        bs = [b for b in dict.fromkeys(bounds) if b not in NAMED_BOUNDS]
        if mode is ISMode.MASK and kept.get((level, agg)):
            bs = [b for b in bs if mask_consistent(b, kept[(level, agg)])]
            s.notes += _mask_notes(bs[:MAX_SOLVED], raws[(level, agg)], level)
        for b in bs[:MAX_SOLVED]:
            out.append(_upd(s, level, agg, mode, b))
            s.propose_value("rollout_is_low", b[0])
            s.propose_value("rollout_is_high", b[1])
    return out


def _from_gradient(
    s: Search,
    groups: list[Group[AdvState]],
    raws: dict[tuple[ISLevel, ISAgg | None], Tensor],
    front: list[dict[str, Any]] | None,
) -> dict[tuple[ISLevel, ISAgg | None], list[tuple[float, float]]]:
    """The truncation settings read off ``grad_logprobs`` (into ``front``, proposed, their lines
    noted) and, per family, the kept weights' ranges of the readings that fit masking."""
    kept: dict[tuple[ISLevel, ISAgg | None], list[tuple[float, float]]] = {}
    if front is None:
        return kept
    for rd in readings(s, groups):
        for (level, agg), w in raws.items():
            got = truncation_caps(rd, w)
            if got is not None and got[0] not in NAMED_BOUNDS:
                upd = _upd(s, level, agg, ISMode.TRUNCATE, got[0])
                if upd not in front:
                    front.append(upd)
                    s.notes += [f"{ln} (rollout_is={level.value}, truncate)" for ln in got[1]]
                    s.propose_value("rollout_is_low", got[0][0])
                    s.propose_value("rollout_is_high", got[0][1])
            span = kept_range(rd, w)
            if span is not None:
                kept.setdefault((level, agg), []).append(span)
    return kept


def _mask_notes(bounds: list[Bounds], w: Tensor, level: ISLevel) -> list[str]:
    """:func:`interval_note` for each solved mask bound (the band's on ``max(w, 1/w)``)."""
    out: list[str] = []
    for lo, hi in bounds:
        band = lo is not None and hi is not None and abs(lo * hi - 1.0) < 1e-9
        for key, cap, ws in (("rollout_is_low", lo, w), ("rollout_is_high", hi, w)):
            if cap is None or (band and key == "rollout_is_low"):
                continue
            what = f"rollout_is={level.value}, mask" + (", band [1/C, C]" if band else "")
            note = interval_note(key, cap, torch.maximum(ws, 1.0 / ws) if band else ws, what)
            if note is not None and note not in out:
                out.append(note)
    return out


def named_settings(s: Search) -> list[dict[str, Any]]:
    """The checked setting first (no change), off, then each family × mode × :data:`NAMED_BOUNDS`
    (the unbounded weight once per family: both modes give it)."""
    out: list[dict[str, Any]] = [{}, OFF]
    for level, agg in FAMILIES:
        for mode in ISMode:
            for b in NAMED_BOUNDS:
                if b == (None, None) and mode is not ISMode.TRUNCATE:
                    continue
                out.append(_upd(s, level, agg, mode, b))
    return out


def _options(
    s: Search, settings: list[dict[str, Any]], weights: _Weights
) -> Callable[[Group[AdvState]], Iterable[Option[AdvState]]]:
    checked = {k: s.base.conv.get(k) for k in BY_NAME["rollout_correction"].keys}

    def opts(g: Group[AdvState]) -> Iterable[Option[AdvState]]:
        st = g.state
        ca = st.carried
        for upd in settings:
            on = correction_on(s, upd)
            if not on:
                w_key, w = b"off", None
            else:
                got = weights.of(upd or checked)
                if got is None:
                    continue
                w_key, w = got
            key = digest(ca.kl_key, ca.kl_in.value, ca.ret_key, st.adv_key, w_key)
            yield upd, replace(st, is_weights=w, is_key=w_key), key

    return opts


def correction_step(s: Search, groups: list[Group[AdvState]]) -> list[Group[AdvState]]:
    """The correction's options on every advantage variant (a dump without ``rollout_logprobs``:
    the groups as they are, the correction off)."""
    if "rollout_logprobs" not in s.t:
        return groups
    weights = _Weights(s)
    named, front = named_settings(s), list[dict[str, Any]]()
    solved = solve_caps(s, groups, weights, front)
    gates = gate_settings(s, groups, (step_intervals, nicest_in)) if dropped(s) is None else []
    settings = named[:2] + front + named[2:] + solved + gates  # the checked setting, off, the gradient's caps
    if dropped(s) is not None:  # the drop_mask gate is the returns step's (detect.drop_gate): weights only
        bare = ({k: v for k, v in d.items() if not k.startswith("rollout_rs")} for d in settings)
        settings = [dict(t) for t in dict.fromkeys(tuple(sorted(d.items())) for d in bare)]
    return s.stage(groups, lambda _extra: _options(s, settings, weights), lambda _st: [], "correction")


def note_uncorrectable(s: Search) -> None:
    """On a dump without ``rollout_logprobs`` whose policy step reproduced nothing: say that a
    rollout correction (a weight on ``ℓ``) could not be tried, and why."""
    if "rollout_logprobs" not in s.t and "policy" in s.unmatched and "pg_loss" in s.t:
        s.notes.append(
            "rollout_is: not walked (off): the dump has no rollout_logprobs (the engine's log-probs of "
            "the sampled tokens), which a rollout correction's weight is computed from; dump them to "
            "test whether a correction explains pg_loss"
        )


__all__ = [
    "FAMILIES",
    "NAMED_BOUNDS",
    "correction_step",
    "named_settings",
    "nicest_in",
    "note_uncorrectable",
    "solve_caps",
    "step_intervals",
]
