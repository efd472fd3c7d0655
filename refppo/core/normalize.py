"""Batch normalisation of advantages (or rewards) over the valid tokens: every peer's variant.

Symbols: ``x`` ``[B, T]``, mask ``m``, ``N = Σ_bt m``, ``μ = Σ m·x / N``,
``σ² = Σ m·(x − μ)² / D`` and ``ms = Σ m·x² / D`` with ``D = N − 1`` (unbiased) or ``N``
(population)::

    kind              value on valid tokens              peer (file :: function)
    none              x                                  verl/OpenRLHF with normalisation off
    masked            (x − μ)·s(σ²)                      verl masked_whiten, TRL, OpenRLHF, AReaL
    masked_no_shift   (x − μ)·s(σ²) + μ                  TRL masked_whiten(shift_mean=False)
    center            x − μ                              AReaL Normalization(std_level=None)
    scale             x·s(ms)                            AReaL Normalization(mean_level=None)

    eps_at    s(v)                       peer
    variance  1/sqrt(v + eps)            verl, TRL, SkyRL masked_whiten, refppo
    clamp     1/sqrt(max(v, eps))        OpenRLHF compute_advantages_and_returns
    std       1/(sqrt(v) + eps)          AReaL areal/utils/data.py::Normalization (eps 1e-5)

Outputs are 0 at padded positions (junk there is selected away, never multiplied). With
``all_reduce`` (a SUM all-reduce) the statistics are those of every rank's shard together.
``masked``/``masked_no_shift`` with ``eps_at=variance`` is exactly
:func:`refppo.core.masked.masked_whiten` (its terms in its order; ``tests/core/test_core_normalize.py``
asserts them equal), so the default path is unchanged. Within
:func:`refppo.core.moments_memo.remembered_moments` the moments and the output of one ``x`` are
remembered (the output by the bits of the scalars it is made from).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from refppo.conventions import WhitenEps, Whitening, parse
from refppo.core import _pyfloat as pf
from refppo.core.checks import check_bt, check_mask, check_nonneg, count_true
from refppo.core.masked import AllReduce, masked_moments
from refppo.core.moments_memo import memoized
from refppo.errors import MaskError
from refppo.types import ResponseMask, TokenFloat


def _scale(v: Tensor, eps: float, eps_at: WhitenEps) -> Tensor:
    out: Tensor
    if eps_at is WhitenEps.VARIANCE:
        out = torch.rsqrt(v + eps)
    elif eps_at is WhitenEps.CLAMP:
        out = torch.rsqrt(torch.clamp(v, min=eps))
    else:
        out = 1.0 / (torch.sqrt(v) + eps)
    return out


def _mean_square(x: Tensor, m: Tensor, unbiased: bool, all_reduce: AllReduce | None) -> Tensor:
    """``Σ m·x² / D`` over the valid entries (every rank's with ``all_reduce``)."""
    if all_reduce is None:  # remembered within refppo.core.moments_memo.remembered_moments
        return memoized("mean_square", x, m, (unbiased,), lambda: _local_mean_square(x, m, unbiased))
    return _local_mean_square(x, m, unbiased, all_reduce)


def _local_mean_square(x: Tensor, m: Tensor, unbiased: bool, all_reduce: AllReduce | None = None) -> Tensor:
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    local = torch.stack([torch.where(m, x * x, zero).sum().double(), count_true(m).double()])
    summed: Tensor = all_reduce(local) if all_reduce is not None else local
    s, n = summed[0], summed[1]
    if unbiased and float(n) < 2:
        raise MaskError(f"mask: an unbiased mean square needs at least 2 valid tokens, got {int(n)}")
    ms: Tensor = (s / (n - 1 if unbiased else n)).to(x.dtype)
    return ms


def _checked_normalize_inputs(
    x: TokenFloat, mask: ResponseMask, kind: Whitening | str, eps: float, eps_at: WhitenEps | str
) -> tuple[Whitening, WhitenEps, Tensor, Tensor]:
    """:func:`normalize`'s inputs checked (shared with :func:`normalize_naive`): ``(kind, eps_at,
    x, mask)``, or one clear error."""
    k = parse(Whitening, kind, what="whiten_advantages")
    at = parse(WhitenEps, eps_at, what="whiten_eps_at")
    m = check_mask("mask", mask)
    x = check_bt("x", x, m)
    check_nonneg("eps", eps)
    return k, at, x, m


def normalize(
    x: TokenFloat,
    mask: ResponseMask,
    kind: Whitening | str = Whitening.MASKED,
    *,
    unbiased: bool = True,
    eps: float = 1e-8,
    eps_at: WhitenEps | str = WhitenEps.VARIANCE,
    all_reduce: AllReduce | None = None,
) -> TokenFloat:
    """Normalise ``x`` ``[B, T]`` over its valid tokens by ``kind`` (module docstring); 0 on padding."""
    k, at, x, m = _checked_normalize_inputs(x, mask, kind, eps, eps_at)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    if k is Whitening.NONE:
        return torch.where(m, x, zero)
    if k is Whitening.SCALE:
        s = _scale(_mean_square(x, m, unbiased, all_reduce), eps, at)
        return _output("scale", x, m, (s,), all_reduce, lambda: torch.where(m, x * s, zero))
    mu, var = masked_moments(x, m, unbiased=unbiased, all_reduce=all_reduce)
    if k is Whitening.CENTER:  # μ does not depend on ``unbiased``: the two share one output
        return _output("center", x, m, (mu,), all_reduce, lambda: torch.where(m, x - mu, zero))
    sc = _scale(var, eps, at)
    shift = k is Whitening.MASKED_NO_SHIFT

    def whiten() -> Tensor:
        out = (x - mu) * sc
        return torch.where(m, out + mu if shift else out, zero)

    return _output(k.value, x, m, (mu, sc), all_reduce, whiten)


def _output(
    what: str,
    x: Tensor,
    m: Tensor,
    scalars: tuple[Tensor, ...],
    all_reduce: AllReduce | None,
    fn: Callable[[], Tensor],
) -> Tensor:
    """``fn()``, an elementwise map of ``x`` and ``m`` by the 0-dim ``scalars``: remembered by their
    bits within :func:`refppo.core.moments_memo.remembered_moments` (the same bits, the same output:
    two eps placements whose scale rounds to one float share it); one process only."""
    if all_reduce is not None:
        return fn()
    bits = tuple(t.detach().reshape(1).numpy().tobytes() for t in scalars)
    return memoized(what, x, m, bits, fn)


def normalize_naive(
    x: TokenFloat,
    mask: ResponseMask,
    kind: Whitening | str = Whitening.MASKED,
    *,
    unbiased: bool = True,
    eps: float = 1e-8,
    eps_at: WhitenEps | str = WhitenEps.VARIANCE,
) -> TokenFloat:
    """Naive twin of :func:`normalize`: Python floats, two passes over the valid values."""
    k, at = _checked_normalize_inputs(x, mask, kind, eps, eps_at)[:2]  # the core's checks
    xs, ms = pf.rows(x), pf.mask_rows(mask)
    valid = [v for row, mrow in zip(xs, ms, strict=True) for v, ok in zip(row, mrow, strict=True) if ok]
    n = len(valid)
    d = n - 1 if unbiased else n
    mean = sum(valid) / n
    var = sum((v - mean) ** 2 for v in valid) / d
    mean_sq = sum(v * v for v in valid) / d

    def s(v: float) -> float:
        if at == WhitenEps.VARIANCE:
            return 1.0 / math.sqrt(v + eps)
        if at == WhitenEps.CLAMP:
            return 1.0 / math.sqrt(max(v, eps))
        return 1.0 / (math.sqrt(v) + eps)

    def one(v: float) -> float:
        if k == Whitening.NONE:
            return v
        if k == Whitening.CENTER:
            return v - mean
        if k == Whitening.SCALE:
            return v * s(mean_sq)
        w = (v - mean) * s(var)
        return w + mean if k == Whitening.MASKED_NO_SHIFT else w

    out = [
        [one(v) if ok else 0.0 for v, ok in zip(row, mrow, strict=True)]
        for row, mrow in zip(xs, ms, strict=True)
    ]
    return pf.tensor_like(out, x)


__all__ = ["normalize", "normalize_naive"]
