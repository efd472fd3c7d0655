"""The probability ratio from cached log-probs and the clipped surrogate (PPO, Schulman et al. 2017).

Symbols: ``l_t = log π_θ(y_t)`` (current, differentiable), ``l^old_t`` (cached at rollout, frozen),
``A_t`` advantages (constants), ``ε_low, ε_high`` clip ranges, ``c > 1`` the dual-clip constant::

    ρ_t   = exp(l_t − l^old_t)                          (optionally log-ratio clamped to ±κ)
    L1_t  = −A_t·ρ_t
    L2_t  = −A_t·clip(ρ_t, 1−ε_low, 1+ε_high)
    ℓ_t   = max(L1_t, L2_t)                             (= −min(ρA, clip(ρ)A): pessimistic bound)
    dual: ℓ_t = min(ℓ_t, −c·A_t)  where A_t < 0         (Ye et al. 2020; verl "vanilla" c=3)
    pg_loss = agg(ℓ)

Minimising ``pg_loss`` maximises ``L_CLIP``. The gradient w.r.t. ``l_t`` is ``−A_t ρ_t`` where the
unclipped branch is active and exactly 0 in the clipped regions (A>0, ρ>1+ε), (A<0, ρ<1−ε), and,
with dual-clip, (A<0, ρ>c); also 0 where A=0. The full truth table is in spec/ppo.md.

Statistics (detached, over valid tokens): ``clipfrac = mean[L2 > L1]`` (verl/TRL definition),
``clipfrac_lower = mean[A<0 and ℓ_maxclip > −cA]`` (dual-clip active), ``approx_kl = mean(l^old − l)``
(verl ``ppo_kl``, OpenRLHF) and ``approx_kl_k2 = ½ mean((l − l^old)²)`` (TRL ``approxkl``, masked).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from refppo.conventions import LossAgg, parse
from refppo.core import _pyfloat as pf
from refppo.core.aggregate import aggregate_loss_naive, aggregate_masked
from refppo.core.checks import check_bt, check_mask, check_nonneg, check_positive, check_same_dtype
from refppo.errors import HyperparameterError
from refppo.types import ResponseMask, Scalar, TokenFloat


@dataclass(frozen=True)
class PolicyLossOutput:
    """What :func:`clipped_policy_loss` returns. Tensors ``[B, T]`` are 0 at padded positions."""

    loss: Scalar
    """Aggregated clipped surrogate loss (differentiable)."""
    per_token: TokenFloat
    """``ℓ_t`` before aggregation (differentiable)."""
    ratio: TokenFloat
    """``ρ_t`` (differentiable)."""
    clipfrac: Scalar
    """Fraction of valid tokens where the clipped branch is strictly larger (``L2 > L1``)."""
    clipfrac_lower: Scalar
    """Fraction of valid tokens where the dual clip bound is active (0 without dual-clip)."""
    approx_kl: Scalar
    """``mean(l^old − l)`` over valid tokens."""
    approx_kl_k2: Scalar
    """``½ mean((l − l^old)²)`` over valid tokens."""


def policy_ratio(
    logp: TokenFloat, logp_old: TokenFloat, mask: ResponseMask, *, log_ratio_clamp: float | None = None
) -> TokenFloat:
    """``ρ = exp(l − l^old)`` from cached old log-probs, ``[B, T]``; 0 at padded positions.

    ``log_ratio_clamp=κ`` clamps ``l − l^old`` to ``[−κ, κ]`` first (verl and OpenRLHF use 20).
    """
    m = check_mask("mask", mask, require_nonempty_rows=False)
    return _log_ratio_and_ratio(logp, logp_old, m, log_ratio_clamp)[1]


def _log_ratio_and_ratio(
    logp: Tensor, logp_old: Tensor, m: Tensor, log_ratio_clamp: float | None
) -> tuple[Tensor, Tensor]:
    """Validated ``(d, ρ)``: ``d = l − l^old`` (unclamped, 0 on padding) and ``ρ`` as :func:`policy_ratio`."""
    logp = check_bt("logp", logp, m)
    logp_old = check_bt("logp_old", logp_old, m)
    check_same_dtype(logp=logp, logp_old=logp_old)
    k = check_positive("log_ratio_clamp", log_ratio_clamp) if log_ratio_clamp is not None else None
    return log_ratio_terms(logp, logp_old, m, k)


def log_ratio_terms(logp: Tensor, logp_old: Tensor, m: Tensor, k: float | None) -> tuple[Tensor, Tensor]:
    """``(d, ρ)`` of already validated inputs, elementwise (so any block of rows gives that block's
    values): ``d = m·(l − l^old)``, ``ρ = m·exp(clamp(d, ±k))`` (``k`` None: no clamp)."""
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    d = torch.where(m, logp - logp_old, zero)
    dc = d
    if k is not None:
        dc = torch.clamp(d, -k, k)
    return d, torch.where(m, torch.exp(dc), zero)


@dataclass(frozen=True)
class PolicyTerms:
    """The per-token terms of the clipped surrogate, ``[b, T]`` for the rows given (elementwise)."""

    d: Tensor
    """``l − l^old``, 0 on padding (unclamped)."""
    ratio: Tensor
    loss1: Tensor
    """``−A·ρ`` (0 on padding)."""
    loss2: Tensor
    """``−A·clip(ρ)`` (0 on padding)."""
    per_token: Tensor
    """``ℓ`` (0 on padding)."""
    lower_active: Tensor | None
    """Where the dual clip caps ``ℓ`` (None without dual-clip)."""


def check_policy_clips(
    clip_low: float, clip_high: float | None, dual_clip: float | None
) -> tuple[float, float]:
    """``(ε_low, ε_high)`` checked (``ε_high`` defaults to ``ε_low``), and the dual-clip ``c > 1``."""
    eps_lo = check_nonneg("clip_low", clip_low)
    eps_hi = check_nonneg("clip_high", clip_high if clip_high is not None else clip_low)
    if eps_lo > 1.0:  # 1: the bound 1 − ε_low = 0 is below every ratio (no lower bound)
        raise HyperparameterError(f"clip_low: expected a number in [0, 1], got {clip_low!r}")
    if dual_clip is not None and not (math.isfinite(dual_clip) and dual_clip > 1.0):
        raise HyperparameterError(f"dual_clip: expected a constant c > 1 (or None), got {dual_clip!r}")
    return eps_lo, eps_hi


def policy_terms(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    m: Tensor,
    *,
    eps_lo: float,
    eps_hi: float,
    dual_clip: float | None,
    log_ratio_clamp: float | None,
) -> PolicyTerms:
    """The module docstring's per-token terms of validated inputs (``[b, T]``, elementwise only:
    rows are independent, so a block of rows gives exactly that block of the whole batch's terms)."""
    d, ratio = log_ratio_terms(logp, logp_old, m, log_ratio_clamp)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    # −A, 0 on padding; there ρ = 0 too, so every per-token term below is (±)0 on padding.
    neg_adv = torch.where(m, -advantages, zero).detach()
    loss1 = neg_adv * ratio
    loss2 = neg_adv * torch.clamp(ratio, 1.0 - eps_lo, 1.0 + eps_hi)
    per_token = torch.maximum(loss1, loss2)
    lower_active: Tensor | None = None
    if dual_clip is not None:
        # The cap −c·A applies where A < 0 only (+inf elsewhere).
        cap = torch.where(
            neg_adv > 0, neg_adv * dual_clip, torch.full((), math.inf, dtype=logp.dtype, device=logp.device)
        )
        lower_active = per_token > cap
        per_token = torch.minimum(per_token, cap)
    per_token = torch.where(m, per_token, zero)
    return PolicyTerms(d, ratio, loss1, loss2, per_token, lower_active)


