"""Rollout correction: importance weights between the proximal and the behaviour policy, and the
rejection gates (the seam between the inference engine and the trainer; spec/rollout-correction.md).

Symbols, all ``[B, T]``: ``l^num`` the numerator log-probs (the proximal ``l^prox`` = the trainer's
recompute ``old_logprobs``; or the current ``l`` in the bypass / REINFORCE forms), ``l^beh`` the
engine's (``rollout_logprobs``), mask ``m``, ``L_b = Σ_t m_bt``, ``d_t = m_t·(l^num_t − l^beh_t)``,
``κ`` an optional clamp of the log-weight, ``[C_low, C_high]`` the bounds (either may be None)::

    token:          log w_t = clamp(d_t, −κ, κ)
    sequence:       log w_b = clamp(Σ_t d_t, −κ, κ)              ISAgg product    (= Π_t w_t)
                    log w_b = clamp((1/L_b)·Σ_t d_t, −κ, κ)      ISAgg geometric
    raw:            w_t = m_t·exp(log w)                         (w_b on each valid token of row b)
    truncate:       w'_t = m_t·clamp(w_t, C_low, C_high)         (TIS)
    mask:           w'_t = w_t·[C_low ≤ w_t ≤ C_high]            (MIS / IcePop)
    keep_t        = m_t·[C_low ≤ w_t ≤ C_high]  (mask mode; ``m`` in truncate mode)
    detach=True:    w' = sg(w'): the weight is a constant (every peer); detach=False lets
                    ∂w'/∂l^num flow: w' where w_t is strictly inside the band or at a bound of
                    ``truncate`` (clamp passes its closed interval), ×1/L_b for geometric, 0 where
                    truncated or masked, 0 where κ clamps

Rejection gate (:func:`rejection_mask`), ``x_t = ±d_t`` (:class:`~refppo.rollout_conventions.RSOrder`),
statistic ``s_t``: ratio ``exp(x)``, k1 ``x``, k2 ``½x²``, k3 ``exp(−x) − 1 + x``::

    token:          keep_t  = m_t·[lo ≤ s_t ≤ hi]
    sequence:       keep_bt = m_bt·[lo ≤ S_b ≤ hi],  S_b = reduce_t(s_t) over valid t
                    (ratio: S_b = exp(reduce_t x_t), reduce ∈ {sum, mean, max})

A veto "reject the row when any token has ``w_t < τ``" is ``ratio``, ``behaviour`` order, ``max``,
``hi = 1/τ`` (``max_t π^beh/π^prox ≤ 1/τ`` ⇔ every ``w_t ≥ τ``). Bounds are closed, as in every peer.
Padding may hold any junk: it is selected away before any arithmetic (0 / False on padding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from refppo.conventions import parse
from refppo.core import _pyfloat as pf
from refppo.core.checks import check_bt, check_mask, check_positive, check_same_dtype, count_true
from refppo.errors import HyperparameterError
from refppo.rollout_conventions import ISAgg, ISLevel, ISMode, RSOrder, RSReduce, RSStat
from refppo.types import BoolMask, ResponseMask, TokenFloat

Bounds = tuple[float | None, float | None]


@dataclass(frozen=True)
class ISWeights:
    """What :func:`is_weights` returns, ``[B, T]``, 0 / False on padding."""

    weight: TokenFloat
    """``w'``: truncated or masked (detached unless ``detach=False``)."""
    raw: TokenFloat
    """``w`` before truncation or masking (detached unless ``detach=False``)."""
    keep: BoolMask
    """The valid tokens a mask-mode weight keeps (the whole mask in truncate mode)."""


def _bound(name: str, value: float | None, *, positive: bool) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise HyperparameterError(f"{name}: expected a finite number or None, got {value!r}")
    if positive and value < 0:
        raise HyperparameterError(f"{name}: expected a number >= 0 (a ratio bound), got {value!r}")
    return float(value)


def _check_bounds(low: float | None, high: float | None, *, ratio: bool, need_one: bool) -> Bounds:
    """``(low, high)`` checked: finite numbers or None, ``≥ 0`` for ratio bounds, ``low ≤ high``,
    and at least one given when ``need_one``."""
    lo, hi = _bound("low", low, positive=ratio), _bound("high", high, positive=ratio)
    if lo is not None and hi is not None and lo > hi:
        raise HyperparameterError(f"low, high: expected low <= high, got {low!r} > {high!r}")
    if need_one and lo is None and hi is None:
        raise HyperparameterError("low, high: a rejection gate needs at least one bound, got neither")
    return lo, hi


