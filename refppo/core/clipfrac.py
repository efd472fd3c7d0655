"""The logged clip fraction under each counting convention: ``clipfrac_counts``.

Symbols as :mod:`refppo.core.policy`: ``ρ_t`` the ratio the policy term clips ([B, T]: the token
ratio after the log-ratio clamp, or GSPO's sequence ratio on its row's tokens), ``A_t`` the
advantages, ``[lo, hi] = [1−ε_low, 1+ε_high]`` (``lo`` None: no lower bound), ``w'_t`` the rollout
correction's weight (None: no correction), ``m_t`` the valid tokens, ``n = Σ_t m_t``::

    surrogate (vanilla, gspo)   c_t = [−A_t·clip(ρ_t, lo, hi) > −A_t·ρ_t]        (L2 > L1)
    cispo, all                  c_t = [ρ_t > hi] ∨ [ρ_t < lo]
    cispo, by_advantage         c_t = [ρ_t > hi ∧ A_t > 0] ∨ [ρ_t < lo ∧ A_t < 0]
    kept                        c_t ← c_t ∧ [w'_t ≠ 0]                          (w' None: unchanged)
    clipfrac = Σ_t m_t·c_t / n

The surrogate's ``L2 > L1`` is computed with the same operations as
:func:`refppo.core.policy.policy_terms` (``−A`` masked, times ``ρ`` and ``clip(ρ)``), so under
``all`` it equals the core's ``clipfrac`` bit for bit; it already counts only the advantage's side
(``by_advantage`` changes nothing there). ``kept`` with CISPO counts ``[ρ outside]`` on the kept
tokens. AReaL 1.0.4 counts ``clip_mask & loss_mask`` after rejection; TRL 1.16.0 logs
``cispo_clip_ratio`` (:class:`~refppo.rollout_conventions.ClipFracCounts` cites them). Detached.
"""

from __future__ import annotations

import torch
from torch import Tensor

from refppo.core import _pyfloat as pf
from refppo.core.checks import check_bt, check_mask
from refppo.rollout_conventions import ClipFracCounts
from refppo.types import ResponseMask, Scalar, TokenFloat

Band = tuple[float | None, float]
"""``(lo, hi)``: the ratio's clip bounds (``lo`` None: none)."""


def clip_fraction(
    ratio: TokenFloat,
    advantages: TokenFloat,
    mask: ResponseMask,
    *,
    band: Band,
    surrogate: bool,
    counts: ClipFracCounts,
    weight: TokenFloat | None = None,
) -> Scalar:
    """``pg_clipfrac`` under ``counts`` (module docstring); ``surrogate``: the clipped surrogate's
    ``L2 > L1`` (vanilla, GSPO), else CISPO's clipped weight."""
    m = check_mask("mask", mask)
    ratio = check_bt("ratio", ratio, m)
    advantages = check_bt("advantages", advantages, m)
    lo, hi = band
    with torch.no_grad():
        zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
        adv = advantages.detach()
        if surrogate:
            neg_adv = torch.where(m, -adv, zero)
            c = neg_adv * torch.clamp(ratio, lo, hi) > neg_adv * ratio
        else:
            up = ratio > hi
            down = ratio < lo if lo is not None else torch.zeros_like(m)
            if counts is ClipFracCounts.BY_ADVANTAGE:
                up, down = up & (adv > 0), down & (adv < 0)
            c = up | down
        if counts is ClipFracCounts.KEPT and weight is not None:
            c = c & (check_bt("weight", weight, m) != 0)
        return (c & m).sum().to(ratio.dtype) / float(m.sum())


def clip_fraction_naive(
    ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    band: Band,
    surrogate: bool,
    counts: ClipFracCounts,
    weight: Tensor | None = None,
) -> float:
    """Naive twin of :func:`clip_fraction`, token by token in Python floats."""
    lo, hi = band
    rs, advs, ms = pf.rows(ratio), pf.rows(advantages), pf.mask_rows(mask)
    ws = pf.rows(weight) if weight is not None else [[1.0] * len(r) for r in ms]
    n = n_clipped = 0
    for rrow, arow, wrow, mrow in zip(rs, advs, ws, ms, strict=True):
        for r, a, w, ok in zip(rrow, arow, wrow, mrow, strict=True):
            if not ok:
                continue
            n += 1
            if surrogate:
                clipped_r = min(max(r, lo), hi) if lo is not None else min(r, hi)
                clipped = -a * clipped_r > -a * r
            elif counts is ClipFracCounts.BY_ADVANTAGE:
                clipped = (r > hi and a > 0) or (lo is not None and r < lo and a < 0)
            else:
                clipped = r > hi or (lo is not None and r < lo)
            if counts is ClipFracCounts.KEPT and w == 0.0:
                clipped = False
            n_clipped += clipped
    return n_clipped / n


__all__ = ["clip_fraction", "clip_fraction_naive"]
