"""Masked reductions and whitening over the valid tokens of a right-padded ``[B, T]`` batch.

Symbols: ``x`` ``[B, T]``, mask ``m`` ``[B, T]`` (1 = real response token), ``N = Σ_bt m``.

===================== ===============================================================
masked_sum            ``Σ_bt m·x``  (or per row: ``Σ_t m·x``)
masked_mean           ``Σ m·x / Σ m``
masked_var            ``Σ m·(x−μ)² / (N−1)`` (unbiased) or ``/ N`` (population)
masked_whiten         ``(x−μ)/sqrt(σ²+eps)``, ``+μ`` again when ``shift_mean=False``
masked_moments        ``(μ, σ²)`` of :func:`masked_whiten`, optionally global across ranks
kept_rows_aggregate   a loss aggregation with rows masked out of the loss, kept in the row count
===================== ===============================================================

Distributed (``all_reduce``): ``masked_var``, ``masked_whiten`` and ``masked_moments`` take an
optional SUM all-reduce hook (e.g. ``lambda t: (dist.all_reduce(t), t)[1]``). With it, ``x`` and
``mask`` are this rank's shard and ``N``, ``μ`` and ``σ²`` are those of the concatenation of every
rank's shard, by the same two passes: ``μ = AR(Σ m·x)/AR(N)``, then
``σ² = AR(Σ m·(x−μ)²)/(AR(N)−1)`` (or ``/AR(N)``). The per-rank partial sums are formed in
``x.dtype`` like the single-process path and all-reduced as float64 (exact counts); ``μ`` and
``σ²`` are cast back to ``x.dtype``. Every rank must call with the same arguments (two
collectives per call, in the same order). Without the hook nothing is communicated and the
results are bit-identical to the single-process formulas above.

Padded positions may hold any junk (NaN, inf): they are selected away with ``torch.where``,
never multiplied by 0 (``NaN·0 = NaN``). Whitened outputs are 0 at padded positions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from refppo.conventions import LossAgg, parse
from refppo.core import _pyfloat as pf
from refppo.core.aggregate import _checked_norms, aggregate_masked
from refppo.core.checks import check_bt, check_in_loss, check_mask, check_nonneg, count_true
from refppo.core.moments_memo import memoized
from refppo.errors import MaskError, ShapeError
from refppo.types import ResponseMask, Scalar, TokenFloat

AllReduce = Callable[[Tensor], Tensor]
"""A SUM all-reduce across ranks: returns the elementwise sum over ranks (in place is fine)."""


def _masked_values(x: Tensor, m: Tensor) -> Tensor:
    return torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _global_moments(x: Tensor, m: Tensor, unbiased: bool, all_reduce: AllReduce) -> tuple[Tensor, Tensor]:
    """Two-pass global ``(μ, σ²)`` of the valid entries over every rank's shard (validated input)."""
    acc = torch.float64
    local = torch.stack([_masked_values(x, m).sum().to(acc), count_true(m).to(acc)])
    s, n = all_reduce(local)
    if unbiased and float(n) < 2:
        raise MaskError(
            f"mask: an unbiased variance needs at least 2 valid tokens (over all ranks), got {int(n)}"
        )
    mu = (s / n).to(x.dtype)
    sq = all_reduce(_masked_values((x - mu) ** 2, m).sum().to(acc).reshape(1))[0]
    var = (sq / (n - 1 if unbiased else n)).to(x.dtype)
    return mu, var


def _check_dim(dim: int | None) -> None:
    if dim not in (None, -1, 1):
        raise ShapeError(f"dim: expected None (everything) or -1/1 (per row, over resp), got {dim!r}")


def _checked_reduction(
    x: TokenFloat, mask: ResponseMask, dim: int | None, *, nonempty_rows: bool
) -> tuple[Tensor, Tensor]:
    """``(x, mask)`` of a masked reduction checked (``dim``, the mask, ``x`` ``[B, T]`` float): the
    checks of :func:`masked_sum` (``nonempty_rows=False``), :func:`masked_mean`, :func:`masked_var`
    and :func:`masked_whiten`, shared with their naive twins (the same error for a bad input)."""
    _check_dim(dim)
    m = check_mask("mask", mask, require_nonempty_rows=nonempty_rows)
    return check_bt("x", x, m), m


def _check_unbiased_count(n: int, unbiased: bool) -> None:
    if unbiased and n < 2:
        raise MaskError(f"mask: an unbiased variance needs at least 2 valid tokens, got {n}")


