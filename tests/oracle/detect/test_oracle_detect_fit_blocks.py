"""The normalisation fit of ``--detect`` (:func:`refppo.oracle.detect.fit.fit_normalisation`), whose
per-row fit runs a block of rows at a time and whose batch fit runs in place, gives exactly the
fit of the whole-batch evaluation it replaced (kept below as the twin: every ``[B, T]`` temporary
at once), on random dumps fitted per batch, per row or not at all, with blocks of one row and more."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refppo.oracle.detect import fit
from refppo.oracle.detect.fit import NormFit, _name_batch, fit_normalisation


def _lsq_whole(d: torch.Tensor, a: torch.Tensor) -> tuple[float, float, float]:
    am, dm = a.mean(), d.mean()
    var = float(((a - am) ** 2).sum())
    if var == 0.0:
        return math.nan, math.nan, math.inf
    s = float(((a - am) * (d - dm)).sum()) / var
    b = float(dm) - s * float(am)
    return s, b, float((d - (s * a + b)).abs().max())


def _rows_whole(dumped: torch.Tensor, raw: torch.Tensor, m: torch.Tensor, tol: float) -> tuple | None:
    """The whole-batch per-row fit up to its residual test: ``(n, ā, d̄, s, b, Σ(a−ā)², max|a|, residual)``."""
    zero = torch.zeros((), dtype=torch.float64)
    d = torch.where(m, dumped.to(torch.float64), zero)
    a = torch.where(m, raw.to(torch.float64), zero)
    n = m.sum(dim=1).to(torch.float64)
    am, dm = a.sum(1) / n, d.sum(1) / n
    ac = torch.where(m, a - am[:, None], zero)
    var = (ac * ac).sum(1)
    ok = var > 0
    s = torch.where(ok, (ac * (d - dm[:, None])).sum(1) / torch.where(ok, var, 1.0), 0.0)
    b = dm - s * am
    resid = torch.where(m, d - (s[:, None] * a + b[:, None]), zero).abs().max()
    if float(resid) > tol or bool((s == 0).all()):
        return None
    return n, am, dm, s, b, var, a.abs().amax(dim=1), float(resid)


def _fit_whole(
    dumped: torch.Tensor, raw: torch.Tensor, mask: torch.Tensor, tol: float
) -> NormFit | list[object] | None:
    """The whole-batch evaluation: the batch fit's NormFit, or the row fit's figures, or None."""
    d, a = dumped[mask].to(torch.float64), raw[mask].to(torch.float64)
    full = torch.where(mask, raw, torch.zeros((), dtype=raw.dtype)).to(torch.float64).flatten()
    s, b, res = _lsq_whole(d, a)
    if math.isfinite(res) and res <= tol:
        return _name_batch("advantages", s, b, res, a, full, 1e-8, tol)
    rows = _rows_whole(dumped, raw, mask, tol)
    return None if rows is None else [x.tolist() if isinstance(x, torch.Tensor) else x for x in rows]


@st.composite
def dumps(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    B, T = draw(st.integers(1, 7)), draw(st.integers(1, 9))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T).expand(B, T) < lengths[:, None]
    raw = torch.where(mask, torch.randn(B, T, generator=g), 0.0)
    kind = draw(st.sampled_from(["batch", "row", "none"]))
    if kind == "batch":
        dumped = 0.7 * raw - 0.3
    elif kind == "row":
        dumped = torch.randn(B, 1, generator=g) * raw + torch.randn(B, 1, generator=g)
    else:
        dumped = torch.randn(B, T, generator=g)
    noise = draw(st.sampled_from([0.0, 1e-6, 1e-3]))
    dumped = (dumped + noise * torch.randn(B, T, generator=g)).to(torch.float32)
    return dumped, raw.to(torch.float32), mask, draw(st.sampled_from([1e-5, 1e-3, 10.0]))


def _row_figures(
    dumped: torch.Tensor, raw: torch.Tensor, mask: torch.Tensor, tol: float
) -> list[object] | None:
    """The blocked per-row fit's figures, in the twin's order."""
    n, am, dm, var, cov, span = fit._row_sums(dumped, raw, mask)
    ok = var > 0
    s = torch.where(ok, cov / torch.where(ok, var, 1.0), 0.0)
    b = dm - s * am
    resid = fit._row_residual(dumped, raw, mask, s, b)
    if resid > tol or bool((s == 0).all()):
        return None
    figures = (n, am, dm, s, b, var, span, resid)
    return [x.tolist() if isinstance(x, torch.Tensor) else x for x in figures]


@settings(max_examples=150, deadline=None)
@given(dumps(), st.sampled_from([1, 5, 12, 1 << 19]))
def test_the_blocked_fit_is_the_whole_batch_fit(
    case: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float], block: int
) -> None:
    dumped, raw, mask, tol = case
    old = fit._BLOCK_ELEMS
    fit._BLOCK_ELEMS = block  # blocks of one row and up (T ≤ 9)
    try:
        new = fit_normalisation("advantages", dumped, raw, mask, tol)
        twin = _fit_whole(dumped, raw, mask, tol)
        if isinstance(twin, NormFit):
            assert repr(vars(new)) == repr(vars(twin))
        else:
            assert repr(_row_figures(dumped, raw, mask, tol)) == repr(twin)  # repr: NaN equals NaN
            assert (new.scope == "row") == (twin is not None)
            if twin is not None:
                assert repr(new.residual) == repr(twin[-1])
    finally:
        fit._BLOCK_ELEMS = old


def test_a_hand_worked_row_fit() -> None:
    # row 0: D = 2A + 1 on [1, 2, 3]; row 1: D = -A on [4, 6] (padding last); one map per row
    raw = torch.tensor([[1.0, 2.0, 3.0], [4.0, 6.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    dumped = torch.tensor([[3.0, 5.0, 7.0], [-4.0, -6.0, 99.0]])
    out = fit._row_sums(dumped, raw, mask)
    want = [[3.0, 2.0], [2.0, 5.0], [5.0, -5.0], [2.0, 2.0], [4.0, -2.0], [3.0, 6.0]]
    assert [x.tolist() for x in out] == want
    got = fit_normalisation("advantages", dumped, raw, mask, 1e-9)
    assert got.scope == "row" and got.residual == 0.0


@pytest.mark.parametrize("block", [1, 1 << 19])
def test_nan_in_a_row_is_the_residual(block: int) -> None:
    raw = torch.tensor([[1.0, 2.0, 3.0], [4.0, 6.0, 1.0]])
    dumped = torch.tensor([[3.0, 5.0, 7.0], [-4.0, math.nan, 1.0]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    old = fit._BLOCK_ELEMS
    fit._BLOCK_ELEMS = block
    try:
        s = torch.tensor([2.0, -1.0], dtype=torch.float64)
        b = torch.tensor([1.0, 0.0], dtype=torch.float64)
        assert math.isnan(fit._row_residual(dumped, raw, mask, s, b))
    finally:
        fit._BLOCK_ELEMS = old
