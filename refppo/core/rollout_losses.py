"""The clipped surrogate with a rollout-correction weight, and AReaL's decoupled PPO objective.

Symbols as :mod:`refppo.core.policy` (``l`` current, ``l^old`` the proximal / old log-probs, ``A``,
``ε_low``, ``ε_high``, dual-clip ``c``) and :mod:`refppo.core.rollout_correction` (``w'`` the applied
importance weight, ``keep``), all ``[B, T]``::

    ℓ^PPO_t  = max(−A_t·ρ_t, −A_t·clip(ρ_t, 1−ε_low, 1+ε_high))   (dual: min(·, −c·A_t) where A_t < 0)
    ℓ_t      = keep_t·w'_t·ℓ^PPO_t                                  the weight multiplies the surrogate
    pg_loss  = agg(ℓ) over m             Rejected zero: the normalisers count every valid token
             = agg(ℓ) over m·keep        Rejected drop: token / sequence counts of the kept tokens,
                                          a row without a kept token leaves the sequence count

``∂ℓ_t/∂l_t = w'_t·∂ℓ^PPO_t/∂l_t`` for a detached ``w'`` (the clip truth table of spec/ppo.md scaled by
``w'``); with ``w' = 1`` and every token kept it is :func:`refppo.core.policy.clipped_policy_loss`
bit for bit. The weight multiplies the policy surrogate only, never the statistics: ``clipfrac``,
``clipfrac_lower``, ``approx_kl``, ``approx_kl_k2`` are the unweighted ones of
:func:`~refppo.core.policy.clipped_policy_loss` over the aggregation mask (0 when nothing is kept).
verl 0.9.1 ``core_algos.py::compute_policy_loss_vanilla`` (``pg_losses * rollout_is_weights`` after
the dual clip), SkyRL-train 0.3.1 ``ppo_utils.py::ppo_policy_loss`` (``use_tis``), OpenRLHF 0.11.2
``models/loss.py::PolicyLoss`` (``coef * loss``), TRL 1.16.0 ``GRPOTrainer._compute_loss``
(``per_token_loss * importance_sampling_ratio``, before the KL term is added).

Decoupled PPO (Fu et al. 2025, AReaL, arXiv 2505.24298; AReaL 1.0.4
``areal/utils/functional/functional.py::ppo_actor_loss_fn``): the clipped surrogate against the
proximal policy, ``ρ_t = π_θ/π^prox``, times the behaviour weight ``w'_t`` of ``π^prox/π^beh``
(:func:`~refppo.core.rollout_correction.is_weights` of ``(l^prox, l^beh)``: capped or masked,
detached), token-mean over the valid tokens with rejected tokens at 0 (``Rejected.zero``: AReaL
divides by the original ``loss_mask`` count).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from refppo.conventions import LossAgg, parse
from refppo.core import _pyfloat as pf
from refppo.core.aggregate import _checked_norms, aggregate_loss_naive, aggregate_masked
from refppo.core.checks import check_bt, check_same_dtype, count_true
from refppo.core.policy import (
    PolicyLossNaive,
    PolicyLossOutput,
    _checked_policy_inputs,
    _policy_token_naive,
    policy_terms,
    token_statistics,
)
from refppo.core.rollout_correction import ISWeights, is_weights, is_weights_naive
from refppo.errors import DtypeError
from refppo.rollout_conventions import ISAgg, ISLevel, ISMode, Rejected
from refppo.types import ResponseMask, TokenFloat


@dataclass(frozen=True)
class PolicyClip:
    """The clipped surrogate's settings: ``ε_low``, ``ε_high`` (None: ``ε_low``), dual-clip ``c``,
    the ratio's log clamp ``κ`` (verl, OpenRLHF: 20)."""

    clip_low: float = 0.2
    clip_high: float | None = None
    dual_clip: float | None = None
    log_ratio_clamp: float | None = None


@dataclass(frozen=True)
class Norms:
    """``loss_agg`` and the global normalisers of :func:`refppo.core.aggregate.aggregate_loss`."""

    agg: LossAgg | str = LossAgg.TOKEN_MEAN
    token_count: float | None = None
    seq_count: float | None = None
    horizon: float | None = None