def _checked_pair(
    logp: Tensor, logp_beh: Tensor, mask: Tensor, log_ratio_clamp: float | None, num: str
) -> tuple[Tensor, Tensor, Tensor, float | None]:
    """``(l^num, l^beh, m, κ)`` validated in one order (vectorized and naive twins alike)."""
    m = check_mask("mask", mask)
    logp = check_bt(num, logp, m)
    logp_beh = check_bt("logp_beh", logp_beh, m)
    check_same_dtype(**{num: logp, "logp_beh": logp_beh})
    k = check_positive("log_ratio_clamp", log_ratio_clamp) if log_ratio_clamp is not None else None
    return logp, logp_beh, m, k


def _checked_is(
    logp: Tensor,
    logp_beh: Tensor,
    mask: Tensor,
    settings: tuple[object, object, object],
    low: float | None,
    high: float | None,
    log_ratio_clamp: float | None,
) -> tuple[Tensor, Tensor, Tensor, float | None, ISLevel, ISAgg, ISMode, Bounds]:
    """:func:`is_weights`'s inputs checked in one order; ``settings`` is ``(level, agg, mode)``."""
    lp, lb, m, k = _checked_pair(logp, logp_beh, mask, log_ratio_clamp, "logp")
    level, agg, mode = settings
    lv = parse(ISLevel, _name(level), what="is_level")
    ag = parse(ISAgg, _name(agg), what="is_agg")
    md = parse(ISMode, _name(mode), what="is_mode")
    return lp, lb, m, k, lv, ag, md, _check_bounds(low, high, ratio=True, need_one=False)


def _name(value: object) -> str:
    """A convention given as an enum member or its name (anything else is refused by ``parse``)."""
    return value if isinstance(value, str) else repr(value)


def _log_weights(d: Tensor, m: Tensor, level: ISLevel, agg: ISAgg, k: float | None) -> Tensor:
    """``log w`` of validated ``d`` (0 on padding): per token, or the row's sum / mean broadcast."""
    if level is ISLevel.SEQUENCE:
        s = d.sum(dim=1)
        if agg is ISAgg.GEOMETRIC:
            s = s / count_true(m, 1).to(d.dtype)
        d = torch.where(m, s.unsqueeze(1), torch.zeros((), dtype=d.dtype, device=d.device))
    return torch.clamp(d, -k, k) if k is not None else d


def _in_band(x: Tensor, lo: float | None, hi: float | None) -> Tensor:
    inside = torch.ones_like(x, dtype=torch.bool)
    if lo is not None:
        inside = inside & (x >= lo)
    if hi is not None:
        inside = inside & (x <= hi)
    return inside


def is_weights(
    logp: TokenFloat,
    logp_beh: TokenFloat,
    mask: ResponseMask,
    *,
    level: ISLevel | str = ISLevel.TOKEN,
    agg: ISAgg | str = ISAgg.PRODUCT,
    mode: ISMode | str = ISMode.TRUNCATE,
    low: float | None = None,
    high: float | None = None,
    log_ratio_clamp: float | None = None,
    detach: bool = True,
) -> ISWeights:
    """The importance weights ``w = π^num/π^beh`` of the module docstring. ``logp`` is ``l^num``
    (the proximal log-probs, or the current ones for a bypass form); ``low``/``high`` are
    ``C_low``/``C_high`` (both None: ``weight = raw``)."""
    c = _checked_is(logp, logp_beh, mask, (level, agg, mode), low, high, log_ratio_clamp)
    lp, lb, m, k, lv, ag, md, (lo, hi) = c
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    lp = torch.where(m, lp, zero)  # padding never reaches exp (NaN·0 in the backward pass)
    d = torch.where(m, lp - torch.where(m, lb, zero), zero)
    raw = torch.where(m, torch.exp(_log_weights(d, m, lv, ag, k)), zero)
    if md is ISMode.MASK:
        keep = m & _in_band(raw, lo, hi)
        weight = torch.where(keep, raw, zero)
    else:
        keep = m
        clamped = raw if lo is None and hi is None else torch.clamp(raw, min=lo, max=hi)
        weight = torch.where(m, clamped, zero)
    if detach:
        weight, raw = weight.detach(), raw.detach()
    return ISWeights(weight, raw, keep)


def _gate_stat(x: Tensor, stat: RSStat) -> Tensor:
    if stat is RSStat.RATIO:
        return torch.exp(x)
    if stat is RSStat.K1:
        return x
    if stat is RSStat.K2:
        return 0.5 * x * x
    return torch.exp(-x) - 1.0 + x