def _checked_policy_inputs(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float | None,
    dual_clip: float | None,
    agg: LossAgg | str,
    log_ratio_clamp: float | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, float, float, LossAgg, float | None]:
    """The clipped surrogate's inputs checked in one place, in one order (:func:`clipped_policy_loss`,
    its row-block twin :func:`refppo.core.by_rows.policy_loss_by_rows` and its naive twin
    :func:`clipped_policy_loss_naive`), so a doubly bad input gets the same first error from each:
    ``(logp, logp_old, advantages, mask, ε_low, ε_high, loss_agg, κ)``, or one clear error naming
    the bad input."""
    m = check_mask("mask", mask)
    advantages = check_bt("advantages", advantages, m)
    eps_lo, eps_hi = check_policy_clips(clip_low, clip_high, dual_clip)
    agg_mode = parse(LossAgg, agg, what="loss_agg")
    logp = check_bt("logp", logp, m)
    logp_old = check_bt("logp_old", logp_old, m)
    check_same_dtype(logp=logp, logp_old=logp_old)
    k = check_positive("log_ratio_clamp", log_ratio_clamp) if log_ratio_clamp is not None else None
    check_same_dtype(logp=logp, advantages=advantages)
    return logp, logp_old, advantages, m, eps_lo, eps_hi, agg_mode, k