Checked = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Rejected, float, float, LossAgg, float | None]
"""``(l, l^old, A, m, w', kept, rejected, ε_low, ε_high, loss_agg, κ)`` of :func:`_checked`."""


DEFAULT_CLIP = PolicyClip()
DEFAULT_NORMS = Norms()
"""The defaults (token-mean, ε = 0.2, no dual clip, no clamp): immutable, shared."""


def _checked(
    logp: Tensor, logp_old: Tensor, advantages: Tensor, mask: Tensor, weight: Tensor, keep: Tensor | None,
    rejected: object, clip: PolicyClip, norms: Norms,
) -> Checked:  # fmt: skip
    """:func:`corrected_policy_loss`'s inputs checked in one order (vectorized and naive twin)."""
    c = _checked_policy_inputs(
        logp, logp_old, advantages, mask, clip_low=clip.clip_low, clip_high=clip.clip_high,
        dual_clip=clip.dual_clip, agg=norms.agg, log_ratio_clamp=clip.log_ratio_clamp,
    )  # fmt: skip
    lp, lo, adv, m, eps_lo, eps_hi, agg, k = c
    weight = check_bt("weight", weight, m)
    check_same_dtype(logp=lp, weight=weight)
    kept = m
    if keep is not None:
        kt = check_bt("keep", keep, m, float_required=False)
        if kt.dtype != torch.bool:
            raise DtypeError(f"keep: expected a bool tensor (the kept tokens), got dtype {kt.dtype}")
        kept = m & kt
    rj = parse(Rejected, rejected if isinstance(rejected, str) else repr(rejected), what="rejected")
    _checked_norms(agg, norms.token_count, norms.seq_count, norms.horizon)
    return lp, lo, adv, m, weight, kept, rj, eps_lo, eps_hi, agg, k


def _aggregate_kept(lm: Tensor, kept: Tensor, norms: Norms) -> Tensor:
    """``agg(lm)`` over the kept tokens (``Rejected.drop``): ``lm`` is 0 off ``kept``; token-mean
    over ``Σ kept``, seq modes over the rows with a kept token; 0 when nothing is kept."""
    agg = parse(LossAgg, norms.agg, what="loss_agg")
    per_row = count_true(kept, 1)
    if int(per_row.sum()) == 0:
        return lm.sum()  # 0, and a zero gradient (every term is 0)
    if agg is LossAgg.TOKEN_SUM:
        return lm.sum()
    if agg is LossAgg.TOKEN_MEAN:
        return lm.sum() / (norms.token_count or float(per_row.sum()))
    n_seq = norms.seq_count or float((per_row > 0).sum())
    if agg is LossAgg.SEQ_MEAN_TOKEN_MEAN:
        return (lm.sum(dim=1) / per_row.clamp(min=1).to(lm.dtype)).sum() / n_seq
    if agg is LossAgg.SEQ_MEAN_TOKEN_SUM:
        return lm.sum() / n_seq
    return lm.sum() / n_seq / (norms.horizon or float(lm.shape[1]))


def corrected_policy_loss(
    logp: TokenFloat,
    logp_old: TokenFloat,
    advantages: TokenFloat,
    mask: ResponseMask,
    weight: TokenFloat,
    *,
    keep: Tensor | None = None,
    rejected: Rejected | str = Rejected.ZERO,
    clip: PolicyClip = DEFAULT_CLIP,
    norms: Norms = DEFAULT_NORMS,
) -> PolicyLossOutput:
    """The weighted clipped surrogate of the module docstring. ``weight`` is ``w'`` as given (pass
    :attr:`ISWeights.weight`, detached); ``keep`` (bool, default: every valid token) rejects tokens
    on top of it (a :func:`~refppo.core.rollout_correction.rejection_mask`)."""
    lp, lo, adv, m, w, kept, rj, eps_lo, eps_hi, agg, k = _checked(
        logp, logp_old, advantages, mask, weight, keep, rejected, clip, norms
    )
    over = kept if rj is Rejected.DROP else m
    t = policy_terms(
        lp, lo, adv, over, eps_lo=eps_lo, eps_hi=eps_hi, dual_clip=clip.dual_clip, log_ratio_clamp=k
    )
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    per_token = torch.where(kept, w * t.per_token, zero)
    if rj is Rejected.DROP:
        loss = _aggregate_kept(per_token, kept, norms)
    else:
        loss = aggregate_masked(
            per_token, m, agg, token_count=norms.token_count, seq_count=norms.seq_count, horizon=norms.horizon
        )
    if not bool(over.any()):
        return PolicyLossOutput(loss, per_token, t.ratio, zero, zero, zero, zero)
    s = token_statistics(t, over)
    return PolicyLossOutput(
        loss, per_token, s.ratio, s.clipfrac, s.clipfrac_lower, s.approx_kl, s.approx_kl_k2
    )


