"""The logged policy clip fraction: which tokens it counts (``clipfrac_counts``, :func:`clip_fraction`)
and how it averages them (``clipfrac_agg=row-mean``, :func:`clipfrac_row_mean`), each with its naive twin.

**Counts** (``clipfrac_counts``).

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
``cispo_clip_ratio`` (:class:`~refppo.agg_conventions.ClipFracCounts` cites them). Detached.

**Row mean** (``clipfrac_agg=row-mean``, oat-llm 0.2.4).

``c_t = [ℓ2_t > ℓ1_t]``: the clipped term of :func:`refppo.core.policy.policy_terms` wins strictly
(the token statistic of :func:`refppo.core.policy.token_statistics`). refppo's ``pg_clipfrac`` is
its token mean ``Σ m c / Σ m``; oat-llm 0.2.4 ``oat/algorithms/ppo.py::PPOLearner.learning_step``
logs ``masked_mean((pg_losses2 > pg_losses).float(), mask, axis=1).mean()`` per micro-batch, then
the mean over micro-batches: ``(1/B) Σ_b (Σ_t m c / Σ_t m)`` for micro-batches of equal row counts.
A dual clip does not change ``c_t``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from refppo.agg_conventions import ClipFracCounts
from refppo.conventions import LossAgg
from refppo.core import _pyfloat as pf
from refppo.core.checks import check_bt, check_mask, count_true
from refppo.core.policy import _checked_policy_inputs, policy_terms
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


def clipfrac_row_mean(
    logp: TokenFloat,
    logp_old: TokenFloat,
    advantages: TokenFloat,
    mask: ResponseMask,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    log_ratio_clamp: float | None = None,
) -> Scalar:
    """``(1/B) Σ_b (Σ_t m c_t / Σ_t m)`` (module docstring; ``[B, T]`` inputs; detached, 0-dim)."""
    c = _checked_policy_inputs(
        logp, logp_old, advantages, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=None,
        agg=LossAgg.TOKEN_MEAN, log_ratio_clamp=log_ratio_clamp,
    )  # fmt: skip
    lp, lo, adv, m, eps_lo, eps_hi, _, k = c
    with torch.no_grad():
        t = policy_terms(lp, lo, adv, m, eps_lo=eps_lo, eps_hi=eps_hi, dual_clip=None, log_ratio_clamp=k)
        per_row = (t.loss2 > t.loss1).sum(dim=1).to(t.ratio.dtype) / count_true(m, 1).to(t.ratio.dtype)
        return per_row.mean()


def clipfrac_row_mean_naive(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    log_ratio_clamp: float | None = None,
) -> float:
    """Naive twin of :func:`clipfrac_row_mean`, token by token: ``ρ = exp(clamp(l − l^old, ±κ))``,
    clipped when ``−A·clip(ρ, 1−ε_low, 1+ε_high) > −A·ρ``; each row's fraction, then their mean."""
    _checked_policy_inputs(
        logp, logp_old, advantages, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=None,
        agg=LossAgg.TOKEN_MEAN, log_ratio_clamp=log_ratio_clamp,
    )  # fmt: skip
    hi = clip_low if clip_high is None else clip_high
    rows = zip(logp.tolist(), logp_old.tolist(), advantages.tolist(), mask.tolist(), strict=True)
    fractions = []
    for lrow, orow, arow, mrow in rows:
        n = clipped = 0
        for lp, lo, a, ok in zip(lrow, orow, arow, mrow, strict=True):
            if not ok:
                continue
            d = lp - lo
            if log_ratio_clamp is not None:
                d = min(max(d, -log_ratio_clamp), log_ratio_clamp)
            r = math.exp(d)
            n += 1
            clipped += int(-a * min(max(r, 1.0 - clip_low), 1.0 + hi) > -a * r)
        fractions.append(clipped / n)
    return sum(fractions) / len(fractions)


__all__ = ["clip_fraction", "clip_fraction_naive", "clipfrac_row_mean", "clipfrac_row_mean_naive"]