def _checked_gate(
    logp_prox: Tensor,
    logp_beh: Tensor,
    mask: Tensor,
    settings: tuple[object, object, object, object],
    low: float | None,
    high: float | None,
    log_ratio_clamp: float | None,
) -> tuple[Tensor, Tensor, Tensor, float | None, RSStat, RSOrder, ISLevel, RSReduce, Bounds]:
    """:func:`rejection_mask`'s inputs checked in one order; ``settings`` is
    ``(stat, order, level, reduce)``."""
    lp, lb, m, k = _checked_pair(logp_prox, logp_beh, mask, log_ratio_clamp, "logp_prox")
    stat, order, level, reduce = settings
    st = parse(RSStat, _name(stat), what="rs_stat")
    od = parse(RSOrder, _name(order), what="rs_order")
    lv = parse(ISLevel, _name(level), what="rs_level")
    rd = parse(RSReduce, _name(reduce), what="rs_reduce")
    b = _check_bounds(low, high, ratio=st is RSStat.RATIO, need_one=True)
    return lp, lb, m, k, st, od, lv, rd, b


def gate_statistic(
    logp_prox: TokenFloat,
    logp_beh: TokenFloat,
    mask: ResponseMask,
    *,
    stat: RSStat | str = RSStat.RATIO,
    order: RSOrder | str = RSOrder.PROXIMAL,
    level: ISLevel | str = ISLevel.TOKEN,
    reduce: RSReduce | str = RSReduce.MEAN,
    log_ratio_clamp: float | None = None,
) -> Tensor:
    """The statistic a rejection gate compares with its band (module docstring), detached ``[B, T]``:
    ``s_t`` per token, or the row's ``S_b`` on each of its valid tokens; 0 on padding."""
    c = _checked_gate(logp_prox, logp_beh, mask, (stat, order, level, reduce), None, 1.0, log_ratio_clamp)
    lp, lb, m, k, st, od, lv, rd, _ = c
    with torch.no_grad():
        zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
        d = torch.where(m, lp - lb, zero)
        if k is not None:
            d = torch.clamp(d, -k, k)
        x = -d if od is RSOrder.BEHAVIOUR else d
        if lv is ISLevel.TOKEN:
            return torch.where(m, _gate_stat(x, st), zero)
        per_token = x if st is RSStat.RATIO else torch.where(m, _gate_stat(x, st), zero)
        if rd is RSReduce.MAX:
            seq = per_token.masked_fill(~m, -math.inf).amax(dim=1)
        else:
            seq = per_token.sum(dim=1)
            if rd is RSReduce.MEAN:
                seq = seq / count_true(m, 1).to(seq.dtype)
        if st is RSStat.RATIO:
            seq = torch.exp(seq)
        return torch.where(m, seq.unsqueeze(1), zero)


def rejection_mask(
    logp_prox: TokenFloat,
    logp_beh: TokenFloat,
    mask: ResponseMask,
    *,
    stat: RSStat | str = RSStat.RATIO,
    order: RSOrder | str = RSOrder.PROXIMAL,
    level: ISLevel | str = ISLevel.TOKEN,
    reduce: RSReduce | str = RSReduce.MEAN,
    low: float | None = None,
    high: float | None = None,
    log_ratio_clamp: float | None = None,
) -> BoolMask:
    """The tokens a rejection gate keeps (module docstring), bool ``[B, T]``, False on padding:
    ``m·[lo ≤ s ≤ hi]`` of :func:`gate_statistic`; ``reduce`` is read at sequence level only;
    ``log_ratio_clamp`` clamps ``d`` first (verl: 20)."""
    c = _checked_gate(logp_prox, logp_beh, mask, (stat, order, level, reduce), low, high, log_ratio_clamp)
    lp, lb, m, k, st, od, lv, rd, (lo, hi) = c
    s = gate_statistic(lp, lb, m, stat=st, order=od, level=lv, reduce=rd, log_ratio_clamp=k)
    return m & _in_band(s, lo, hi)


def _inside(x: float, lo: float | None, hi: float | None) -> bool:
    return (lo is None or x >= lo) and (hi is None or x <= hi)


def _exp(x: float) -> float:
    """``e^x`` as torch gives it in float64: ``inf`` past the largest finite result."""
    return math.inf if x > 709.782712893384 else math.exp(x)


def _clamp(x: float, lo: float | None, hi: float | None) -> float:
    if lo is not None and x < lo:
        x = lo
    if hi is not None and x > hi:
        x = hi
    return x


