"""GSPO: the clipped surrogate with a sequence-level importance ratio (Zheng et al. 2025, arXiv 2507.18071).

Symbols as :mod:`refppo.core.policy`; ``d_t = l_t − l^old_t``, ``L_b`` the valid tokens of row b,
``sg`` stop-gradient (``detach``), ``κ`` an optional *upper* clamp of the log-ratio::

    S_b     = (1/L_b)·Σ_t m_t·d_t                        length-normalised sequence log-ratio
    log s_t = min(l_t − sg(l_t) + sg(S_b), κ)           value S_b (clamped), gradient 1 w.r.t. l_t
    s_t     = exp(log s_t)                               = s_b = exp(S_b) on every token of row b
    ℓ_t     = max(−A_t·s_t, −A_t·clip(s_t, 1−ε_low, 1+ε_high))
    pg_loss = agg(ℓ)

This is the paper's "GSPO-token" form, as verl 0.9.1
``verl/trainer/ppo/core_algos.py::compute_policy_loss_gspo`` (policy loss mode ``gspo``; κ = 10
hard-coded there, no dual-clip). Every token of a row sees the *same* ratio ``s_b``, so the clip
decision is per sequence (per token only through the sign of ``A_t``); the gradient w.r.t. ``l_t`` is
``−A_t·s_b·w(b,t)`` where the unclipped branch is active (tie rules as refppo/core/grad.py) and
``S_b ≤ κ``, else 0. With an advantage constant along the row (outcome rewards) and
``seq-mean-token-mean`` this is the gradient of the sequence-level GSPO objective
``mean_b max(−A_b·s_b, −A_b·clip(s_b))``, whose ``∂/∂l_t = ∂/∂S_b · 1/L_b``.

Statistics as :func:`~refppo.core.policy.clipped_policy_loss` (``clipfrac = mean[L2 > L1]`` over
valid tokens, ``approx_kl``, ``approx_kl_k2`` from the token log-ratios); ``clipfrac_lower`` is 0.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from refppo.conventions import LossAgg, parse
from refppo.core import _pyfloat as pf
from refppo.core._ties import clamp, inside, shares
from refppo.core.aggregate import agg_weights_naive, aggregate_loss_naive, aggregate_masked
from refppo.core.checks import (
    check_bt,
    check_mask,
    check_nonneg,
    check_positive,
    check_same_dtype,
    count_true,
)
from refppo.core.policy import (
    PolicyLossNaive,
    PolicyLossOutput,
    PolicyTerms,
    PolicyTokenLoss,
    token_statistics,
)
from refppo.errors import HyperparameterError
from refppo.types import ResponseMask, TokenFloat


def _check_clips(clip_low: float, clip_high: float | None) -> tuple[float, float]:
    eps_lo = check_nonneg("clip_low", clip_low)
    eps_hi = check_nonneg("clip_high", clip_high if clip_high is not None else clip_low)
    if eps_lo > 1.0:  # 1: the bound 1 − ε_low = 0 is below every ratio (no lower bound)
        raise HyperparameterError(f"clip_low: expected a number in [0, 1], got {clip_low!r}")
    return eps_lo, eps_hi


def _checked_gspo_inputs(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float | None,
    agg: LossAgg | str,
    log_ratio_max: float | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, float, float, LossAgg, float | None]:
    """The GSPO loss's inputs checked in one place, in one order (:func:`gspo_policy_loss`, its
    row-block twin :func:`refppo.core.by_rows.policy_loss_by_rows` with ``gspo=True``, and the
    naive twins :func:`gspo_policy_loss_naive`, :func:`gspo_policy_grad_naive`), so a doubly bad
    input gets the same first error from each, and κ is named ``log_ratio_max`` everywhere:
    ``(logp, logp_old, advantages, mask, ε_low, ε_high, loss_agg, κ)``, or one clear error."""
    m = check_mask("mask", mask)
    logp = check_bt("logp", logp, m)
    logp_old = check_bt("logp_old", logp_old, m)
    advantages = check_bt("advantages", advantages, m)
    check_same_dtype(logp=logp, logp_old=logp_old, advantages=advantages)
    eps_lo, eps_hi = _check_clips(clip_low, clip_high)
    agg_mode = parse(LossAgg, agg, what="loss_agg")
    k = check_positive("log_ratio_max", log_ratio_max) if log_ratio_max is not None else None
    return logp, logp_old, advantages, m, eps_lo, eps_hi, agg_mode, k


def gspo_policy_token_loss(
    logp: TokenFloat,
    logp_old: TokenFloat,
    advantages: TokenFloat,
    mask: ResponseMask,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    log_ratio_max: float | None = None,
) -> PolicyTokenLoss:
    """The GSPO surrogate per token and its statistics, not aggregated: :func:`gspo_policy_loss` is
    ``agg`` of its ``per_token``."""
    logp, logp_old, advantages, m, eps_lo, eps_hi, _, k = _checked_gspo_inputs(
        logp, logp_old, advantages, mask, clip_low=clip_low, clip_high=clip_high, agg=LossAgg.TOKEN_MEAN,
        log_ratio_max=log_ratio_max,
    )  # fmt: skip
    t = gspo_terms(logp, logp_old, advantages, m, eps_lo=eps_lo, eps_hi=eps_hi, log_ratio_max=k)
    return token_statistics(t, m)


def gspo_policy_loss(
    logp: TokenFloat,
    logp_old: TokenFloat,
    advantages: TokenFloat,
    mask: ResponseMask,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    agg: LossAgg | str = LossAgg.TOKEN_MEAN,
    log_ratio_max: float | None = None,
    token_count: float | None = None,
    seq_count: float | None = None,
    horizon: float | None = None,
) -> PolicyLossOutput:
    """The GSPO surrogate (module docstring); ``log_ratio_max`` is κ (verl: 10)."""
    logp, logp_old, advantages, m, eps_lo, eps_hi, agg_mode, k = _checked_gspo_inputs(
        logp, logp_old, advantages, mask, clip_low=clip_low, clip_high=clip_high, agg=agg,
        log_ratio_max=log_ratio_max,
    )  # fmt: skip
    t = gspo_terms(logp, logp_old, advantages, m, eps_lo=eps_lo, eps_hi=eps_hi, log_ratio_max=k)
    loss = aggregate_masked(
        t.per_token, m, agg_mode, token_count=token_count, seq_count=seq_count, horizon=horizon
    )
    return token_statistics(t, m).with_loss(loss)


def gspo_terms(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    m: Tensor,
    *,
    eps_lo: float,
    eps_hi: float,
    log_ratio_max: float | None,
) -> PolicyTerms:
    """The per-token terms of validated inputs ``[b, T]`` (module docstring). Each row alone: ``S_b``
    reduces its own row, the rest is elementwise, so a block of whole rows gives that block's terms."""
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    d, ratio = _seq_ratio(logp, logp_old, m, log_ratio_max)
    neg_adv = torch.where(m, -advantages, zero).detach()
    loss1 = neg_adv * ratio
    loss2 = neg_adv * torch.clamp(ratio, 1.0 - eps_lo, 1.0 + eps_hi)
    per_token = torch.where(m, torch.maximum(loss1, loss2), zero)
    return PolicyTerms(d, ratio, loss1, loss2, per_token, None)