def masked_sum(x: TokenFloat, mask: ResponseMask, dim: int | None = None) -> Tensor:
    """``Σ m·x`` over everything (``dim=None``, 0-dim result) or per row (``dim=-1`` or 1, ``[B]``)."""
    x, m = _checked_reduction(x, mask, dim, nonempty_rows=False)
    xm = _masked_values(x, m)
    return xm.sum() if dim is None else xm.sum(dim=dim)


def masked_mean(x: TokenFloat, mask: ResponseMask, dim: int | None = None) -> Tensor:
    """``Σ m·x / Σ m`` over everything or per row (``dim=-1`` or 1). Every row needs a valid token."""
    x, m = _checked_reduction(x, mask, dim, nonempty_rows=True)
    xm = _masked_values(x, m)
    if dim is None:
        return xm.sum() / count_true(m).to(x.dtype)
    return xm.sum(dim=dim) / count_true(m, dim).to(x.dtype)


def masked_var(
    x: TokenFloat, mask: ResponseMask, *, unbiased: bool = True, all_reduce: AllReduce | None = None
) -> Scalar:
    """Variance of the valid entries of ``x``: ``Σ m(x−μ)²/(N−1)`` (unbiased) or ``/N``.

    With ``all_reduce`` the variance over every rank's shard (module docstring, "Distributed").
    Raises MaskError when an unbiased variance is asked of fewer than 2 valid tokens.
    """
    x, m = _checked_reduction(x, mask, None, nonempty_rows=True)
    if all_reduce is not None:
        return _global_moments(x, m, unbiased, all_reduce)[1]
    n = int(count_true(m))
    _check_unbiased_count(n, unbiased)
    mu = _masked_values(x, m).sum() / n
    sq = _masked_values((x - mu) ** 2, m).sum()
    return sq / (n - 1 if unbiased else n)


def masked_moments(
    x: TokenFloat, mask: ResponseMask, *, unbiased: bool = True, all_reduce: AllReduce | None = None
) -> tuple[Scalar, Scalar]:
    """``(μ, σ²)`` as used by :func:`masked_whiten`: masked mean and (unbiased or population) variance.

    With ``all_reduce`` they are global over every rank's shard (module docstring, "Distributed");
    without it, exactly the single-process ``μ = Σ m·x / N`` and :func:`masked_var`.
    """
    m = check_mask("mask", mask)
    x = check_bt("x", x, m)
    if all_reduce is not None:
        return _global_moments(x, m, unbiased, all_reduce)
    return memoized("moments", x, m, (unbiased,), lambda: _local_moments(x, m, unbiased))


def _local_moments(x: Tensor, m: Tensor, unbiased: bool) -> tuple[Scalar, Scalar]:
    """:func:`masked_moments` on one process (validated input)."""
    n = count_true(m).to(x.dtype)
    mu = _masked_values(x, m).sum() / n
    return mu, masked_var(x, m, unbiased=unbiased)


def masked_whiten(
    x: TokenFloat,
    mask: ResponseMask,
    *,
    shift_mean: bool = True,
    unbiased: bool = True,
    eps: float = 1e-8,
    all_reduce: AllReduce | None = None,
) -> TokenFloat:
    """``(x − μ)·rsqrt(σ² + eps)`` on valid tokens (``+ μ`` when ``shift_mean=False``); 0 on padding.

    μ and σ² are the masked mean and variance over the whole batch (see :func:`masked_moments`);
    with ``all_reduce`` over the whole global batch, every rank's shard (as verl; TRL whitens per
    rank).
    Convention sources: verl ``verl/utils/torch_functional.py::masked_whiten`` (unbiased,
    ``rsqrt(var+1e-8)``); TRL ``trl/core.py::masked_whiten`` (unbiased, ``shift_mean`` flag);
    OpenRLHF whitens with the population variance.
    """
    x, m = _checked_reduction(x, mask, None, nonempty_rows=True)
    check_nonneg("eps", eps)
    mu, var = masked_moments(x, m, unbiased=unbiased, all_reduce=all_reduce)
    out = (x - mu) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mu
    return _masked_values(out, m)


# ----------------------------------------------------------------------------------------------
# Naive twins: one Python float at a time.
# ----------------------------------------------------------------------------------------------