@dataclass(frozen=True)
class PolicyTokenLoss:
    """The clipped surrogate before aggregation (:func:`clipped_policy_token_loss`): the per-token
    loss and the statistics, whatever ``loss_agg`` later makes of ``per_token``."""

    per_token: TokenFloat
    """``ℓ_t`` (differentiable), 0 on padding."""
    ratio: TokenFloat
    """``ρ_t`` (differentiable)."""
    clipfrac: Scalar
    clipfrac_lower: Scalar
    approx_kl: Scalar
    approx_kl_k2: Scalar

    def with_loss(self, loss: Scalar) -> PolicyLossOutput:
        """These terms with their aggregated ``loss``."""
        s = self
        stats = (s.clipfrac, s.clipfrac_lower, s.approx_kl, s.approx_kl_k2)
        return PolicyLossOutput(loss, s.per_token, s.ratio, *stats)


def token_statistics(t: PolicyTerms, m: Tensor) -> PolicyTokenLoss:
    """The statistics of the module docstring from the terms ``t`` over the valid tokens of ``m``
    (detached): ``clipfrac``, ``clipfrac_lower`` (0 without a dual clip), ``approx_kl``,
    ``approx_kl_k2``."""
    like = t.ratio
    with torch.no_grad():
        n = float(m.sum())
        clipfrac = (t.loss2 > t.loss1).sum().to(like.dtype) / n  # both 0 on padding: never counted
        if t.lower_active is None:
            clipfrac_lower = torch.zeros((), dtype=like.dtype, device=like.device)
        else:
            clipfrac_lower = t.lower_active.sum().to(like.dtype) / n
        approx_kl = -t.d.sum() / n  # d is 0 on padding
        approx_kl_k2 = 0.5 * (t.d * t.d).sum() / n
    return PolicyTokenLoss(t.per_token, t.ratio, clipfrac, clipfrac_lower, approx_kl, approx_kl_k2)


def clipped_policy_token_loss(
    logp: TokenFloat,
    logp_old: TokenFloat,
    advantages: TokenFloat,
    mask: ResponseMask,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    log_ratio_clamp: float | None = None,
) -> PolicyTokenLoss:
    """The clipped surrogate per token and its statistics (module docstring), not aggregated:
    :func:`clipped_policy_loss` is ``agg`` of its ``per_token``."""
    c = _checked_policy_inputs(
        logp, logp_old, advantages, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
        agg=LossAgg.TOKEN_MEAN, log_ratio_clamp=log_ratio_clamp,
    )  # fmt: skip
    logp, logp_old, advantages, m, eps_lo, eps_hi, _, k = c
    t = policy_terms(
        logp, logp_old, advantages, m, eps_lo=eps_lo, eps_hi=eps_hi, dual_clip=dual_clip, log_ratio_clamp=k
    )
    return token_statistics(t, m)


def clipped_policy_loss(
    logp: TokenFloat,
    logp_old: TokenFloat,
    advantages: TokenFloat,
    mask: ResponseMask,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    agg: LossAgg | str = LossAgg.TOKEN_MEAN,
    log_ratio_clamp: float | None = None,
    token_count: float | None = None,
    seq_count: float | None = None,
    horizon: float | None = None,
) -> PolicyLossOutput:
    """The clipped surrogate (module docstring). ``clip_high`` defaults to ``clip_low``."""
    c = _checked_policy_inputs(
        logp, logp_old, advantages, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
        agg=agg, log_ratio_clamp=log_ratio_clamp,
    )  # fmt: skip
    logp, logp_old, advantages, m, eps_lo, eps_hi, agg_mode, k = c
    t = policy_terms(
        logp, logp_old, advantages, m, eps_lo=eps_lo, eps_hi=eps_hi, dual_clip=dual_clip, log_ratio_clamp=k
    )
    loss = aggregate_masked(
        t.per_token, m, agg_mode, token_count=token_count, seq_count=seq_count, horizon=horizon
    )
    return token_statistics(t, m).with_loss(loss)


def approx_kl_k2_all_positions(logp: TokenFloat, logp_old: TokenFloat, mask: ResponseMask) -> Scalar:
    """TRL's ``approxkl``: ``½·Σ_valid (l − l^old)² / (B·T)``, a mean over all B·T positions with
    padding counted as 0 (:class:`refppo.conventions.ApproxKL` ``k2_all_positions``; detached).

    ``d = l − l^old`` is made once and masked and squared in place (one float ``[B, T]`` buffer and
    one bool: the inverted mask), then summed as a whole: the same elementwise values and the same
    sum as ``where(m, l − l^old, 0)`` squared out of place."""
    m = check_mask("mask", mask, require_nonempty_rows=False)
    logp = check_bt("logp", logp, m)
    logp_old = check_bt("logp_old", logp_old, m)
    with torch.no_grad():
        d = logp - logp_old
        d.masked_fill_(m.logical_not(), 0.0)
        return 0.5 * d.mul_(d).sum() / d.numel()


