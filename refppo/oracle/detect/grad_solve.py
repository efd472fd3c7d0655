"""Clip ranges read off the gradient (``--detect`` on a v2 dump): ``ε_low``, ``ε_high``, the dual clip
``c`` from ``grad_logprobs``, the value clip ``ε_v`` from ``grad_values``.

Where a clip binds, the clipped branch is a constant and the token's loss term sends no gradient:

    vanilla, A > 0:          zero ⇔ ρ − 1 > ε_high              (knot ρ − 1)
    vanilla, A < 0, ρ < 1:   zero ⇔ 1 − ρ > ε_low               (knot 1 − ρ)
    vanilla, A < 0, ρ > 1:   zero ⇔ ρ > c   (the dual clip)      (knot ρ)
    value (clipped):         zero ⇔ ε_v < k_i                   (k_i: :class:`ValueKnots`' knot)

with ``ρ`` the policy stage's ratio (after the log-ratio clamp). Each token whose gradient is the
clipped branch's bounds the constant from above (``< knot``), each whose gradient is the unclipped
branch's from below (``≥ knot``): an interval ``[L, U)`` results. A token's branch is read by
comparing the dump with the two branches' gradients through the pipeline
(:func:`refppo.oracle.check.grad.pipeline_grads` with the clips removed, and without its policy or
value term: the gradient of the clipped branch), each at the oracle's gradient tolerance; a token
within it of both is not read (``A ≈ 0``), a token within it of neither refutes the candidate
(aggregation, advantages, KL keys) it was read under. A constant is proposed as the roundest
number in its interval (the checked value when that lies in it); the walk then evaluates it
through the stages like any named value. ``gspo`` (one ratio per row) is not solved here.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from refppo.agg_conventions import MASK_AGGS
from refppo.conventions import LossAgg, PolicyLoss, VfMask
from refppo.oracle.check.grad import pipeline_grads, unclipped
from refppo.oracle.check.settings import Setup
from refppo.oracle.detect.grad_fit import GradFit, kl_twins
from refppo.oracle.detect.groups import Group
from refppo.oracle.detect.search import SOLVE_GROUPS, Search
from refppo.oracle.detect.solve_value import ValueKnots
from refppo.oracle.detect.states import AdvState, PolicyState
from refppo.pipeline.update import clip_ratio


@dataclass(frozen=True)
class Interval:
    """``lo ≤ x < hi`` from ``n_lo`` tokens bounding it from below and ``n_hi`` from above."""

    lo: float
    hi: float
    n_lo: int
    n_hi: int

    @classmethod
    def of(cls, knots: Tensor, zero: Tensor, free: Tensor) -> Interval:
        """From the knots of the tokens read as clipped (``zero``) and unclipped (``free``)."""
        lo = float(knots[free].max()) if bool(free.any()) else -math.inf
        hi = float(knots[zero].min()) if bool(zero.any()) else math.inf
        return cls(lo, hi, int(free.sum()), int(zero.sum()))

    @property
    def empty(self) -> bool:
        return self.lo >= self.hi

    def pick(self, own: float | None, floor: float) -> float | None:
        """The checked value ``own`` when it lies in the interval, else the roundest number in it
        (above ``floor``); None when empty or unbounded above with ``own`` in it."""
        lo = max(self.lo, floor)
        if lo >= self.hi:
            return None
        if own is not None and lo <= own < self.hi:
            return own
        return roundest(lo, self.hi)

    def text(self, name: str, got: float | None) -> str:
        hi = "∞" if math.isinf(self.hi) else f"{self.hi:.6g}"
        lo = "−∞" if math.isinf(self.lo) else f"{self.lo:.6g}"
        return (
            f"{name}: read off the gradient: {lo} ≤ {name} < {hi} ({self.n_lo} token(s) where the clip does "
            f"not bind bound it from below, {self.n_hi} where it binds from above); proposed {got}"
        )


def roundest(lo: float, hi: float) -> float:
    """The roundest number in ``[lo, hi)`` (``lo`` finite): the first multiple of ``10^e``, then
    ``5·10^(e−1)``, then ``10^(e−1)``, … that lies in it, from the interval's magnitude ``e`` down
    (a trainer's configured constant: 0.2, 1.5, 3, 0.28)."""
    top = max(abs(lo), abs(hi) if math.isfinite(hi) else abs(lo), 1e-12)
    e = math.floor(math.log10(top))
    for k in range(0, 9):
        for unit in (1.0, 0.5):
            step = unit * 10.0 ** (e - k)
            v = float(f"{math.ceil(lo / step - 1e-9) * step:.{k + 3}g}")
            if lo <= v < hi:
                return v
    return lo


def _branches(
    fit: GradFit, setup: Setup, name: str, inp_args: tuple[Tensor, Tensor, Tensor]
) -> tuple[Tensor, Tensor]:
    """``(unclipped, clipped)`` gradients ``name`` under ``setup`` with every clip removed: the whole
    objective's, and the same less its policy (value) term's."""
    adv, returns, vmask = inp_args
    inp = fit.inputs(adv, returns, vmask)
    free = unclipped(setup)
    whole = pipeline_grads(inp, free, norm=fit.s.ev.norm)[name]
    if name == "grad_logprobs":
        return whole, whole - pipeline_grads(inp, free, norm=fit.s.ev.norm, objective="pg_loss")[
            "grad_logprobs"
        ]
    return whole, torch.zeros_like(whole)


def read_branches(fit: GradFit, name: str, free_g: Tensor, clip_g: Tensor) -> tuple[Tensor, Tensor] | None:
    """``(zero, free)`` masks of the valid tokens read as clipped / unclipped, or None when a token
    is neither (the candidate is refuted)."""
    d = fit.s.t[name]
    tol = fit.tol.of(float(free_g.abs().max()))
    near_free = (d - free_g).abs() <= tol
    near_clip = (d - clip_g).abs() <= tol
    m = fit.s.m
    if bool((m & ~near_free & ~near_clip).any()):
        return None
    return m & near_clip & ~near_free, m & near_free & ~near_clip


def policy_intervals(fit: GradFit, st: AdvState, setup: Setup) -> dict[str, Interval] | None:
    """The intervals of ``cliprange``, ``cliprange_high`` and ``dual_clip`` under ``setup`` (its
    aggregation, KL keys, log-ratio clamp), or None when the gradient refutes it."""
    s = fit.s
    t = s.t
    free_g, clip_g = _branches(fit, setup, "grad_logprobs", (st.adv, st.carried.returns, st.carried.vm))
    read = read_branches(fit, "grad_logprobs", free_g, clip_g)
    if read is None:
        return None
    zero, free = read
    rho = clip_ratio(t["logprobs"], t["old_logprobs"], s.m, setup.conv).to(torch.float64)
    pos, neg = st.adv > 0, st.adv < 0
    return {
        "cliprange_high": Interval.of(rho - 1.0, zero & pos, free & pos),
        "cliprange": Interval.of(1.0 - rho, zero & neg & (rho < 1), free & neg & (rho < 1)),
        "dual_clip": Interval.of(rho, zero & neg & (rho > 1), free & neg & (rho > 1)),
    }


def _policy_setting(s: Search, st: AdvState, agg: LossAgg, lrc: float | None) -> Setup:
    ca = st.carried
    return s.setting(
        policy_loss=PolicyLoss.VANILLA.value, dual_clip=None, log_ratio_clamp=lrc, loss_agg=agg.value,
        kl_in=ca.kl_in.value, kl_loss_agg=None, rollout_is=None, **kl_twins(ca.kl_setting)[0],
    )  # fmt: skip


def _pick_clips(s: Search, iv: dict[str, Interval]) -> tuple[float, float | None] | None:
    """The clip pair from the intervals: one ``ε`` when the two intervals meet, else ``(ε_low, ε_high)``."""
    hp = s.hp
    lo_iv, hi_iv = iv["cliprange"], iv["cliprange_high"]
    both = Interval(max(lo_iv.lo, hi_iv.lo), min(lo_iv.hi, hi_iv.hi, 1.0), 0, 0)
    one = both.pick(hp.cliprange, 0.0)
    if one is not None:
        return one, None
    lo = Interval(lo_iv.lo, min(lo_iv.hi, 1.0), 0, 0).pick(hp.cliprange, 0.0)
    hi = hi_iv.pick(hp.cliprange_high, 0.0)
    return None if lo is None or hi is None else (lo, hi)


def propose_policy_grad(
    s: Search, groups: list[Group[AdvState]], losses: list[PolicyLoss]
) -> dict[str, list[Any]]:
    """Clip ranges and dual-clip constants read off ``grad_logprobs`` (module docstring), per
    advantage variant (the first :data:`SOLVE_GROUPS` groups), aggregation mode and log-ratio clamp
    (none, the checked one), for the walk to evaluate with every policy loss ``losses``."""
    out: dict[str, list[Any]] = {"losses": list(losses)}
    fit = GradFit(s)
    if not fit.lp_on:
        return out
    clips: list[tuple[float, float | None]] = []
    duals: list[float] = []
    seen: set[bytes] = set()
    own = s.base.conv.policy
    for g in groups[:SOLVE_GROUPS]:
        st = g.state
        if st.is_weights is not None or st.adv_key + st.carried.kl_key in seen:
            continue
        seen.add(st.adv_key + st.carried.kl_key)
        for agg, lrc in itertools.product(MASK_AGGS, dict.fromkeys([None, own.log_ratio_clamp])):
            iv = policy_intervals(fit, st, _policy_setting(s, st, agg, lrc))
            if iv is None:
                continue
            pair = _pick_clips(s, iv)
            if pair is not None and pair not in clips and pair != (s.hp.cliprange, s.hp.cliprange_high):
                clips.append(pair)
                hi_v = pair[0] if pair[1] is None else pair[1]
                s.notes += [
                    iv["cliprange"].text("cliprange", pair[0]),
                    iv["cliprange_high"].text("cliprange_high", hi_v),
                ]
            dual = iv["dual_clip"]
            cv = dual.pick(own.dual_clip, 1.0 + 1e-9) if dual.n_hi else None
            if cv is not None and cv not in duals:
                duals.append(cv)
                s.notes.append(dual.text("dual_clip", cv))
    for lo, hi in clips[:8]:
        s.propose_value("cliprange", lo)
        s.propose_value("cliprange_high", hi)
    for c in duals[:8]:
        s.propose_value("dual_clip", c)
    return {**out, "clips": clips, "duals": duals[:8]}


def value_interval(fit: GradFit, ps: PolicyState, vfm: VfMask, vagg: str | None) -> Interval | None:
    """The interval of ``cliprange_value`` under the value keys (clipped loss), or None when the
    gradient refutes them."""
    s = fit.s
    t = s.t
    mask = s.m if vfm is VfMask.RESPONSE else ps.carried.vm
    setup = s.setting(value_loss="clipped", vf_mask=vfm.value, value_loss_agg=vagg, loss_agg=ps.agg.value)
    free_g, clip_g = _branches(fit, setup, "grad_values", (ps.adv, ps.carried.returns, mask))
    d = t["grad_values"]
    tol = fit.tol.of(float(free_g.abs().max()))
    near_free, near_clip = (d - free_g).abs() <= tol, (d - clip_g).abs() <= tol
    if bool((mask & ~near_free & ~near_clip).any()):
        return None
    kn = ValueKnots.of(t["values"], t["old_values"], ps.carried.returns, mask)
    knots = torch.empty_like(kn.knots)
    knots[kn.order] = kn.knots
    zero, free = (near_clip & ~near_free)[mask], (near_free & ~near_clip)[mask]
    return Interval.of(knots, zero, free)


def propose_value_grad(s: Search, groups: list[Group[PolicyState]]) -> list[float]:
    """Value clip ranges read off ``grad_values`` per group (the first :data:`SOLVE_GROUPS`), value
    mask and ``value_loss_agg`` (like ``loss_agg``, or every mode)."""
    fit = GradFit(s)
    if not fit.v_on:
        return []
    found: list[float] = []
    for g in groups[:SOLVE_GROUPS]:
        ps = g.state
        for vfm in VfMask:
            for vagg in [None, *(a.value for a in MASK_AGGS if a is not ps.agg)]:
                iv = value_interval(fit, ps, vfm, vagg)
                if iv is None or iv.n_hi == 0:
                    continue
                v = iv.pick(s.hp.cliprange_value, 0.0)
                if v is not None and v not in found and v != s.hp.cliprange_value:
                    found.append(v)
                    s.notes.append(iv.text("cliprange_value", v))
    for v in found[:8]:
        s.propose_value("cliprange_value", v)
    return found[:8]


__all__ = [
    "Interval",
    "policy_intervals",
    "propose_policy_grad",
    "propose_value_grad",
    "read_branches",
    "roundest",
    "value_interval",
]