def _kept_mean_naive(per_token: list[list[float]], kept: list[list[bool]], norms: Norms) -> float:
    """``agg`` over the kept tokens only (``Rejected.drop``), sum by sum."""
    agg = parse(LossAgg, norms.agg, what="loss_agg")
    sums = [sum(v for v, ok in zip(r, kr, strict=True) if ok) for r, kr in zip(per_token, kept, strict=True)]
    lens = [sum(kr) for kr in kept]
    if sum(lens) == 0 or agg is LossAgg.TOKEN_SUM:
        return sum(sums)
    if agg is LossAgg.TOKEN_MEAN:
        return sum(sums) / (norms.token_count or sum(lens))
    n_seq = norms.seq_count or sum(1 for n in lens if n > 0)
    if agg is LossAgg.SEQ_MEAN_TOKEN_MEAN:
        return sum(s / n for s, n in zip(sums, lens, strict=True) if n > 0) / n_seq
    if agg is LossAgg.SEQ_MEAN_TOKEN_SUM:
        return sum(sums) / n_seq
    return sum(s / (norms.horizon or len(per_token[0])) for s in sums) / n_seq


def corrected_policy_loss_naive(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    weight: Tensor,
    *,
    keep: Tensor | None = None,
    rejected: Rejected | str = Rejected.ZERO,
    clip: PolicyClip = DEFAULT_CLIP,
    norms: Norms = DEFAULT_NORMS,
) -> PolicyLossNaive:
    """Naive twin of :func:`corrected_policy_loss`: ``w'·ℓ^PPO`` token by token, then the sums."""
    *_, kept_mask, rj, _, eps_hi, _, _ = _checked(
        logp, logp_old, advantages, mask, weight, keep, rejected, clip, norms
    )
    lp, lo, advs, ws = pf.rows(logp), pf.rows(logp_old), pf.rows(advantages), pf.rows(weight)
    kept = pf.mask_rows(kept_mask)
    over = kept if rj is Rejected.DROP else pf.mask_rows(mask)
    per_token, ratios, n, n_clip, n_low, kl, kl2 = [], [], 0, 0, 0, 0.0, 0.0
    for b, orow in enumerate(over):
        prow, rrow = [], []
        for t, ok in enumerate(orow):
            loss = r = 0.0
            if ok:
                d = lp[b][t] - lo[b][t]
                loss, r, clipped, lower = _policy_token_naive(
                    d, advs[b][t], clip.clip_low, eps_hi, clip.dual_clip, clip.log_ratio_clamp
                )
                n, n_clip, n_low, kl, kl2 = n + 1, n_clip + clipped, n_low + lower, kl - d, kl2 + d * d / 2
            prow.append(ws[b][t] * loss if kept[b][t] else 0.0)
            rrow.append(r)
        per_token.append(prow)
        ratios.append(rrow)
    if rj is Rejected.DROP:
        total = _kept_mean_naive(per_token, kept, norms)
    else:
        pt = torch.tensor(per_token, dtype=torch.float64, device=mask.device)
        total = aggregate_loss_naive(
            pt,
            mask,
            norms.agg,
            token_count=norms.token_count,
            seq_count=norms.seq_count,
            horizon=norms.horizon,
        ).item()
    div = max(n, 1)
    return PolicyLossNaive(total, per_token, ratios, n_clip / div, n_low / div, kl / div, kl2 / div)