def _seq_ratio(
    logp: Tensor, logp_old: Tensor, m: Tensor, log_ratio_max: float | None
) -> tuple[Tensor, Tensor]:
    """``(d, s)`` of validated inputs ``[b, T]``: ``d = m·(l − l^old)`` and the sequence ratio ``s_t``
    of the module docstring on every valid token (value ``exp(min(S_b, κ))``, gradient w.r.t. ``l_t``)."""
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    lp = torch.where(m, logp, zero)  # padding never reaches exp (NaN·0 in the backward pass)
    d = torch.where(m, lp - logp_old, zero)
    seq = (d.sum(dim=1) / count_true(m, 1).to(d.dtype)).detach()
    log_s = lp - lp.detach() + seq.unsqueeze(1)
    if log_ratio_max is not None:
        log_s = torch.clamp(log_s, max=log_ratio_max)
    return d, torch.where(m, torch.exp(log_s), zero)


def gspo_ratio(
    logp: TokenFloat, logp_old: TokenFloat, mask: ResponseMask, *, log_ratio_max: float | None = None
) -> TokenFloat:
    """The sequence ratio ``s_b`` on every valid token of row b (0 on padding), detached: the ratio
    :func:`gspo_policy_loss` clips."""
    m = check_mask("mask", mask)
    logp = check_bt("logp", logp, m)
    logp_old = check_bt("logp_old", logp_old, m)
    k = check_positive("log_ratio_max", log_ratio_max) if log_ratio_max is not None else None
    with torch.no_grad():
        return _seq_ratio(logp, logp_old, m, k)[1]


