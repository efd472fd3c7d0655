"""The normalisation fit of ``--detect``: when no whitening convention reproduces the dumped
advantages (or token rewards), the affine map between the dump and refppo's raw values (the stage's
input), for the batch or per row, with the statistics it matches named. A description of what the
dump holds, never a detected convention.

``D ≈ s·A + b`` over the valid tokens of the batch or of each row, then named: centre (mean over
valid tokens / over all B·T entries / none), scale (``1/sqrt(σ²+eps)`` with the unbiased or
population variance, ``1/σ``, none), and whether the mean is added back (:func:`fit_normalisation`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor


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


def _lsq(dumped: Tensor, raw: Tensor, mask: Tensor) -> tuple[float, float, float]:
    """Least squares ``d ≈ s·a + b`` over the valid tokens (``d``, ``a``: ``dumped``, ``raw`` there,
    in float64): ``(s, b, max |d − (s·a + b)|)``. The same operations, the same values as
    ``((a − ā)·(d − d̄)).sum()`` and so on, run so that at most two ``[N]`` float64 vectors and one
    temporary are alive at once (``d`` and ``a`` are selected again for the residual)."""
    a = raw[mask].to(torch.float64)
    am = a.mean()
    ac = a - am
    del a
    var = float((ac**2).sum())
    if var == 0.0:
        return math.nan, math.nan, math.inf
    d = dumped[mask].to(torch.float64)
    dm = d.mean()
    s = float(ac.mul_(d.sub_(dm)).sum()) / var
    del ac, d
    b = float(dm) - s * float(am)
    r = raw[mask].to(torch.float64).mul_(s).add_(b)
    return s, b, float(torch.sub(dumped[mask].to(torch.float64), r, out=r).abs_().max())


def fit_normalisation(
    what: str, dumped: Tensor, raw: Tensor, mask: Tensor, tol: float, eps: float = 1e-8
) -> NormFit:
    """Fit and name the map from refppo's raw ``what`` (before any normalisation) to the dump's.

    ``dumped``, ``raw``, ``mask``: ``[B, T]``; ``raw`` is 0 at padding (as the pipeline returns
    it). ``tol``: the comparison tolerance of ``what``. Tries one map for the whole batch, then one
    per row; returns the fit with the named statistics, or ``scope="none"``.
    """
    s, b, res = _lsq(dumped, raw, mask)
    if math.isfinite(res) and res <= tol:
        a = raw[mask].to(torch.float64)
        full = torch.where(mask, raw, torch.zeros((), dtype=raw.dtype)).to(torch.float64).flatten()
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


_BLOCK_ELEMS = 1 << 19
"""Entries of ``[B, T]`` float64 per row block of :func:`_fit_rows` (4 MiB): its temporaries are
blocks of rows, never the whole batch (the per-row sums and maxima are those of the whole)."""


def _row_blocks(B: int, T: int) -> list[slice]:
    step = max(1, _BLOCK_ELEMS // max(T, 1))
    return [slice(i, min(i + step, B)) for i in range(0, B, step)] or [slice(0, 0)]


def _row_sums(dumped: Tensor, raw: Tensor, mask: Tensor) -> tuple[Tensor, ...]:
    """Per row: ``n``, the means ``ā``, ``d̄`` of the valid raw and dumped values, ``Σ(a − ā)²``,
    ``Σ(a − ā)(d − d̄)`` and ``max |a|``, each row's sums taken over that row alone (a block of
    rows at a time)."""
    zero = torch.zeros((), dtype=torch.float64)
    n = mask.sum(dim=1).to(torch.float64)
    parts: list[list[Tensor]] = [[], [], [], [], []]
    for sl in _row_blocks(*mask.shape):
        m = mask[sl]
        d = torch.where(m, dumped[sl].to(torch.float64), zero)
        a = torch.where(m, raw[sl].to(torch.float64), zero)
        am = a.sum(1) / n[sl]
        dm = d.sum(1) / n[sl]
        ac = torch.where(m, a - am[:, None], zero)
        sums = (am, dm, (ac * ac).sum(1), (ac * (d - dm[:, None])).sum(1), a.abs().amax(dim=1))
        for acc, v in zip(parts, sums, strict=True):
            acc.append(v)
    am, dm, var, cov, span = (torch.cat(p) for p in parts)
    return n, am, dm, var, cov, span


def _row_residual(dumped: Tensor, raw: Tensor, mask: Tensor, s: Tensor, b: Tensor) -> float:
    """``max |d − (s_b·a + b_b)|`` over the valid tokens (0 where none), a block of rows at a time
    (the maximum of the blocks' maxima: NaN when any is)."""
    zero = torch.zeros((), dtype=torch.float64)
    worst: list[Tensor] = []
    for sl in _row_blocks(*mask.shape):
        m = mask[sl]
        d = torch.where(m, dumped[sl].to(torch.float64), zero)
        a = torch.where(m, raw[sl].to(torch.float64), zero)
        worst.append(torch.where(m, d - (s[sl, None] * a + b[sl, None]), zero).abs().max())
    return float(torch.stack(worst).max())


def _fit_rows(what: str, dumped: Tensor, raw: Tensor, mask: Tensor, tol: float) -> NormFit | None:
    """One affine map per row (masked sums per row, a block of rows at a time); names the
    per-row statistics."""
    n, am, dm, var, cov, span = _row_sums(dumped, raw, mask)
    ok = var > 0
    s = torch.where(ok, cov / torch.where(ok, var, 1.0), 0.0)
    b = dm - s * am
    resid = _row_residual(dumped, raw, mask, s, b)
    if resid > tol or bool((s == 0).all()):
        return None
    names: dict[str, str] = {}
    # centre per row: c_b = −b_b/s_b against the row mean
    c = torch.where(ok, -b / torch.where(s != 0, s, 1.0), am)
    if float((s * (c - am)).abs()[ok].max()) <= tol:
        names["centre"] = "the mean over each row's valid tokens"
    elif float((s * c).abs()[ok].max()) <= tol:
        names["centre"] = "none (not centred)"
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
    return NormFit("row", text, math.nan, math.nan, resid, names)


__all__ = ["NormFit", "fit_normalisation"]