def approx_kl_k2_all_positions_naive(logp: Tensor, logp_old: Tensor, mask: Tensor) -> float:
    """Naive twin of :func:`approx_kl_k2_all_positions`, token by token."""
    lp, lo, ms = pf.rows(logp), pf.rows(logp_old), pf.mask_rows(mask)
    total = 0.0
    for prow, orow, mrow in zip(lp, lo, ms, strict=True):
        for p, o, ok in zip(prow, orow, mrow, strict=True):
            if ok:
                total += 0.5 * (p - o) ** 2
    return total / (len(ms) * len(ms[0]))


@dataclass(frozen=True)
class PolicyLossNaive:
    """What :func:`clipped_policy_loss_naive` returns (floats; per-token lists are 0 on padding)."""

    loss: float
    per_token: list[list[float]]
    ratio: list[list[float]]
    clipfrac: float
    clipfrac_lower: float
    approx_kl: float
    approx_kl_k2: float


def _policy_token_naive(
    d: float, a: float, clip_low: float, eps_hi: float, dual_clip: float | None, log_ratio_clamp: float | None
) -> tuple[float, float, bool, bool]:
    """One valid token of :func:`clipped_policy_loss_naive`, ``d = l − l^old``: ``(ℓ, ρ, clipped,
    lower)``; ``ℓ = max(−Aρ, −A·clip(ρ, 1−ε_low, 1+ε_high))`` with ``ρ = exp(clamp(d, ±κ))``,
    ``clipped`` when the clipped term wins strictly, ``lower`` when dual-clip caps ``ℓ`` at ``−cA``."""
    if log_ratio_clamp is not None:
        d = min(max(d, -log_ratio_clamp), log_ratio_clamp)
    r = math.exp(d)
    r_clipped = min(max(r, 1.0 - clip_low), 1.0 + eps_hi)
    unclipped_term = -a * r
    clipped_term = -a * r_clipped
    loss = max(unclipped_term, clipped_term)
    clipped = clipped_term > unclipped_term
    if dual_clip is not None and a < 0 and loss > -a * dual_clip:
        return -a * dual_clip, r, clipped, True
    return loss, r, clipped, False


def clipped_policy_loss_naive(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    agg: LossAgg | str = LossAgg.TOKEN_MEAN,
    log_ratio_clamp: float | None = None,
    token_count: float | None = None,
    seq_count: float | None = None,
    horizon: float | None = None,
) -> PolicyLossNaive:
    """Naive twin of :func:`clipped_policy_loss`, case by case on each token."""
    _checked_policy_inputs(  # the same refusals as the vectorized function (the math below is separate)
        logp, logp_old, advantages, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
        agg=agg, log_ratio_clamp=log_ratio_clamp,
    )  # fmt: skip
    eps_hi = clip_high if clip_high is not None else clip_low
    lp, lo, advs, ms = pf.rows(logp), pf.rows(logp_old), pf.rows(advantages), pf.mask_rows(mask)
    per_token, ratios = [], []
    n_valid = n_clipped = n_lower = 0
    kl_sum = kl2_sum = 0.0
    for b in range(len(ms)):
        prow, rrow = [], []
        for t in range(len(ms[b])):
            if not ms[b][t]:
                prow.append(0.0)
                rrow.append(0.0)
                continue
            n_valid += 1
            d = lp[b][t] - lo[b][t]
            kl_sum += -d
            kl2_sum += 0.5 * d * d
            loss, r, clipped, lower = _policy_token_naive(
                d, advs[b][t], clip_low, eps_hi, dual_clip, log_ratio_clamp
            )
            n_clipped += clipped
            n_lower += lower
            prow.append(loss)
            rrow.append(r)
        per_token.append(prow)
        ratios.append(rrow)
    agg_value = aggregate_loss_naive(
        torch.tensor(per_token, dtype=torch.float64, device=mask.device), mask, agg, token_count=token_count,
        seq_count=seq_count, horizon=horizon,
    ).item()  # fmt: skip
    return PolicyLossNaive(
        loss=agg_value,
        per_token=per_token,
        ratio=ratios,
        clipfrac=n_clipped / n_valid,
        clipfrac_lower=n_lower / n_valid,
        approx_kl=kl_sum / n_valid,
        approx_kl_k2=kl2_sum / n_valid,
    )
