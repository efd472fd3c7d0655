"""The policy clip fraction averaged per row (``clipfrac_agg=row-mean``, oat-llm 0.2.4).

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

from refppo.conventions import LossAgg
from refppo.core.checks import count_true
from refppo.core.policy import _checked_policy_inputs, policy_terms
from refppo.types import ResponseMask, Scalar, TokenFloat


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


__all__ = ["clipfrac_row_mean", "clipfrac_row_mean_naive"]
