"""Solvers for ``--detect``: read a convention's constants off the data instead of walking a grid.

A solver only *proposes*: every value it returns is tried by the staged search
(:mod:`refppo.oracle.detect.detection`) and every convention reported is re-checked through
:mod:`refppo.pipeline`. The solvers never re-implement a pipeline step: the per-token quantities
they start from come from the core functions (``clipped_policy_loss``, ``policy_ratio``,
``token_kl``, ``aggregate_loss``); what is solved here is the one unknown constant.

=================== ==========================================================================
solver              what it reads
=================== ==========================================================================
hinge sums          ``pg_loss(x) = C + Σ_i w_i·min(x, k_i)`` is piecewise linear and monotone in
                    the dual-clip constant ``c`` and in each clip range ``ε_low``, ``ε_high``:
                    sorting the knots ``k_i`` (the tokens where the branches switch) and
                    walking the prefix sums solves it exactly (:func:`solve_min_hinge`).
normalisation fit   ``D ≈ s·A + b`` between the dump's advantages (or token rewards) and refppo's
                    raw ones, over the valid tokens of the batch or of each row, then names the
                    statistics: centre (mean over valid tokens / over all B·T entries / none),
                    scale (``1/sqrt(σ²+eps)`` with the unbiased or population variance, ``1/σ``,
                    none), and whether the mean is added back (:func:`fit_normalisation`).
KL clamps           the tokens where the dump's ``kl`` departs from the unclamped estimator give
                    the value clamp (a constant ``|kl|``) or the log-ratio bounds (the estimator
                    inverted at the plateau value) (:func:`read_kl_clamps`).
=================== ==========================================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from refppo.core.kl import token_kl


# ----- hinge sums --------------------------------------------------------------------------------
def solve_min_hinge(
    knots: Tensor, coef: Tensor, const: float, target: float, lo: float, hi: float
) -> list[float]:
    """Every ``x`` in ``[lo, hi]`` with ``const + Σ_i coef_i·min(x, knots_i) = target``.

    ``knots``, ``coef``: 1-D, same length. The left side is continuous and piecewise linear in
    ``x`` with a break at each knot; it is monotone when the ``coef`` share a sign. Where a whole
    segment equals ``target`` (a flat stretch: the constant does not act there) its left end is
    returned. Cost: one sort, ``O(n log n)``.
    """
    k = knots.to(torch.float64)
    c = coef.to(torch.float64)
    below = k <= lo
    above = k >= hi
    c0 = const + float((c[below] * k[below]).sum())
    slope_all = float(c[~below].sum())  # on [lo, hi] knots above hi act as x
    inside = ~below & ~above
    ks, order = torch.sort(k[inside])
    cs = c[inside][order]
    zero = torch.zeros(1, dtype=torch.float64)
    cum_ck = torch.cat([zero, torch.cumsum(cs * ks, 0)])  # Σ_{i<=j} c_i k_i, j = 0..n
    cum_c = torch.cat([zero, torch.cumsum(cs, 0)])
    pts = torch.cat([torch.tensor([lo], dtype=torch.float64), ks, torch.tensor([hi], dtype=torch.float64)])
    n = ks.numel()
    seg = torch.clamp(torch.arange(n + 2), max=n)  # the segment formula valid at each point
    vals = c0 + cum_ck[seg] + pts * (slope_all - cum_c[seg])
    f = vals - target
    out: list[float] = []
    # a sign change (or a zero) between consecutive points: segment j = [pts[j], pts[j+1]]
    cross = ((f[:-1] <= 0) & (f[1:] >= 0)) | ((f[:-1] >= 0) & (f[1:] <= 0))
    for j in cross.nonzero().flatten().tolist()[:8]:
        s = slope_all - float(cum_c[j])
        if s == 0.0:
            out.append(float(pts[j]))
            continue
        x = (target - c0 - float(cum_ck[j])) / s
        out.append(min(max(x, float(pts[j])), float(pts[j + 1])))
    return sorted(set(out))


def nice(x: float, rel: float = 1e-3) -> list[float]:
    """``x`` rounded to the fewest significant digits within ``rel`` (then ``x`` itself, 6 digits).

    A solved constant is a float with rounding noise (2.5000003); trainers configure round
    numbers (2.5), so the round one is proposed first.
    """
    out: list[float] = []
    for digits in range(1, 5):
        r = float(f"{x:.{digits}g}")
        if abs(r - x) <= rel * max(abs(x), 1e-12):
            out.append(r)
            break
    raw = float(f"{x:.6g}")
    if raw not in out:
        out.append(raw)
    return out


def loss_weights(agg_fn: Any, mask: Tensor, dtype: torch.dtype) -> Tensor:
    """``w = ∂ agg(L)/∂L`` ``[B, T]``: every aggregation mode is linear in the per-token loss.

    ``agg_fn(L)`` is the core's ``aggregate_loss`` bound to a mode (so the weights are the
    pipeline's own, never re-derived here).
    """
    probe = torch.zeros(mask.shape, dtype=dtype, requires_grad=True)
    agg_fn(probe).backward()
    g = probe.grad
    assert g is not None  # a leaf that took part in the graph always has a gradient
    return g.detach()


@dataclass(frozen=True)
class PolicyTerms:
    """The per-token pieces the policy solvers need, flattened to the valid tokens."""

    adv: Tensor
    """``A`` at valid tokens (float64)."""
    ratio: Tensor
    """``ρ`` (after the log-ratio clamp) at valid tokens."""
    weight: Tensor
    """``∂pg_loss/∂ℓ_t`` of the aggregation mode at valid tokens."""


def solve_dual_clip(terms: PolicyTerms, per_token: Tensor, target: float, hi: float = 100.0) -> list[float]:
    """Dual-clip constants ``c > 1`` under which the aggregated loss equals ``target``.

    ``per_token``: ``ℓ_t`` without dual clip (valid tokens, from ``clipped_policy_loss``). With it,
    ``ℓ_t = min(ℓ_t, c·|A_t|)`` where ``A_t < 0``, i.e. ``|A_t|·min(c, ℓ_t/|A_t|)``: a hinge sum in
    ``c`` with knots ``ℓ_t/|A_t|`` (the ratio at which the dual branch takes over).
    """
    neg = terms.adv < 0
    w, a, lt = terms.weight, terms.adv, per_token.to(torch.float64)
    const = float((w[~neg] * lt[~neg]).sum())
    absa = -a[neg]
    sols = solve_min_hinge(lt[neg] / absa, w[neg] * absa, const, target, 1.0, hi)
    return [x for x in sols if 1.0 < x < hi]


def _clip_families(terms: PolicyTerms, dual: float | None) -> tuple[tuple[Tensor, Tensor, float], ...]:
    """(knots, coef, const) of the ε_high family (A > 0) and of the ε_low family (A < 0).

    ``A > 0``: ``ℓ = −A·min(ρ, 1+ε_h) = −A − A·min(ε_h, ρ−1)``;
    ``A < 0``: ``ℓ = |A|·max(min(ρ, c), 1−ε_l) = |A| − |A|·min(ε_l, 1−min(ρ, c))`` (c: dual clip).
    """
    w, a, r = terms.weight, terms.adv, terms.ratio.to(torch.float64)
    pos, neg = a > 0, a < 0
    wp, ap = w[pos], a[pos]
    hi_fam = (r[pos] - 1.0, -wp * ap, float(-(wp * ap).sum()))
    rn = r[neg] if dual is None else torch.clamp(r[neg], max=dual)
    wn, an = w[neg], -a[neg]
    lo_fam = (1.0 - rn, -wn * an, float((wn * an).sum()))
    return hi_fam, lo_fam


def _hinge_at(fam: tuple[Tensor, Tensor, float], x: float) -> float:
    k, c, const = fam
    return const + float((c * torch.clamp(k, max=x)).sum())


def solve_clip_ranges(
    terms: PolicyTerms,
    target: float,
    *,
    dual: float | None,
    known: tuple[float, ...],
    hi: float = 10.0,
) -> list[tuple[float, float]]:
    """Pairs ``(ε_low, ε_high)`` under which the aggregated clipped loss equals ``target``.

    One scalar cannot pin two unknowns, so this returns: the symmetric solution ``ε_low = ε_high``,
    and for each ``ε`` in ``known`` (the checked setting's ranges) the other range solved with that
    one held. The clip fraction and the pipeline decide among them.
    """
    hi_fam, lo_fam = _clip_families(terms, dual)
    out: list[tuple[float, float]] = []
    both = (
        torch.cat([hi_fam[0], lo_fam[0]]),
        torch.cat([hi_fam[1], lo_fam[1]]),
        hi_fam[2] + lo_fam[2],
    )
    for e in solve_min_hinge(*both, target, 0.0, hi)[:2]:
        out.append((e, e))
    for e in known:
        rest = target - _hinge_at(lo_fam, e)
        out += [(e, x) for x in solve_min_hinge(*hi_fam, rest, 0.0, hi)[:2]]
        rest = target - _hinge_at(hi_fam, e)
        out += [(x, e) for x in solve_min_hinge(*lo_fam, rest, 0.0, hi)[:2]]
    return out


def clipfrac_of(terms: PolicyTerms, eps_low: float, eps_high: float) -> float:
    """Share of valid tokens where the clipped branch is strictly larger (for filtering proposals)."""
    a, r = terms.adv, terms.ratio
    n = ((a > 0) & (r > 1.0 + eps_high)).sum() + ((a < 0) & (r < 1.0 - eps_low)).sum()
    return float(n) / max(a.numel(), 1)


# ----- normalisation fit -------------------------------------------------------------------------
@dataclass
class NormFit:
    """An affine map ``D = s·(A − c)`` (or ``+ μ`` added back) between dumped and raw values."""

    scope: str
    """``batch`` (one map for every valid token), ``row`` (one map per row) or ``none`` (no fit)."""
    text: str
    """One line naming the map and the statistics it matches."""
    scale: float = math.nan
    centre: float = math.nan
    residual: float = math.inf
    names: dict[str, str] = field(default_factory=dict)
    """``centre``/``scale``/``added_back`` → the statistic named (empty when none matched)."""


def _stats(a: Tensor, full: Tensor, eps: float) -> tuple[dict[str, float], dict[str, float]]:
    """Candidate centres and scales of the raw values ``a`` (valid) and ``full`` (all B·T)."""
    n, nf = a.numel(), full.numel()
    mu, mu_all = float(a.mean()), float(full.mean())
    centres = {"none (not centred)": 0.0, "the mean over the valid tokens": mu}
    centres["the mean over all B·T entries, padding included"] = mu_all
    scales: dict[str, float] = {"none (not scaled)": 1.0}
    for where, x, m_, cnt in (("valid tokens", a, mu, n), ("all B·T entries", full, mu_all, nf)):
        ss = float(((x - m_) ** 2).sum())
        for kind, den in (("unbiased", cnt - 1), ("population", cnt)):
            if den <= 0:
                continue
            var = ss / den
            scales[f"1/sqrt(var+eps), {kind} variance over the {where}"] = 1.0 / math.sqrt(var + eps)
            if var > 0:
                scales[f"1/(std+eps), {kind} std over the {where}"] = 1.0 / (math.sqrt(var) + eps)
    return centres, scales


def _lsq(d: Tensor, a: Tensor) -> tuple[float, float, float]:
    am, dm = a.mean(), d.mean()
    var = float(((a - am) ** 2).sum())
    if var == 0.0:
        return math.nan, math.nan, math.inf
    s = float(((a - am) * (d - dm)).sum()) / var
    b = float(dm) - s * float(am)
    return s, b, float((d - (s * a + b)).abs().max())


def fit_normalisation(
    what: str, dumped: Tensor, raw: Tensor, mask: Tensor, tol: float, eps: float = 1e-8
) -> NormFit:
    """Fit and name the map from refppo's raw ``what`` (before any normalisation) to the dump's.

    ``dumped``, ``raw``, ``mask``: ``[B, T]``; ``raw`` is 0 at padding (as the pipeline returns
    it). ``tol``: the comparison tolerance of ``what``. Tries one map for the whole batch, then one
    per row; returns the fit with the named statistics, or ``scope="none"``.
    """
    d = dumped[mask].to(torch.float64)
    a = raw[mask].to(torch.float64)
    full = torch.where(mask, raw, torch.zeros((), dtype=raw.dtype)).to(torch.float64).flatten()
    s, b, res = _lsq(d, a)
    if math.isfinite(res) and res <= tol:
        return _name_batch(what, s, b, res, a, full, eps, tol)
    row = _fit_rows(what, dumped, raw, mask, tol)
    if row is not None:
        return row
    return NormFit(
        "none",
        f"{what}: no affine map of refppo's raw {what} fits the dump, for the whole "
        f"batch or per row (best batch fit {what} = {s:.6g}·A + {b:.6g}, max residual "
        f"{res:.3g} > tol {tol:.3g})",
        s,
        math.nan,
        res,
    )


def _name_batch(
    what: str, s: float, b: float, res: float, a: Tensor, full: Tensor, eps: float, tol: float
) -> NormFit:
    centres, scales = _stats(a, full, eps)
    span = float(a.abs().max()) + 1e-300
    names: dict[str, str] = {}
    # D = s·(A − c): centre c = −b/s; or D = s·(A − μ) + μ: b = μ·(1 − s) ("mean added back")
    c = -b / s if s != 0 else math.nan
    for label, mu in centres.items():
        if abs(s * (mu - c)) <= tol:
            names["centre"] = label
            break
    else:
        for label, mu in centres.items():
            if mu != 0.0 and abs(b - mu * (1.0 - s)) <= tol:
                names["centre"] = label
                names["added_back"] = "yes"
                c = mu
                break
    for label, sc in scales.items():
        if abs(s - sc) * span <= tol:
            names["scale"] = label
            break
    centre_txt = names.get("centre", f"centred at {c:.6g}, which matches no statistic tried")
    if "centre" in names:
        centre_txt = "not centred" if centre_txt.startswith("none") else f"centred with {centre_txt}"
    if names.get("added_back"):
        centre_txt += ", the mean added back after scaling"
    scale_txt = names.get("scale", f"scaled by {s:.6g}, which matches no statistic tried")
    if "scale" in names:
        scale_txt = "not scaled" if scale_txt.startswith("none") else f"scaled by {s:.6g} = {scale_txt}"
    form = f"(A − {c:.6g})·{s:.6g}" + (f" + {c:.6g}" if names.get("added_back") else "")
    text = f"{what} = {form} over the valid tokens of the batch: {centre_txt}; {scale_txt}"
    return NormFit("batch", text, s, c, res, names)


def _fit_rows(what: str, dumped: Tensor, raw: Tensor, mask: Tensor, tol: float) -> NormFit | None:
    """One affine map per row (vectorised masked sums); names the per-row statistics."""
    zero = torch.zeros((), dtype=torch.float64)
    m = mask
    d = torch.where(m, dumped.to(torch.float64), zero)
    a = torch.where(m, raw.to(torch.float64), zero)
    n = m.sum(dim=1).to(torch.float64)
    am = a.sum(1) / n
    dm = d.sum(1) / n
    ac = torch.where(m, a - am[:, None], zero)
    var = (ac * ac).sum(1)
    ok = var > 0
    s = torch.where(ok, (ac * (d - dm[:, None])).sum(1) / torch.where(ok, var, 1.0), 0.0)
    b = dm - s * am
    resid = torch.where(m, d - (s[:, None] * a + b[:, None]), zero).abs().max()
    if float(resid) > tol or bool((s == 0).all()):
        return None
    names: dict[str, str] = {}
    # centre per row: c_b = −b_b/s_b against the row mean
    c = torch.where(ok, -b / torch.where(s != 0, s, 1.0), am)
    if float((s * (c - am)).abs()[ok].max()) <= tol:
        names["centre"] = "the mean over each row's valid tokens"
    elif float((s * c).abs()[ok].max()) <= tol:
        names["centre"] = "none (not centred)"
    span = a.abs().amax(dim=1)
    for kind, off in (("unbiased", 1.0), ("population", 0.0)):
        den = (n - off).clamp(min=1.0)
        sd = torch.sqrt(var / den)
        for form, sc in (("1/std", 1.0 / sd), ("1/(std+eps)", 1.0 / (sd + 1e-6))):
            if float(((s - sc).abs() * span)[ok & (n > 1)].max()) <= tol:
                names["scale"] = f"{form} of each row, {kind} over its valid tokens"
                break
        if "scale" in names:
            break
    if "scale" not in names and float(((s - s[ok].mean()).abs() * span)[ok].max()) <= tol:
        names["scale"] = f"one factor {float(s[ok].mean()):.6g} for every row"
    centre_txt = names.get("centre", "centred at a per-row constant that matches no statistic tried")
    scale_txt = names.get(
        "scale",
        "a per-row factor that matches no statistic tried "
        f"(range {float(s[ok].min()):.4g} … {float(s[ok].max()):.4g})",
    )
    text = (
        f"{what} = (A − c_b)·s_b with one map per row: centre c_b = {centre_txt}; "
        f"scale s_b = {scale_txt} (a per-row normalisation)"
    )
    return NormFit("row", text, math.nan, math.nan, float(resid), names)


# ----- KL clamps ---------------------------------------------------------------------------------
def _invert(est: str, y: float, lo: float, hi: float) -> float:
    """``x`` in ``[lo, hi]`` with ``estimator(x) = y`` (monotone there), by bisection on the core."""
    one = torch.ones(1, 1, dtype=torch.bool)
    zero = torch.zeros(1, 1, dtype=torch.float64)

    def f(x: float) -> float:
        return float(token_kl(torch.full((1, 1), x, dtype=torch.float64), zero, one, est)[0, 0]) - y

    f_lo = f(lo)
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if (f(mid) > 0) == (f_lo > 0):
            lo, f_lo = mid, f(mid)
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _bounds(est: str, db: Tensor, yb: Tensor, sel: Tensor) -> tuple[float | None, float | None] | None:
    """Log-ratio bounds ``(lo, hi)``: the estimator inverted at the plateau of each side."""
    bounds: list[float | None] = [None, None]
    for side, s in ((0, sel & (db < 0)), (1, sel & (db > 0))):
        if not bool(s.any()):
            continue
        y = float(yb[s].median())
        if side == 0:
            x = _invert(est, y, float(db[s].min()) - 1.0, 0.0)
        else:
            x = _invert(est, y, 0.0, float(db[s].max()) + 1.0)
        bounds[side] = nice(x)[0]
    return (bounds[0], bounds[1]) if bounds != [None, None] else None


def read_kl_clamps(
    dumped: Tensor, old: Tensor, ref: Tensor, mask: Tensor, est: str, tol: float
) -> list[dict[str, Any]]:
    """Clamp settings that the tokens where ``dumped`` departs from the unclamped estimator suggest.

    Value clamp ``v``: the departing tokens sit at ``|kl| = v`` with ``|estimate| > v``.
    Log-ratio clamp ``(lo, hi)``: the departing tokens with ``d < 0`` share one value
    ``estimator(lo)`` (likewise ``d > 0`` with ``hi``); the estimator is inverted there.
    """
    e = token_kl(old, ref, mask, est)
    bad = mask & ((dumped - e).abs() > tol)
    if not bool(bad.any()):
        return []
    d = torch.where(mask, old - ref, torch.zeros((), dtype=old.dtype))
    db, yb, eb = d[bad].to(torch.float64), dumped[bad].to(torch.float64), e[bad].to(torch.float64)
    out: list[dict[str, Any]] = []
    v = float(yb.abs().max())
    plateau = ((yb.abs() - v).abs() <= tol) & (eb.abs() > v - tol)
    vclamp = nice(v)[0] if bool(plateau.any()) else None
    # the departing tokens read as log-ratio bounds: those off the value plateau only, or all
    for sel0 in (~plateau, torch.ones_like(plateau)):
        lr = _bounds(est, db, yb, sel0)
        cands: list[dict[str, Any]] = [{"kl_log_ratio_clamp": lr, "kl_value_clamp": None}]
        if vclamp is not None:
            cands += [{"kl_log_ratio_clamp": lr, "kl_value_clamp": vclamp}]
            cands += [{"kl_log_ratio_clamp": None, "kl_value_clamp": vclamp}]
        for c in cands:
            if (c["kl_log_ratio_clamp"] is not None or c["kl_value_clamp"] is not None) and c not in out:
                out.append(c)
    return out


__all__ = [
    "NormFit",
    "PolicyTerms",
    "clipfrac_of",
    "fit_normalisation",
    "loss_weights",
    "nice",
    "read_kl_clamps",
    "solve_clip_ranges",
    "solve_dual_clip",
    "solve_min_hinge",
]
