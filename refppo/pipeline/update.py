"""The update stages' functions (steps 5–9 of :mod:`refppo.pipeline`, per PPO epoch / minibatch, with
the current policy and critic), each ``fn(q, conv, hp, ev) -> {quantity: tensor}`` of
:class:`refppo.pipeline.stages.Stage`::

    rollout_correction_stage (pipeline.correction) old_logprobs, rollout_logprobs -> is_weights, is_keep
    policy_stage       logprobs, old_logprobs, advantages, is_weights -> pg_per_token, ratio, pg_clipfrac,
                                                             pg_clipfrac_lower, pg_approx_kl
    policy_agg_stage   pg_per_token                      -> pg_loss          aggregate_masked
    approx_kl_stage    pg_approx_kl, logprobs, …         -> approx_kl        (conv.policy.approx_kl)
    value_stage        values, old_values, returns, …    -> vf_per_token, vf_clipfrac, vf_loss_mask
    value_agg_stage    vf_per_token, vf_loss_mask        -> vf_loss          aggregate_masked
    entropy_stage      entropy                           -> entropy_loss     entropy_bonus
    kl_loss_stage      logprobs, ref_logprobs            -> kl_loss          kl_loss
    kl_metric_stage    kl_loss, logprobs, ref_logprobs   -> kl_metric        kl_loss (the logged KL)
    total_stage        pg_loss, vf_loss, entropy_loss, kl_loss -> loss       total_loss
    grads_stage        loss, logprobs, values            -> grad_logprobs, grad_values  (autograd)

Every per-token term is made once and each aggregation reads it (the per-token stages and their
aggregations are separate stages), so a caller can aggregate one per-token loss under every mode.
``ev.rows`` set (no autograd graph): the per-token stages run by row blocks
(:mod:`refppo.core.by_rows`: the same values bit for bit, without the whole-batch temporaries).
``ev.norm``: the step's global normalisers (``value_token_count`` for the value term).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from refppo.agg_conventions import ClipfracAgg, ClipFracCounts
from refppo.conventions import AdvantageEstimator, ApproxKL, LossAgg, PolicyLoss, VfMask
from refppo.core.aggregate import aggregate_masked, prompt_mean_masked
from refppo.core.approx_kl import approx_kl_k1_clamped
from refppo.core.by_rows import (
    entropy_bonus_by_rows,
    kl_loss_by_rows,
    policy_token_loss_by_rows,
    value_token_loss_by_rows,
)
from refppo.core.checks import check_mask
from refppo.core.cispo import cispo_policy_loss
from refppo.core.clipfrac import clip_fraction, clipfrac_row_mean
from refppo.core.gspo import gspo_policy_token_loss, gspo_ratio
from refppo.core.objective import entropy_bonus, kl_loss, total_loss
from refppo.core.policy import (
    PolicyLossOutput,
    PolicyTokenLoss,
    approx_kl_k2_all_positions,
    clipped_policy_token_loss,
    policy_ratio,
)
from refppo.core.value import value_token_loss
from refppo.errors import ConventionError
from refppo.pipeline.blocks import Evaluation, Normalisers
from refppo.pipeline.needs import kl_loss_needs, refuse_prompt_mean, require_input
from refppo.pipeline.settings import Convention, Hyperparams

Q = Mapping[str, Any]
"""The quantities a stage reads (name → tensor, or None where absent)."""


def policy_token_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    hp: Hyperparams,
    conv: Convention,
    rows: int | None = None,
    keep_ratio: bool = True,
) -> PolicyTokenLoss:
    """Steps 5–6 per token: the clipped surrogate of ``conv.policy`` (the token ratio, or GSPO's
    sequence ratio), not aggregated. ``rows``: by blocks of that many rows (no autograd graph);
    ``keep_ratio`` False: by blocks, no ratio buffer (``ratio`` empty)."""
    pol = conv.policy
    gspo = pol.loss is PolicyLoss.GSPO
    if pol.loss is PolicyLoss.CISPO:
        return cispo_token_loss(logprobs, old_logprobs, advantages, mask, hp=hp, conv=conv, grad=rows is None)
    if rows is not None:
        return policy_token_loss_by_rows(
            rows, logprobs, old_logprobs, advantages, mask, gspo=gspo, clip_low=hp.cliprange,
            clip_high=hp.cliprange_high, dual_clip=None if gspo else pol.dual_clip,
            log_ratio_clamp=pol.log_ratio_clamp, keep_ratio=keep_ratio,
        )  # fmt: skip
    if gspo:
        return gspo_policy_token_loss(
            logprobs, old_logprobs, advantages, mask, clip_low=hp.cliprange, clip_high=hp.cliprange_high,
            log_ratio_max=pol.log_ratio_clamp,
        )  # fmt: skip
    return clipped_policy_token_loss(
        logprobs, old_logprobs, advantages, mask, clip_low=hp.cliprange, clip_high=hp.cliprange_high,
        dual_clip=pol.dual_clip, log_ratio_clamp=pol.log_ratio_clamp,
    )  # fmt: skip


def cispo_token_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, hp: Hyperparams,
    conv: Convention, grad: bool = True,
) -> PolicyTokenLoss:  # fmt: skip
    """``policy_loss=cispo`` per token (:func:`refppo.core.cispo.cispo_policy_loss`: ``[1 − ε_low,
    1 + ε_high]`` from ``cliprange``/``cliprange_high``, ``cliprange = 1``: no lower bound (TRL 1.16.0),
    κ ``log_ratio_clamp``); ``grad`` False: under
    ``no_grad`` (the by-rows evaluation has no autograd graph; CISPO has no by-rows kernel)."""
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        out = cispo_policy_loss(
            logprobs, old_logprobs, advantages, mask, clip_low=hp.cliprange,
            clip_high=hp.clip_high,
            log_ratio_clamp=conv.policy.log_ratio_clamp,
        )  # fmt: skip
    return PolicyTokenLoss(
        out.per_token, out.ratio, out.clipfrac, out.clipfrac_lower, out.approx_kl, out.approx_kl_k2
    )


def policy_term(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    hp: Hyperparams,
    conv: Convention,
    norm: Normalisers | None = None,
    rows: int | None = None,
) -> PolicyLossOutput:
    """Steps 5–6 of one policy term: the policy stage (:func:`policy_token_loss`) and its
    aggregation (:func:`aggregate` by ``loss_agg``), the same calls as a walk of the two stages; the
    oracle's gradient diagnosis reads its per-token loss ``ℓ`` [B, T] (``∂pg/∂A``)."""
    t = policy_token_loss(logprobs, old_logprobs, advantages, mask, hp=hp, conv=conv, rows=rows)
    ev = Evaluation(rows=rows, norm=norm or Normalisers())
    return t.with_loss(aggregate(t.per_token, check_mask("mask", mask), conv.agg.loss, hp, ev))