def masked_sum_naive(x: TokenFloat, mask: ResponseMask, dim: int | None = None) -> Tensor:
    """Naive twin of :func:`masked_sum` (``dim`` None or -1/1)."""
    _checked_reduction(x, mask, dim, nonempty_rows=False)  # the core's checks (the sums are separate)
    xs, ms = pf.rows(x), pf.mask_rows(mask)
    per_row = []
    for row, mrow in zip(xs, ms, strict=True):
        s = 0.0
        for value, valid in zip(row, mrow, strict=True):
            if valid:
                s += value
        per_row.append(s)
    if dim is None:
        return pf.tensor_like(math.fsum(per_row), x)
    return pf.tensor_like(per_row, x)


def masked_mean_naive(x: TokenFloat, mask: ResponseMask, dim: int | None = None) -> Tensor:
    """Naive twin of :func:`masked_mean` (``dim`` None or -1/1)."""
    _checked_reduction(x, mask, dim, nonempty_rows=True)  # the core's checks
    xs, ms = pf.rows(x), pf.mask_rows(mask)
    total, count = 0.0, 0
    per_row = []
    for row, mrow in zip(xs, ms, strict=True):
        s, c = 0.0, 0
        for value, valid in zip(row, mrow, strict=True):
            if valid:
                s += value
                c += 1
        per_row.append(s / c)
        total += s
        count += c
    if dim is None:
        return pf.tensor_like(total / count, x)
    return pf.tensor_like(per_row, x)


def masked_var_naive(x: TokenFloat, mask: ResponseMask, *, unbiased: bool = True) -> Scalar:
    """Naive twin of :func:`masked_var`: two passes over the valid values."""
    _checked_reduction(x, mask, None, nonempty_rows=True)  # the core's checks
    valid_values = [
        v
        for row, mrow in zip(pf.rows(x), pf.mask_rows(mask), strict=True)
        for v, ok in zip(row, mrow, strict=True)
        if ok
    ]
    n = len(valid_values)
    _check_unbiased_count(n, unbiased)
    mean = sum(valid_values) / n
    sq = sum((v - mean) ** 2 for v in valid_values)
    return pf.tensor_like(sq / (n - 1 if unbiased else n), x)


def masked_whiten_naive(
    x: TokenFloat,
    mask: ResponseMask,
    *,
    shift_mean: bool = True,
    unbiased: bool = True,
    eps: float = 1e-8,
) -> TokenFloat:
    """Naive twin of :func:`masked_whiten`."""
    _checked_reduction(x, mask, None, nonempty_rows=True)  # the core's checks, in its order
    check_nonneg("eps", eps)
    xs, ms = pf.rows(x), pf.mask_rows(mask)
    valid_values = [
        v for row, mrow in zip(xs, ms, strict=True) for v, ok in zip(row, mrow, strict=True) if ok
    ]
    n = len(valid_values)
    _check_unbiased_count(n, unbiased)
    mean = sum(valid_values) / n
    var = sum((v - mean) ** 2 for v in valid_values) / (n - 1 if unbiased else n)
    scale = 1.0 / math.sqrt(var + eps)
    out = []
    for row, mrow in zip(xs, ms, strict=True):
        new_row = []
        for v, ok in zip(row, mrow, strict=True):
            if not ok:
                new_row.append(0.0)
                continue
            w = (v - mean) * scale
            if not shift_mean:
                w += mean
            new_row.append(w)
        out.append(new_row)
    return pf.tensor_like(out, x)