def _seq_log_ratios(lp: list[list[float]], lo: list[list[float]], ms: list[list[bool]]) -> list[float]:
    """``S_b``: the mean of ``l − l^old`` over each row's valid tokens."""
    out = []
    for prow, orow, mrow in zip(lp, lo, ms, strict=True):
        ds = [p - o for p, o, ok in zip(prow, orow, mrow, strict=True) if ok]
        out.append(sum(ds) / len(ds))
    return out


def gspo_policy_loss_naive(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    agg: LossAgg | str = LossAgg.TOKEN_MEAN,
    log_ratio_max: float | None = None,
    token_count: float | None = None,
    seq_count: float | None = None,
    horizon: float | None = None,
) -> PolicyLossNaive:
    """Naive twin of :func:`gspo_policy_loss`: one sequence ratio per row, then token by token."""
    _checked_gspo_inputs(  # the same refusals as the vectorized function (the math below is separate)
        logp, logp_old, advantages, mask, clip_low=clip_low, clip_high=clip_high, agg=agg,
        log_ratio_max=log_ratio_max,
    )  # fmt: skip
    eps_hi = clip_high if clip_high is not None else clip_low
    lp, lo, advs, ms = pf.rows(logp), pf.rows(logp_old), pf.rows(advantages), pf.mask_rows(mask)
    seqs = _seq_log_ratios(lp, lo, ms)
    per_token, ratios = [], []
    n_valid = n_clipped = 0
    kl_sum = kl2_sum = 0.0
    for b, mrow in enumerate(ms):
        s = math.exp(clamp(seqs[b], None, log_ratio_max))
        prow, rrow = [], []
        for t, ok in enumerate(mrow):
            if not ok:
                prow.append(0.0)
                rrow.append(0.0)
                continue
            d = lp[b][t] - lo[b][t]
            n_valid += 1
            kl_sum += -d
            kl2_sum += 0.5 * d * d
            unclipped, clipped = -advs[b][t] * s, -advs[b][t] * clamp(s, 1.0 - clip_low, 1.0 + eps_hi)
            n_clipped += clipped > unclipped
            prow.append(max(unclipped, clipped))
            rrow.append(s)
        per_token.append(prow)
        ratios.append(rrow)
    total = aggregate_loss_naive(
        torch.tensor(per_token, dtype=torch.float64, device=mask.device),
        mask,
        agg,
        token_count=token_count,
        seq_count=seq_count,
        horizon=horizon,
    ).item()
    return PolicyLossNaive(
        total, per_token, ratios, n_clipped / n_valid, 0.0, kl_sum / n_valid, kl2_sum / n_valid
    )


def gspo_policy_grad_naive(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    agg: LossAgg | str = LossAgg.TOKEN_MEAN,
    log_ratio_max: float | None = None,
    token_count: float | None = None,
    seq_count: float | None = None,
    horizon: float | None = None,
) -> Tensor:
    """``∂pg_loss/∂logp`` ``[B, T]`` (float64) of :func:`gspo_policy_loss`:
    ``w·(−A)·(s1 + s2·[1−ε_low ≤ s_b ≤ 1+ε_high])·s_b·[S_b ≤ κ]`` (shares as refppo/core/grad.py)."""
    _checked_gspo_inputs(  # the same refusals as the vectorized function (the math below is separate)
        logp, logp_old, advantages, mask, clip_low=clip_low, clip_high=clip_high, agg=agg,
        log_ratio_max=log_ratio_max,
    )  # fmt: skip
    eps_hi = clip_high if clip_high is not None else clip_low
    w = agg_weights_naive(mask, agg, token_count=token_count, seq_count=seq_count, horizon=horizon)
    lp, lo, advs, ms = pf.rows(logp), pf.rows(logp_old), pf.rows(advantages), pf.mask_rows(mask)
    seqs = _seq_log_ratios(lp, lo, ms)
    lo_b, hi_b = 1.0 - clip_low, 1.0 + eps_hi
    out: list[list[float]] = []
    for b, mrow in enumerate(ms):
        s = math.exp(clamp(seqs[b], None, log_ratio_max))
        passes = float(inside(seqs[b], None, log_ratio_max))
        row = []
        for t, ok in enumerate(mrow):
            neg_a = -advs[b][t] if ok else 0.0
            s1, s2 = shares(neg_a * s, neg_a * clamp(s, lo_b, hi_b))
            g = neg_a * (s1 + s2 * float(inside(s, lo_b, hi_b))) * s * passes
            row.append(w[b][t] * g if ok else 0.0)
        out.append(row)
    return torch.tensor(out, dtype=torch.float64, device=logp.device)