def clip_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, conv: Convention) -> Tensor:
    """The ratio the policy stage clips, detached ``[B, T]``: the token ratio after the log-ratio
    clamp (:func:`refppo.core.policy.policy_ratio`), or GSPO's sequence ratio on every token of its
    row (:func:`refppo.core.gspo.gspo_ratio`); ``cispo`` clips the token ratio."""
    pol = conv.policy
    if pol.loss is PolicyLoss.GSPO:
        return gspo_ratio(logprobs, old_logprobs, mask, log_ratio_max=pol.log_ratio_clamp)
    return policy_ratio(logprobs, old_logprobs, mask, log_ratio_clamp=pol.log_ratio_clamp).detach()


def weighted(per_token: Tensor, weight: Tensor | None) -> Tensor:
    """``w'·ℓ`` per token (``ℓ`` unchanged when ``weight`` is None): the correction multiplies the
    surrogate after the clip and the dual clip; ``w'`` is 0 on padding and on masked-out tokens."""
    return per_token if weight is None else weight.to(per_token.dtype) * per_token


def policy_stage(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """Steps 5–6 per token (:func:`policy_token_loss`): ``ℓ`` (times the rollout-correction weight
    ``w'`` when ``q["is_weights"]`` is given), ``ρ``, the clip fractions and the masked
    ``mean(l^old − l)`` (unweighted)."""
    t = policy_token_loss(
        q["logprobs"], q["old_logprobs"], q["advantages"], q["mask"], hp=hp, conv=conv, rows=ev.rows,
        keep_ratio=ev.keep_ratio,
    )  # fmt: skip
    clipfrac = t.clipfrac
    if conv.policy.clipfrac_agg is ClipfracAgg.ROW_MEAN:  # vanilla only (the Convention refuses the others)
        clipfrac = clipfrac_row_mean(
            q["logprobs"], q["old_logprobs"], q["advantages"], q["mask"], clip_low=hp.cliprange,
            clip_high=hp.cliprange_high, log_ratio_clamp=conv.policy.log_ratio_clamp,
        )  # fmt: skip
    return {
        "pg_per_token": weighted(t.per_token, q.get("is_weights")),
        "ratio": t.ratio,
        "pg_clipfrac": counted_clipfrac(q, conv, hp, clipfrac),
        "pg_clipfrac_lower": t.clipfrac_lower,
        "pg_approx_kl": t.approx_kl,
    }


def recounts(conv: Convention, weight: Tensor | None) -> bool:
    """Whether ``clipfrac_counts`` changes the core's ``clipfrac``: ``kept`` under a correction,
    ``by_advantage`` with CISPO (the surrogate's ``L2 > L1`` already counts one side only)."""
    c, loss = conv.policy.clipfrac_counts, conv.policy.loss
    return (c is ClipFracCounts.KEPT and weight is not None) or (
        c is ClipFracCounts.BY_ADVANTAGE and loss is PolicyLoss.CISPO
    )


def clip_band(conv: Convention, hp: Hyperparams) -> tuple[float | None, float]:
    """``(1 − ε_low, 1 + ε_high)`` the policy term clips ``ρ`` to (``ε_high`` None: ``ε_low``); CISPO:
    no lower bound for ``ε_low ≥ 1`` (:func:`refppo.core.cispo.cispo_policy_loss`)."""
    lo, hi = hp.cliprange, hp.clip_high
    if conv.policy.loss is PolicyLoss.CISPO and lo >= 1.0:
        return None, 1.0 + hi
    return 1.0 - lo, 1.0 + hi


def counted_clipfrac(q: Q, conv: Convention, hp: Hyperparams, core: Tensor) -> Tensor:
    """``pg_clipfrac`` under ``conv.policy.clipfrac_counts``: the core's ``core`` where the
    convention changes nothing (:func:`recounts`), else :func:`refppo.core.clipfrac.clip_fraction`."""
    w = q.get("is_weights")
    if not recounts(conv, w):
        return core
    ratio = clip_ratio(q["logprobs"], q["old_logprobs"], q["mask"], conv)
    return clip_fraction(
        ratio, q["advantages"], q["mask"], band=clip_band(conv, hp),
        surrogate=conv.policy.loss is not PolicyLoss.CISPO, counts=conv.policy.clipfrac_counts, weight=w,
    )  # fmt: skip


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    agg: LossAgg,
    hp: Hyperparams,
    ev: Evaluation,
    *,
    value: bool = False,
    groups: Tensor | None = None,
    key: str = "loss_agg",
) -> Tensor:
    """``agg(ℓ)`` over ``mask`` with the step's normalisers (``value``: the value term's token count)
    and ``hp.horizon`` (:func:`refppo.core.aggregate.aggregate_masked`; ``ℓ`` is 0 on padding);
    ``groups``: ``group_index``, read by ``prompt-mean``."""
    norm = ev.norm.kwargs(hp.horizon, value=value)
    prompts = ev.norm.prompts(agg, groups, key)
    with torch.no_grad() if ev.rows is not None else contextlib.nullcontext():
        if prompts is not None:
            return prompt_mean_masked(per_token, mask, prompts)
        return aggregate_masked(per_token, mask, agg, **norm)


