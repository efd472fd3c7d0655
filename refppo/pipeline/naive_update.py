"""Naive twins of the update stages (steps 5–9, :mod:`refppo.pipeline.update`): each the same
``fn(q, conv, hp, ev)`` on the core's naive twins (Python floats, float64 tensors out). ``ev.rows``
is not read (the naive twins loop over every token anyway); ``ev.norm`` is read here by
:func:`normaliser_kwargs`, the twins' own reading of the normalisers (not
:meth:`refppo.pipeline.blocks.Normalisers.kwargs`, so a slip there is not copied here).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from refppo.agg_conventions import ClipfracAgg, ClipFracCounts
from refppo.conventions import AdvantageEstimator, ApproxKL, LossAgg, PolicyLoss, VfMask
from refppo.core.aggregate import aggregate_loss_naive, prompt_mean_naive
from refppo.core.approx_kl import approx_kl_k1_clamped_naive
from refppo.core.cispo import cispo_policy_loss_naive
from refppo.core.clipfrac import clip_fraction_naive, clipfrac_row_mean_naive
from refppo.core.gspo import gspo_policy_loss_naive
from refppo.core.objective import entropy_bonus_naive, kl_loss_naive, total_loss_naive
from refppo.core.policy import approx_kl_k2_all_positions_naive, clipped_policy_loss_naive
from refppo.core.value import value_loss_naive
from refppo.errors import ConventionError
from refppo.pipeline.blocks import Evaluation, Normalisers
from refppo.pipeline.needs import kl_loss_needs, refuse_prompt_mean, require_input
from refppo.pipeline.settings import Convention, Hyperparams

Q = Mapping[str, Any]


def normaliser_kwargs(norm: Normalisers | None, horizon: float | None, *, value: bool) -> dict[str, float]:
    """``token_count`` (the value term: ``value_token_count`` when given), ``seq_count`` and
    ``horizon``, each only when set."""
    out: dict[str, float] = {}
    if norm is not None:
        tokens = norm.value_token_count if value and norm.value_token_count is not None else norm.token_count
        if tokens is not None:
            out["token_count"] = tokens
        if norm.seq_count is not None:
            out["seq_count"] = norm.seq_count
    if horizon is not None:
        out["horizon"] = horizon
    return out


def _f64(x: Any, device: torch.device) -> Tensor:
    return torch.tensor(x, dtype=torch.float64, device=device)


def policy_naive(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """Steps 5–6 per token, case by case on each token (:func:`refppo.core.policy.clipped_policy_loss_naive`,
    :func:`refppo.core.gspo.gspo_policy_loss_naive`, :func:`refppo.core.cispo.cispo_policy_loss_naive`)."""
    pol, args = conv.policy, (q["logprobs"], q["old_logprobs"], q["advantages"], q["mask"])
    if pol.loss is PolicyLoss.CISPO:
        out = cispo_policy_loss_naive(
            *args, clip_low=hp.cliprange, clip_high=hp.clip_high, log_ratio_clamp=pol.log_ratio_clamp
        )
    elif pol.loss is PolicyLoss.GSPO:
        out = gspo_policy_loss_naive(
            *args, clip_low=hp.cliprange, clip_high=hp.cliprange_high, log_ratio_max=pol.log_ratio_clamp
        )
    else:
        out = clipped_policy_loss_naive(
            *args, clip_low=hp.cliprange, clip_high=hp.cliprange_high, dual_clip=pol.dual_clip,
            log_ratio_clamp=pol.log_ratio_clamp,
        )  # fmt: skip
    dev = q["mask"].device
    w = q.get("is_weights")
    per_token = out.per_token
    if w is not None:  # ℓ_t ← w'_t·ℓ_t, token by token
        ws = w.tolist()
        per_token = [[a * b for a, b in zip(r, wr, strict=True)] for r, wr in zip(per_token, ws, strict=True)]
    clipfrac = out.clipfrac
    if pol.clipfrac_agg is ClipfracAgg.ROW_MEAN:  # vanilla only (the Convention refuses the others)
        clipfrac = clipfrac_row_mean_naive(
            *args, clip_low=hp.cliprange, clip_high=hp.cliprange_high, log_ratio_clamp=pol.log_ratio_clamp
        )
    if pol.clipfrac_counts is not ClipFracCounts.ALL:  # token by token on the twin's own ratios
        eps_hi = hp.clip_high
        cispo = pol.loss is PolicyLoss.CISPO
        lo = None if cispo and hp.cliprange >= 1.0 else 1.0 - hp.cliprange
        clipfrac = clip_fraction_naive(
            _f64(out.ratio, dev), q["advantages"], q["mask"], band=(lo, 1.0 + eps_hi), surrogate=not cispo,
            counts=pol.clipfrac_counts, weight=w,
        )  # fmt: skip
    return {
        "pg_per_token": _f64(per_token, dev),
        "ratio": _f64(out.ratio, dev),
        "pg_clipfrac": _f64(clipfrac, dev),
        "pg_clipfrac_lower": _f64(out.clipfrac_lower, dev),
        "pg_approx_kl": _f64(out.approx_kl, dev),
    }


def _agg(
    per_token: Tensor, mask: Tensor, agg: LossAgg, hp: Hyperparams, ev: Evaluation, value: bool,
    groups: Tensor | None = None, key: str = "loss_agg",
) -> Tensor:  # fmt: skip
    prompts = ev.norm.prompts(agg, groups, key)
    if prompts is not None:
        return prompt_mean_naive(per_token, mask, prompts)
    return aggregate_loss_naive(per_token, mask, agg, **normaliser_kwargs(ev.norm, hp.horizon, value=value))


def policy_agg_naive(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """``loss_agg(ℓ)`` by :func:`refppo.core.aggregate.aggregate_loss_naive`."""
    return {"pg_loss": _agg(q["pg_per_token"], q["mask"], conv.agg.loss, hp, ev, False, q.get("group_index"))}


def approx_kl_naive(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """The ``approx_kl`` metric of ``conv.policy.approx_kl`` token by token."""
    metric, k1 = conv.policy.approx_kl, q["pg_approx_kl"]
    if metric is ApproxKL.K2_ALL_POSITIONS:
        value = approx_kl_k2_all_positions_naive(q["logprobs"], q["old_logprobs"], q["mask"])
        return {"approx_kl": _f64(value, q["mask"].device)}
    if metric is ApproxKL.K1_CLAMPED:
        kappa = conv.policy.log_ratio_clamp
        value = approx_kl_k1_clamped_naive(q["logprobs"], q["old_logprobs"], q["mask"], kappa)
        return {"approx_kl": _f64(value, q["mask"].device)}
    return {"approx_kl": -k1 if metric is ApproxKL.NEG_K1 else k1}


def value_naive(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor | None]:
    """Step 7 per token (:func:`refppo.core.value.value_loss_naive`) over the value or response mask."""
    values, old_values = q.get("values"), q.get("old_values")
    vm = q["mask"] if conv.value.mask is VfMask.RESPONSE else q["value_mask"]
    dev = q["mask"].device
    if values is None or old_values is None:
        if conv.adv.estimator is AdvantageEstimator.GAE:
            raise ConventionError("advantage=gae needs values and old_values for the value loss")
        return {"vf_per_token": None, "vf_clipfrac": _f64(0.0, dev), "vf_loss_mask": vm}
    out = value_loss_naive(
        values, old_values, q["returns"], vm, clip=hp.cliprange_value, kind=conv.value.loss,
        clip_form=conv.value.clip_form,
    )  # fmt: skip
    return {
        "vf_per_token": _f64(out.per_token, dev),
        "vf_clipfrac": _f64(out.clipfrac, dev),
        "vf_loss_mask": vm,
    }


def value_agg_naive(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """``value_loss_agg(ℓ^v)`` (default ``loss_agg``); 0 without a value loss."""
    if q["vf_per_token"] is None:
        return {"vf_loss": _f64(0.0, q["mask"].device)}
    refuse_prompt_mean(conv, "value", "value_loss_agg")
    return {"vf_loss": _agg(q["vf_per_token"], q["vf_loss_mask"], conv.agg.of("value"), hp, ev, True)}


def entropy_naive(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """:func:`refppo.core.objective.entropy_bonus_naive`; 0 without an entropy."""
    if q.get("entropy") is None:
        return {"entropy_loss": _f64(0.0, q["mask"].device)}
    agg = conv.agg.of("entropy")
    if agg is LossAgg.PROMPT_MEAN:
        groups = q.get("group_index")
        return {"entropy_loss": _agg(q["entropy"], q["mask"], agg, hp, ev, False, groups, "entropy_agg")}
    norm = normaliser_kwargs(ev.norm, hp.horizon, value=False)
    return {"entropy_loss": entropy_bonus_naive(q["entropy"], q["mask"], agg, **norm)}


def kl_loss_naive_stage(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor | None]:
    """:func:`refppo.core.objective.kl_loss_naive` with ``kl_in=loss``; else 0."""
    if not conv.kl.placement.in_loss:
        return {"kl_loss": _f64(0.0, q["mask"].device)}
    if q.get("ref_logprobs") is None:
        require_input(q, "ref_logprobs", "kl_loss", kl_loss_needs(conv, hp))
        return {"kl_loss": None}
    refuse_prompt_mean(conv, "kl", "kl_loss_agg")
    (est, lrc, vc), norm = conv.kl.loss_kl(), normaliser_kwargs(ev.norm, hp.horizon, value=False)
    out = kl_loss_naive(
        q["logprobs"], q["ref_logprobs"], q["mask"], est, conv.agg.of("kl"),
        log_ratio_clamp=lrc, value_clamp=vc, logp_old=q.get("old_logprobs"),
        grad_is_clip=conv.kl.grad_is_clip, **norm,
    )  # fmt: skip
    return {"kl_loss": out}


def kl_metric_naive_stage(
    q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation
) -> dict[str, Tensor | None]:
    """The logged KL metric: :func:`refppo.core.objective.kl_loss_naive` under ``kl_metric_agg``
    when it differs from the term's aggregation; else the term."""
    agg = conv.agg.of("kl_metric")
    if not conv.kl.placement.in_loss or q["kl_loss"] is None or agg is conv.agg.of("kl"):
        return {"kl_metric": q["kl_loss"]}
    refuse_prompt_mean(conv, "kl_metric", "kl_metric_agg")
    (est, lrc, vc), norm = conv.kl.loss_kl(), normaliser_kwargs(ev.norm, hp.horizon, value=False)
    out = kl_loss_naive(
        q["logprobs"], q["ref_logprobs"], q["mask"], est, agg,
        log_ratio_clamp=lrc, value_clamp=vc, logp_old=None, **norm,
    )  # fmt: skip
    return {"kl_metric": out}


def total_naive(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """:func:`refppo.core.objective.total_loss_naive` on the terms as Python floats."""
    total = total_loss_naive(
        float(q["pg_loss"]), float(q["vf_loss"]), float(q["entropy_loss"]),
        None if q["kl_loss"] is None else float(q["kl_loss"]),
        vf_coef=hp.vf_coef, ent_coef=hp.ent_coef,
        kl_coef=hp.loss_beta if conv.kl.placement.in_loss else 0.0,
    )  # fmt: skip
    return {"loss": _f64(total, q["mask"].device)}


__all__ = [
    "approx_kl_naive",
    "entropy_naive",
    "kl_loss_naive_stage",
    "kl_metric_naive_stage",
    "normaliser_kwargs",
    "policy_agg_naive",
    "policy_naive",
    "total_naive",
    "value_agg_naive",
    "value_naive",
]