@dataclass(frozen=True)
class BehaviourWeight:
    """The behaviour weight ``π^prox/π^beh`` of the decoupled objective (AReaL ``rejection_sampling``):
    level, aggregation (AReaL: geometric), mode (``mask``: AReaL ``action: mask``; ``truncate``:
    ``action: clamp``), ``[C_low, C_high]`` (AReaL ``lower``, ``upper``; its old default: a mask at 5)
    and the log clamp κ of the weight (AReaL: none). ``high = low = None``: the raw weight."""

    level: ISLevel | str = ISLevel.TOKEN
    agg: ISAgg | str = ISAgg.GEOMETRIC
    mode: ISMode | str = ISMode.MASK
    low: float | None = None
    high: float | None = 5.0
    log_clamp: float | None = None


DEFAULT_BEHAVIOUR = BehaviourWeight()


@dataclass(frozen=True)
class DecoupledLoss:
    """What :func:`decoupled_policy_loss` returns: the loss (as :func:`corrected_policy_loss`'s) and the
    behaviour weights it applied."""

    policy: PolicyLossOutput
    weights: ISWeights


def decoupled_policy_loss(
    logp: TokenFloat,
    logp_prox: TokenFloat,
    logp_beh: TokenFloat,
    advantages: TokenFloat,
    mask: ResponseMask,
    *,
    behaviour: BehaviourWeight = DEFAULT_BEHAVIOUR,
    clip: PolicyClip = DEFAULT_CLIP,
    norms: Norms = DEFAULT_NORMS,
) -> DecoupledLoss:
    """Decoupled PPO (module docstring): ``ℓ_t = w'_t·max(−A_t·π_θ/π^prox, −A_t·clip(π_θ/π^prox))``."""
    bw = behaviour
    w = is_weights(
        logp_prox, logp_beh, mask, level=bw.level, agg=bw.agg, mode=bw.mode, low=bw.low, high=bw.high,
        log_ratio_clamp=bw.log_clamp,
    )  # fmt: skip
    out = corrected_policy_loss(
        logp,
        logp_prox,
        advantages,
        mask,
        w.weight,
        keep=w.keep,
        rejected=Rejected.ZERO,
        clip=clip,
        norms=norms,
    )
    return DecoupledLoss(out, w)


def decoupled_policy_loss_naive(
    logp: Tensor,
    logp_prox: Tensor,
    logp_beh: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    behaviour: BehaviourWeight = DEFAULT_BEHAVIOUR,
    clip: PolicyClip = DEFAULT_CLIP,
    norms: Norms = DEFAULT_NORMS,
) -> tuple[PolicyLossNaive, list[list[float]]]:
    """Naive twin of :func:`decoupled_policy_loss`: the behaviour weight of each token (its naive
    twin), then ``w'·ℓ^PPO(π_θ/π^prox)`` token by token; ``(loss, weights)``."""
    bw = behaviour
    weights, _, keeps = is_weights_naive(
        logp_prox, logp_beh, mask, level=bw.level, agg=bw.agg, mode=bw.mode, low=bw.low, high=bw.high,
        log_ratio_clamp=bw.log_clamp,
    )  # fmt: skip
    w = torch.tensor(weights, dtype=logp.dtype, device=logp.device)
    keep = torch.tensor(keeps, dtype=torch.bool, device=mask.device)
    out = corrected_policy_loss_naive(logp, logp_prox, advantages, mask, w, keep=keep, clip=clip, norms=norms)
    return out, weights


__all__ = [
    "DEFAULT_BEHAVIOUR",
    "DEFAULT_CLIP",
    "DEFAULT_NORMS",
    "BehaviourWeight",
    "DecoupledLoss",
    "Norms",
    "PolicyClip",
    "corrected_policy_loss",
    "corrected_policy_loss_naive",
    "decoupled_policy_loss",
    "decoupled_policy_loss_naive",
]