def policy_agg_stage(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """``pg_loss = loss_agg(ℓ)``."""
    groups = q.get("group_index")
    return {"pg_loss": aggregate(q["pg_per_token"], q["mask"], conv.agg.loss, hp, ev, groups=groups)}


def approx_kl_stage(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """The logged ``approx_kl`` of ``conv.policy.approx_kl``: ``k1`` the policy stage's masked
    ``mean(l^old − l)``, ``neg_k1`` its negative, ``k2_all_positions`` TRL's
    (:func:`refppo.core.policy.approx_kl_k2_all_positions`), ``k1_clamped`` RLinf's
    (:func:`refppo.core.approx_kl.approx_kl_k1_clamped`, ``κ = log_ratio_clamp``)."""
    metric = conv.policy.approx_kl
    if metric is ApproxKL.K2_ALL_POSITIONS:
        return {"approx_kl": approx_kl_k2_all_positions(q["logprobs"], q["old_logprobs"], q["mask"])}
    if metric is ApproxKL.K1_CLAMPED:
        kappa = conv.policy.log_ratio_clamp
        return {"approx_kl": approx_kl_k1_clamped(q["logprobs"], q["old_logprobs"], q["mask"], kappa)}
    k1: Tensor = q["pg_approx_kl"]
    return {"approx_kl": -k1 if metric is ApproxKL.NEG_K1 else k1}


def value_stage(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor | None]:
    """Step 7 per token: the value loss of ``conv.value`` over the value mask (``vf_mask=value``) or
    the response mask (``response``); no values (critic-free): no value loss (``vf_per_token``
    None, ``vf_clipfrac`` 0; ``advantage=gae`` without values is refused)."""
    values, old_values = q.get("values"), q.get("old_values")
    vm: Tensor = q["mask"] if conv.value.mask is VfMask.RESPONSE else q["value_mask"]
    if values is None or old_values is None:
        if conv.adv.estimator is AdvantageEstimator.GAE:
            raise ConventionError("advantage=gae needs values and old_values for the value loss")
        zero = torch.zeros((), dtype=q["logprobs"].dtype, device=q["logprobs"].device)
        return {"vf_per_token": None, "vf_clipfrac": zero, "vf_loss_mask": vm}
    kw: dict[str, Any] = {
        "clip": hp.cliprange_value,
        "kind": conv.value.loss,
        "clip_form": conv.value.clip_form,
    }
    if ev.rows is None:
        t = value_token_loss(values, old_values, q["returns"], vm, **kw)
    else:
        t = value_token_loss_by_rows(ev.rows, values, old_values, q["returns"], vm, **kw)
    return {"vf_per_token": t.per_token, "vf_clipfrac": t.clipfrac, "vf_loss_mask": vm}


def value_agg_stage(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """``vf_loss = value_loss_agg(ℓ^v)`` (default ``loss_agg``); 0 without a value loss."""
    per_token = q["vf_per_token"]
    if per_token is None:
        return {"vf_loss": torch.zeros((), dtype=q["logprobs"].dtype, device=q["logprobs"].device)}
    refuse_prompt_mean(conv, "value", "value_loss_agg")
    return {"vf_loss": aggregate(per_token, q["vf_loss_mask"], conv.agg.of("value"), hp, ev, value=True)}


def entropy_stage(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """Step 8a: ``entropy_agg(H)`` (default ``loss_agg``) of the given entropy; 0 without one."""
    entropy, m = q.get("entropy"), q["mask"]
    if entropy is None:
        return {"entropy_loss": torch.zeros((), dtype=q["logprobs"].dtype, device=q["logprobs"].device)}
    norm = ev.norm.kwargs(hp.horizon)
    agg = conv.agg.of("entropy")
    if agg is LossAgg.PROMPT_MEAN:
        groups = q.get("group_index")
        zero = torch.zeros((), dtype=entropy.dtype, device=entropy.device)
        lm = torch.where(check_mask("mask", m), entropy, zero)
        return {"entropy_loss": aggregate(lm, m, agg, hp, ev, groups=groups, key="entropy_agg")}
    if ev.rows is None:
        return {"entropy_loss": entropy_bonus(entropy, m, agg, **norm)}
    return {"entropy_loss": entropy_bonus_by_rows(ev.rows, entropy, m, agg, **norm)}


def kl_loss_stage(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor | None]:
    """Step 8b: with ``kl_in=loss``, ``kl_loss_agg(KL(π_θ‖π_ref))`` (default ``loss_agg``) on the
    current log-probs (its gradient importance-weighted on ``old_logprobs`` under ``kl_grad_is_clip``);
    else 0. Without ``ref_logprobs`` at β = 0: None (not read by the total;
    :func:`refppo.pipeline.needs.kl_loss_needs`)."""
    if not conv.kl.placement.in_loss:
        return {"kl_loss": torch.zeros((), dtype=q["logprobs"].dtype, device=q["logprobs"].device)}
    refuse_prompt_mean(conv, "kl", "kl_loss_agg")
    ref = q.get("ref_logprobs")
    if ref is None:
        require_input(q, "ref_logprobs", "kl_loss", kl_loss_needs(conv, hp))
        return {"kl_loss": None}
    (est, lrc, vc), norm = conv.kl.loss_kl(), ev.norm.kwargs(hp.horizon)
    args = (q["logprobs"], ref, q["mask"], est, conv.agg.of("kl"))
    kw: dict[str, Any] = {"log_ratio_clamp": lrc, "value_clamp": vc, **norm}
    if ev.rows is None:  # kl_grad_is_clip weights the gradient only (the by-rows path has none)
        clip = conv.kl.grad_is_clip
        return {"kl_loss": kl_loss(*args, logp_old=q.get("old_logprobs"), grad_is_clip=clip, **kw)}
    return {"kl_loss": kl_loss_by_rows(ev.rows, *args, **kw)}


def kl_metric_stage(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor | None]:
    """Step 8c: the logged KL metric (the dumped ``kl_loss``): ``kl_metric_agg(KL(π_θ‖π_ref))``,
    detached, when a trainer logs it unlike the loss's term (TRL GRPOTrainer 1.16.0: ``token-mean``);
    else the term itself (``kl_loss``, the same tensor)."""
    term = q["kl_loss"]
    agg = conv.agg.of("kl_metric")
    if not conv.kl.placement.in_loss or term is None or agg is conv.agg.of("kl"):
        return {"kl_metric": term}
    refuse_prompt_mean(conv, "kl_metric", "kl_metric_agg")
    (est, lrc, vc), norm = conv.kl.loss_kl(), ev.norm.kwargs(hp.horizon)
    args = (q["logprobs"], q["ref_logprobs"], q["mask"], est, agg)
    kw: dict[str, Any] = {"log_ratio_clamp": lrc, "value_clamp": vc, **norm}
    with torch.no_grad():
        out = kl_loss(*args, **kw) if ev.rows is None else kl_loss_by_rows(ev.rows, *args, **kw)
    return {"kl_metric": out}


def total_stage(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """Step 9: ``loss = pg + vf_coef·vf − ent_coef·entropy + kl_coef·kl`` (``kl_coef`` 0 unless
    ``kl_in=loss``)."""
    loss = total_loss(
        q["pg_loss"], q["vf_loss"], q["entropy_loss"], q["kl_loss"], vf_coef=hp.vf_coef, ent_coef=hp.ent_coef,
        kl_coef=hp.loss_beta if conv.kl.placement.in_loss else 0.0,
    )  # fmt: skip
    return {"loss": loss}


def grads_stage(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """The gradient of the update: ``∂loss/∂logprobs`` and ``∂loss/∂values`` ``[B, T]`` by autograd
    (``logprobs`` and ``values`` must require a gradient, the update stages walked under autograd),
    0 outside the policy mask and the value loss's mask (a trainer's nonzero gradient there is a
    padding leak)."""
    lp, v = q["logprobs"], q["values"]
    g_lp, g_v = torch.autograd.grad(q["loss"], (lp, v), allow_unused=True)
    zero = torch.zeros((), dtype=lp.dtype)
    out: dict[str, Tensor] = {}
    for name, g, m in (("grad_logprobs", g_lp, q["mask"]), ("grad_values", g_v, q["vf_loss_mask"])):
        out[name] = zero.expand_as(m).clone() if g is None else torch.where(m, g, zero)
    return out


__all__ = [
    "aggregate",
    "approx_kl_stage",
    "entropy_stage",
    "grads_stage",
    "kl_loss_stage",
    "kl_metric_stage",
    "policy_agg_stage",
    "policy_stage",
    "policy_term",
    "policy_token_loss",
    "total_stage",
    "value_agg_stage",
    "value_stage",
]