def kept_rows_aggregate(
    loss_mat: TokenFloat,
    mask: ResponseMask,
    in_loss: Tensor,
    mode: LossAgg | str = LossAgg.TOKEN_MEAN,
    *,
    count_rows: bool = True,
    token_count: float | None = None,
    seq_count: float | None = None,
    horizon: float | None = None,
) -> Scalar:
    """A loss aggregation with whole rows masked out of the loss (``in_loss[b]`` False) but, with
    ``count_rows``, kept in the row count (TRL 1.16.0 ``mask_truncated_completions``).

    ``loss_mat``, ``mask`` ``[B, T]`` (every row of ``mask`` non-empty: the row's generated tokens),
    ``in_loss`` ``[B]``. With ``m'_{bt} = m_{bt}·in_loss_b``, ``N' = Σ m'`` (the tokens in the loss),
    ``n_b = Σ_t m_{bt}``, ``N_seq = B`` (``count_rows``; else ``Σ_b in_loss_b``) unless
    ``seq_count`` is given, ``H = T`` unless ``horizon`` is given::

        token-mean               Σ m'L / max(N', 1)        (token_count replaces max(N', 1))
        seq-mean-token-mean      Σ_b in_loss_b·(Σ_t m L / n_b) / N_seq
        seq-mean-token-sum       Σ m'L / N_seq
        seq-mean-token-sum-norm  Σ m'L / (N_seq·H)
        token-sum                Σ m'L

    A masked row adds nothing to a token sum or a token count; it adds 1 to ``N_seq`` when
    ``count_rows``. ``max(N', 1)``: TRL's ``mask.sum().clamp(min=1.0)`` (``bnpo``) and
    ``num_items_in_batch.clamp(min=1.0)`` (``dapo``), a batch of masked rows has loss 0.
    ``∂/∂L_{bt} = m'_{bt}·w_{bt}`` with ``w`` the weight of ``mode`` above.
    """
    agg = parse(LossAgg, mode, what="loss_agg")
    m = check_mask("mask", mask)
    loss_mat = check_bt("loss_mat", loss_mat, m)
    keep = check_in_loss("in_loss", in_loss, int(m.shape[0]), m.device)
    _checked_norms(agg, token_count, seq_count, horizon)
    m_in = m & keep.unsqueeze(1)
    zero = torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device)
    lm = torch.where(m_in, loss_mat, zero)
    if token_count is None:
        token_count = max(float(count_true(m_in)), 1.0)
    if seq_count is None and not count_rows:
        seq_count = max(float(count_true(keep)), 1.0)
    return aggregate_masked(lm, m, agg, token_count=token_count, seq_count=seq_count, horizon=horizon)


def kept_rows_weights_naive(
    mask: ResponseMask,
    in_loss: Tensor,
    mode: LossAgg | str = LossAgg.TOKEN_MEAN,
    *,
    count_rows: bool = True,
    token_count: float | None = None,
    seq_count: float | None = None,
    horizon: float | None = None,
) -> list[list[float]]:
    """``w_{bt} = ∂kept_rows_aggregate/∂L_{bt}`` row by row in Python floats (the gradient twin);
    0 on padding and on the rows out of the loss."""
    agg = parse(LossAgg, mode, what="loss_agg")
    m = check_mask("mask", mask)
    keep = check_in_loss("in_loss", in_loss, int(m.shape[0]), m.device).tolist()
    _checked_norms(agg, token_count, seq_count, horizon)
    ms = pf.mask_rows(m)
    n_in = sum(sum(row) for row, k in zip(ms, keep, strict=True) if k)
    n_tok = token_count if token_count is not None else float(max(n_in, 1))
    rows_counted = len(ms) if count_rows else max(sum(keep), 1)
    n_seq = seq_count if seq_count is not None else float(rows_counted)
    h = horizon if horizon is not None else float(len(ms[0]))
    out: list[list[float]] = []
    for row, k in zip(ms, keep, strict=True):
        if agg == LossAgg.TOKEN_MEAN:
            w = 1.0 / n_tok
        elif agg == LossAgg.TOKEN_SUM:
            w = 1.0
        elif agg == LossAgg.SEQ_MEAN_TOKEN_MEAN:
            w = 1.0 / (sum(row) * n_seq)
        elif agg == LossAgg.SEQ_MEAN_TOKEN_SUM:
            w = 1.0 / n_seq
        else:
            w = 1.0 / (h * n_seq)
        out.append([w if ok and k else 0.0 for ok in row])
    return out


def kept_rows_aggregate_naive(
    loss_mat: TokenFloat,
    mask: ResponseMask,
    in_loss: Tensor,
    mode: LossAgg | str = LossAgg.TOKEN_MEAN,
    **kw: Any,
) -> Scalar:
    """Naive twin of :func:`kept_rows_aggregate`: ``Σ_bt w_{bt}·L_{bt}`` with the weights of
    :func:`kept_rows_weights_naive` (the aggregation is linear in ``L``)."""
    check_bt("loss_mat", loss_mat, check_mask("mask", mask))
    ws = kept_rows_weights_naive(mask, in_loss, mode, **kw)
    total = 0.0
    for lrow, wrow in zip(pf.rows(loss_mat), ws, strict=True):
        for value, w in zip(lrow, wrow, strict=True):
            if w != 0.0:
                total += w * value
    return pf.tensor_like(total, loss_mat)
