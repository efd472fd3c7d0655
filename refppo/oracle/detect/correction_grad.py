"""The correction's caps read off ``grad_logprobs`` (``--detect`` on a v2 dump, issue #22 item 6).

The rollout correction multiplies each token's policy term by a detached weight ``w'_t``, so the
dumped gradient is ``g_t = g^rest_t + w'_t·g^pg_t`` with ``g^pg`` the policy term's gradient and
``g^rest`` the others' (KL, entropy), both through the pipeline with the correction off and every
clip removed (:func:`refppo.oracle.detect.grad_solve` ``_branches``). Per valid token whose
``|g^pg_t|`` exceeds the gradient tolerance, ``x_t = (g_t − g^rest_t)/g^pg_t`` reads ``w'_t``:

    x_t = 0            a clip binds (PPO clip, dual clip) or the correction rejects the token (mask)
    x_t = w_t          the token is kept with its raw weight ``w_t`` (the stage with no bounds)
    x_t = C < w_t      truncated at the upper cap ``C``;   x_t = L > w_t: at the lower bound ``L``

so under truncation each truncated token gives the cap itself (an interval ``[a, b]``: the
tolerance of ``g`` over ``|g^pg_t|``, intersected over the tokens) and each kept token bounds it
(``C ≥ w_t``, ``L ≤ w_t``); the roundest number in the interval is proposed
(:func:`refppo.oracle.detect.grad_solve.roundest`) and walked through the stages like any other. A
token that reads none of these refutes the reading (its aggregation, advantages, KL keys). The
reading does not depend on the clip ranges or the dual clip (a clipped token reads 0 and bounds
nothing), so it holds where ``pg_loss`` alone cannot separate a cap from a dual clip.

Under masking ``x_t ∈ {0, w_t}``: a kept token bounds the caps (``L ≤ w_t ≤ C``), a zero token may
be clipped or rejected; the bounds of the mask caps solved from ``pg_loss`` (a step function: an
interval between consecutive observed weights) are kept only when every kept token lies inside them
(:func:`mask_consistent`), and :func:`interval_note` says that such a cap is fixed only to an
interval.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from refppo.agg_conventions import MASK_AGGS
from refppo.oracle.detect.adv_states import distinct_states
from refppo.oracle.detect.grad_fit import GradFit
from refppo.oracle.detect.grad_solve import _branches, _policy_setting, roundest
from refppo.oracle.detect.groups import Group
from refppo.oracle.detect.search import Search
from refppo.oracle.detect.states import AdvState

Bounds = tuple[float | None, float | None]


@dataclass(frozen=True)
class Reading:
    """One reading of ``w'`` off the gradient (under one advantage variant and aggregation), on the
    valid tokens (1-D, the mask's order)."""

    x: Tensor
    """``(g − g^rest)/g^pg`` where ``read``, else 0."""
    read: Tensor
    """Tokens whose ``|g^pg|`` exceeds the tolerance (the others read nothing)."""
    zero: Tensor
    """Read tokens whose policy term sends no gradient (clipped or rejected)."""
    half: Tensor
    """The half-width of each read token's ``x`` (the gradient tolerance over ``|g^pg|``)."""


def readings(s: Search, groups: list[Group[AdvState]]) -> list[Reading]:
    """The readings under the distinct advantage variants (and KL identities) of the first
    :data:`~refppo.oracle.detect.search.SOLVE_GROUPS` groups and every
    ``loss_agg`` (the checked log-ratio clamp); none without ``grad_logprobs``."""
    fit = GradFit(s)
    if not fit.lp_on:
        return []
    m = s.m
    d = s.t["grad_logprobs"][m].double()
    out: list[Reading] = []
    lrc = s.base.conv.policy.log_ratio_clamp
    for st in distinct_states(groups, with_kl=True):
        for agg in MASK_AGGS:
            setup = _policy_setting(s, st, agg, lrc)
            whole, rest = _branches(fit, setup, "grad_logprobs", (st.adv, st.carried.returns, st.carried.vm))
            g_pg, r = (whole - rest)[m].double(), d - rest[m].double()
            tol = fit.tol.of(float(whole.abs().max()))
            read = g_pg.abs() > 4.0 * tol
            safe = torch.where(read, g_pg, torch.ones_like(g_pg))
            x = torch.where(read, r / safe, torch.zeros_like(r))
            out.append(Reading(x, read, read & (r.abs() <= tol), tol / safe.abs()))
    return out


def _span(rd: Reading, sel: Tensor) -> tuple[float, float] | None:
    """The interval every selected token's ``x ± half`` allows (None: empty or no token)."""
    if not bool(sel.any()):
        return None
    a = float((rd.x[sel] - rd.half[sel]).max())
    b = float((rd.x[sel] + rd.half[sel]).min())
    return (a, b) if a <= b else None


def truncation_caps(rd: Reading, w: Tensor) -> tuple[Bounds, list[str]] | None:
    """The truncation bounds ``(L, C)`` one reading gives under the raw weight ``w`` (None where a
    bound reads no truncated token), with a line per solved bound; None when a token reads neither
    0, ``w`` nor a common cap (the reading refutes truncation of this family)."""
    live = rd.read & ~rd.zero
    kept = live & ((rd.x - w).abs() <= rd.half)
    up, lo = live & ~kept & (rd.x < w), live & ~kept & (rd.x > w)
    if not bool((up | lo).any()):
        return None  # nothing truncated: the unbounded option, walked already
    lines: list[str] = []
    caps: list[float | None] = [None, None]
    for i, (sel, name) in enumerate(((lo, "rollout_is_low"), (up, "rollout_is_high"))):
        sp = _span(rd, sel)
        if sel.any() and sp is None:
            return None  # the truncated tokens read no common bound
        if sp is None:
            continue
        a, b = sp
        # kept tokens: the cap at or above each kept weight (the lower bound at or below)
        if bool(kept.any()):
            if name == "rollout_is_high":
                a = max(a, float(w[kept].max()))
            else:
                b = min(b, float(w[kept].min()))
        if a > b:
            return None
        caps[i] = roundest(a, b) if b > a else a
        lines.append(
            f"{name}: read off the gradient: {a:.6g} ≤ {name} ≤ {b:.6g} ({int(sel.sum())} truncated "
            f"token(s) give it, {int(kept.sum())} kept one(s) bound it); proposed {caps[i]}"
        )
    return (caps[0], caps[1]), lines


def kept_range(rd: Reading, w: Tensor) -> tuple[float, float] | None:
    """``(min, max)`` of the raw weights of the tokens read as kept with their weight under masking
    (None: a token reads neither 0 nor ``w``, or none is kept)."""
    live = rd.read & ~rd.zero
    kept = live & ((rd.x - w).abs() <= rd.half)
    if bool((live & ~kept).any()) or not bool(kept.any()):
        return None
    return float(w[kept].min()), float(w[kept].max())


def mask_consistent(b: Bounds, ranges: Iterable[tuple[float, float]]) -> bool:
    """Whether the mask bounds ``b`` keep every token some reading kept (``L ≤ w ≤ C``)."""
    lo = -math.inf if b[0] is None else b[0]
    hi = math.inf if b[1] is None else b[1]
    return any(lo <= a and z <= hi for a, z in ranges)


def interval_note(key: str, cap: float, w: Tensor, what: str) -> str | None:
    """A mask cap ``cap`` of ``key`` is fixed only between the observed weights around it: the line
    saying so (None when no weight lies on one side)."""
    below, above = w[w <= cap], w[w > cap]
    if not below.numel() or not above.numel():
        return None
    a, b = float(below.max()), float(above.min())
    return (
        f"{key}={cap} ({what}): fixed only to an interval: every value between the observed weights "
        f"{a:.6g} and {b:.6g} keeps the same tokens, so the dump cannot tell them apart"
    )


__all__ = ["Reading", "interval_note", "kept_range", "mask_consistent", "readings", "truncation_caps"]