def is_weights_naive(
    logp: Tensor,
    logp_beh: Tensor,
    mask: Tensor,
    *,
    level: ISLevel | str = ISLevel.TOKEN,
    agg: ISAgg | str = ISAgg.PRODUCT,
    mode: ISMode | str = ISMode.TRUNCATE,
    low: float | None = None,
    high: float | None = None,
    log_ratio_clamp: float | None = None,
) -> tuple[list[list[float]], list[list[float]], list[list[bool]]]:
    """Naive twin of :func:`is_weights`: ``(weight, raw, keep)`` row by row, token by token."""
    c = _checked_is(logp, logp_beh, mask, (level, agg, mode), low, high, log_ratio_clamp)
    _, _, _, k, lv, ag, md, (lo, hi) = c
    lp, lb, ms = pf.rows(logp), pf.rows(logp_beh), pf.mask_rows(mask)
    weights, raws, keeps = [], [], []
    for prow, brow, mrow in zip(lp, lb, ms, strict=True):
        ds = [p - q for p, q, ok in zip(prow, brow, mrow, strict=True) if ok]
        row_log = sum(ds) if ag is ISAgg.PRODUCT else sum(ds) / len(ds)
        wrow, rrow, krow = [], [], []
        for p, q, ok in zip(prow, brow, mrow, strict=True):
            w, kept, applied = 0.0, False, 0.0
            if ok:
                log_w = p - q if lv is ISLevel.TOKEN else row_log
                w = _exp(_clamp(log_w, -k, k) if k is not None else log_w)
                if md is ISMode.MASK:
                    kept = _inside(w, lo, hi)
                    applied = w if kept else 0.0
                else:
                    kept, applied = True, _clamp(w, lo, hi)
            wrow.append(applied)
            rrow.append(w)
            krow.append(kept)
        weights.append(wrow)
        raws.append(rrow)
        keeps.append(krow)
    return weights, raws, keeps


def _gate_stat_naive(x: float, stat: RSStat) -> float:
    """The statistic of one token: ratio ``e^x``, k1 ``x``, k2 ``x²/2``, k3 ``e^{−x} − 1 + x``."""
    if stat is RSStat.RATIO:
        return _exp(x)
    if stat is RSStat.K1:
        return x
    if stat is RSStat.K2:
        return x * x / 2.0
    return _exp(-x) - 1.0 + x


def gate_statistic_naive(
    logp_prox: Tensor,
    logp_beh: Tensor,
    mask: Tensor,
    *,
    stat: RSStat | str = RSStat.RATIO,
    order: RSOrder | str = RSOrder.PROXIMAL,
    level: ISLevel | str = ISLevel.TOKEN,
    reduce: RSReduce | str = RSReduce.MEAN,
    log_ratio_clamp: float | None = None,
) -> list[list[float]]:
    """Naive twin of :func:`gate_statistic`: each token's statistic, or each row's reduction on its
    valid tokens (0.0 on padding), row by row."""
    c = _checked_gate(logp_prox, logp_beh, mask, (stat, order, level, reduce), None, 1.0, log_ratio_clamp)
    _, _, _, k, st, od, lv, rd, _ = c
    lp, lb, ms = pf.rows(logp_prox), pf.rows(logp_beh), pf.mask_rows(mask)
    out = []
    for prow, brow, mrow in zip(lp, lb, ms, strict=True):
        xs = []  # x_t of the valid tokens: ±clamp(l^prox − l^beh, ±κ)
        for p, q, ok in zip(prow, brow, mrow, strict=True):
            if ok:
                d = _clamp(p - q, -k, k) if k is not None else p - q
                xs.append(-d if od is RSOrder.BEHAVIOUR else d)
        if lv is ISLevel.TOKEN:
            vals = iter([_gate_stat_naive(x, st) for x in xs])
            out.append([next(vals) if ok else 0.0 for ok in mrow])
            continue
        per = xs if st is RSStat.RATIO else [_gate_stat_naive(x, st) for x in xs]
        total = max(per) if rd is RSReduce.MAX else sum(per)
        seq = total / len(per) if rd is RSReduce.MEAN else total
        row = _exp(seq) if st is RSStat.RATIO else seq
        out.append([row if ok else 0.0 for ok in mrow])
    return out


def rejection_mask_naive(
    logp_prox: Tensor,
    logp_beh: Tensor,
    mask: Tensor,
    *,
    stat: RSStat | str = RSStat.RATIO,
    order: RSOrder | str = RSOrder.PROXIMAL,
    level: ISLevel | str = ISLevel.TOKEN,
    reduce: RSReduce | str = RSReduce.MEAN,
    low: float | None = None,
    high: float | None = None,
    log_ratio_clamp: float | None = None,
) -> list[list[bool]]:
    """Naive twin of :func:`rejection_mask`: :func:`gate_statistic_naive`, then the band per token."""
    c = _checked_gate(logp_prox, logp_beh, mask, (stat, order, level, reduce), low, high, log_ratio_clamp)
    _, _, _, k, st, od, lv, rd, (lo, hi) = c
    s = gate_statistic_naive(
        logp_prox, logp_beh, mask, stat=st, order=od, level=lv, reduce=rd, log_ratio_clamp=k
    )
    ms = pf.mask_rows(mask)
    return [
        [ok and _inside(v, lo, hi) for v, ok in zip(sr, mr, strict=True)]
        for sr, mr in zip(s, ms, strict=True)
    ]


__all__ = [
    "ISWeights",
    "gate_statistic",
    "gate_statistic_naive",
    "is_weights",
    "is_weights_naive",
    "rejection_mask",
    "rejection_mask_naive",
]
