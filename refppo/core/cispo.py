"""CISPO and REINFORCE with importance weights: a detached weight times the log-prob itself.

Symbols as :mod:`refppo.core.policy`; ``sg`` stop-gradient; all ``[B, T]``::

    weighted REINFORCE:  ℓ_t = −w_t·A_t·l_t       ∂ℓ_t/∂l_t = −w_t·A_t for a detached w (the weight is
                                                   used as given: pass a detached one)
    CISPO:               ρ_t = exp(clamp(l_t − l^old_t, ±κ))
                         ℓ_t = −sg(clip(ρ_t, 1−ε_low, 1+ε_high))·w'_t·A_t·l_t  (ε_low None: no lower
                         bound, as ε_low = 1: ρ > 0; w' an optional rollout-correction weight, 1
                         without: verl multiplies)
    pg_loss = agg(ℓ)

CISPO (MiniMax-M1, Chen et al. 2025, arXiv 2506.13585) clips the importance weight, not the
update: unlike the clipped surrogate every token keeps a gradient, ``−c_t·A_t`` with ``c_t`` the
clipped ratio, in every region. The value carries ``l_t`` (it is not a surrogate of the objective's
value). As verl 0.9.1 ``core_algos.py::compute_policy_loss_cispo`` (``[1−clip_ratio_low,
1+clip_ratio_high]``, κ = 20), SkyRL-train 0.3.1 ``ppo_utils.py::compute_policy_loss_cispo``
(``cispo_eps_clip_low/high``, κ = 20 in float32) and TRL 1.16.0 ``GRPOTrainer._compute_loss``
(``loss_type="cispo"``: ``min(ρ, ε_max)`` with ``ε_max`` its ``epsilon_high``, no κ; i.e. ε_low None
or 1, ε_high = ε_max − 1; summed over the batch's tokens / ``num_items_in_batch``: ``token-mean``
for one process, no accumulation; its logged ``cispo_clip_ratio`` counts ``ρ > ε_max`` on ``A > 0``
only, not refppo's ``clipfrac``). The weighted
REINFORCE is verl 0.9.1 ``compute_policy_loss_reinforce`` (its ``bypass_mode`` with
``loss_type: reinforce``: ``w = π_θ/π^beh`` truncated, computed under ``no_grad``).

Statistics: ``clipfrac = mean_valid[ρ < 1−ε_low or ρ > 1+ε_high]`` (verl ``ratio != clipped``,
SkyRL ``is_clipped``), ``approx_kl = mean_valid(l^old − l)``, ``approx_kl_k2 = ½ mean_valid(d²)``;
``clipfrac_lower`` is 0.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from refppo.conventions import LossAgg, parse
from refppo.core import _pyfloat as pf
from refppo.core.aggregate import aggregate_loss_naive, aggregate_masked
from refppo.core.checks import check_bt, check_mask, check_nonneg, check_positive, check_same_dtype
from refppo.core.policy import PolicyLossNaive, PolicyLossOutput
from refppo.core.rollout_losses import DEFAULT_NORMS, Norms
from refppo.errors import HyperparameterError
from refppo.types import ResponseMask, TokenFloat


def _checked_base(
    logp: Tensor, advantages: Tensor, mask: Tensor, norms: Norms
) -> tuple[Tensor, Tensor, Tensor, LossAgg]:
    m = check_mask("mask", mask)
    logp = check_bt("logp", logp, m)
    advantages = check_bt("advantages", advantages, m)
    check_same_dtype(logp=logp, advantages=advantages)
    return logp, advantages, m, parse(LossAgg, norms.agg, what="loss_agg")


def _agg(per_token: Tensor, m: Tensor, agg: LossAgg, norms: Norms) -> Tensor:
    n = norms
    return aggregate_masked(
        per_token, m, agg, token_count=n.token_count, seq_count=n.seq_count, horizon=n.horizon
    )


def weighted_logprob_loss(
    logp: TokenFloat,
    weight: TokenFloat,
    advantages: TokenFloat,
    mask: ResponseMask,
    *,
    norms: Norms = DEFAULT_NORMS,
) -> tuple[Tensor, TokenFloat]:
    """Weighted REINFORCE (module docstring): ``(pg_loss, ℓ)``; ``weight`` as given (detach it to
    keep the gradient to ``−w·A``; a differentiable one adds ``−A·l·∂w/∂l``: verl issue #4105)."""
    logp, advantages, m, agg = _checked_base(logp, advantages, mask, norms)
    weight = check_bt("weight", weight, m)
    check_same_dtype(logp=logp, weight=weight)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    coef = torch.where(m, -weight * advantages.detach(), zero)
    per_token = torch.where(m, coef * torch.where(m, logp, zero), zero)
    return _agg(per_token, m, agg, norms), per_token


def _checked_cispo_clips(clip_low: float | None, clip_high: float) -> tuple[float | None, float]:
    lo = check_nonneg("clip_low", clip_low) if clip_low is not None else None
    if lo is not None and lo > 1.0:
        raise HyperparameterError(f"clip_low: expected a number in [0, 1] or None, got {clip_low!r}")
    # ε_low = 1: the bound 0 is below every ρ = exp(·) > 0 (and an underflowed 0 is not < 0): no bound.
    return (1.0 - lo if lo is not None and lo < 1.0 else None), 1.0 + check_nonneg("clip_high", clip_high)


def _checked_cispo(
    logp: Tensor, logp_old: Tensor, advantages: Tensor, mask: Tensor, clips: tuple[float | None, float],
    log_ratio_clamp: float | None, norms: Norms,
) -> tuple[Tensor, Tensor, Tensor, Tensor, LossAgg, float | None, float, float | None]:  # fmt: skip
    """CISPO's inputs in one order: ``(l, l^old, A, m, loss_agg, lower, upper, κ)``."""
    logp, advantages, m, agg = _checked_base(logp, advantages, mask, norms)
    logp_old = check_bt("logp_old", logp_old, m)
    check_same_dtype(logp=logp, logp_old=logp_old)
    lower, upper = _checked_cispo_clips(*clips)
    k = check_positive("log_ratio_clamp", log_ratio_clamp) if log_ratio_clamp is not None else None
    return logp, logp_old, advantages, m, agg, lower, upper, k


def _checked_weight(weight: Tensor | None, logp: Tensor, m: Tensor) -> Tensor | None:
    if weight is None:
        return None
    w = check_bt("weight", weight, m)
    check_same_dtype(logp=logp, weight=w)
    return w


def cispo_policy_loss(
    logp: TokenFloat,
    logp_old: TokenFloat,
    advantages: TokenFloat,
    mask: ResponseMask,
    *,
    clip_low: float | None = 0.2,
    clip_high: float = 0.2,
    log_ratio_clamp: float | None = None,
    weight: TokenFloat | None = None,
    norms: Norms = DEFAULT_NORMS,
) -> PolicyLossOutput:
    """CISPO (module docstring); ``per_token`` is ``ℓ``, ``ratio`` the unclipped ``ρ`` (detached);
    ``weight`` is ``w'`` (used as given)."""
    c = _checked_cispo(logp, logp_old, advantages, mask, (clip_low, clip_high), log_ratio_clamp, norms)
    lp, lo, adv, m, agg, lower, upper, k = c
    w = _checked_weight(weight, lp, m)
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    with torch.no_grad():
        d = torch.where(m, lp - lo, zero)
        ratio = torch.where(m, torch.exp(torch.clamp(d, -k, k) if k is not None else d), zero)
        coef = torch.clamp(ratio, min=lower, max=upper)
        n = float(m.sum())
        outside = (ratio > upper) | ((ratio < lower) if lower is not None else torch.zeros_like(m))
        clipfrac = (outside & m).sum().to(lp.dtype) / n
        approx_kl, approx_kl_k2 = -d.sum() / n, 0.5 * (d * d).sum() / n
    coef = coef if w is None else coef * w
    per_token = torch.where(m, -coef * adv.detach() * torch.where(m, lp, zero), zero)
    loss = _agg(per_token, m, agg, norms)
    return PolicyLossOutput(loss, per_token, ratio, clipfrac, zero, approx_kl, approx_kl_k2)


def cispo_policy_loss_naive(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float | None = 0.2,
    clip_high: float = 0.2,
    log_ratio_clamp: float | None = None,
    weight: Tensor | None = None,
    norms: Norms = DEFAULT_NORMS,
) -> PolicyLossNaive:
    """Naive twin of :func:`cispo_policy_loss`, token by token."""
    c = _checked_cispo(logp, logp_old, advantages, mask, (clip_low, clip_high), log_ratio_clamp, norms)
    *_, lower, upper, k = c
    _checked_weight(weight, c[0], c[3])
    lp, lo, advs, ms = pf.rows(logp), pf.rows(logp_old), pf.rows(advantages), pf.mask_rows(mask)
    ws = pf.rows(weight) if weight is not None else [[1.0] * len(r) for r in ms]
    per_token, ratios, n, n_out, kl, kl2 = [], [], 0, 0, 0.0, 0.0
    for prow, orow, arow, wrow, mrow in zip(lp, lo, advs, ws, ms, strict=True):
        trow, rrow = [], []
        for p, o, a, w, ok in zip(prow, orow, arow, wrow, mrow, strict=True):
            if not ok:
                trow.append(0.0)
                rrow.append(0.0)
                continue
            d = p - o
            r = math.exp(min(max(d, -k), k) if k is not None else d)
            clipped = min(max(r, lower), upper) if lower is not None else min(r, upper)
            trow.append(-clipped * w * a * p)
            rrow.append(r)
            n, n_out = n + 1, n_out + (r > upper or (lower is not None and r < lower))
            kl, kl2 = kl - d, kl2 + d * d / 2
        per_token.append(trow)
        ratios.append(rrow)
    pt = torch.tensor(per_token, dtype=torch.float64, device=mask.device)
    total = aggregate_loss_naive(
        pt, mask, norms.agg, token_count=norms.token_count, seq_count=norms.seq_count, horizon=norms.horizon
    ).item()
    return PolicyLossNaive(total, per_token, ratios, n_out / n, 0.0, kl / n, kl2 / n)


def weighted_logprob_loss_naive(
    logp: Tensor, weight: Tensor, advantages: Tensor, mask: Tensor, *, norms: Norms = DEFAULT_NORMS
) -> tuple[float, list[list[float]]]:
    """Naive twin of :func:`weighted_logprob_loss`: ``−w·A·l`` token by token, then ``agg``."""
    _checked_base(logp, advantages, mask, norms)
    check_same_dtype(logp=logp, weight=check_bt("weight", weight, check_mask("mask", mask)))
    lp, ws, advs, ms = pf.rows(logp), pf.rows(weight), pf.rows(advantages), pf.mask_rows(mask)
    per_token = [
        [-w * a * p if ok else 0.0 for p, w, a, ok in zip(*rows, strict=True)]
        for rows in zip(lp, ws, advs, ms, strict=True)
    ]
    pt = torch.tensor(per_token, dtype=torch.float64, device=mask.device)
    n = norms
    total = aggregate_loss_naive(
        pt, mask, n.agg, token_count=n.token_count, seq_count=n.seq_count, horizon=n.horizon
    ).item()
    return total, per_token


__all__ = [
    "cispo_policy_loss",
    "cispo_policy_loss_naive",
    "weighted_logprob_loss",
    "weighted_logprob_loss_naive",
]
