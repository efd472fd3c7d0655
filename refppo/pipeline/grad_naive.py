"""Naive twin of the gradient of one update step: ``(∂J/∂logprobs, ∂J/∂values)`` of
:func:`refppo.pipeline.step.update_quantities`, from the closed-form per-token gradients of the core
(:mod:`refppo.core.grad`, :func:`refppo.core.gspo.gspo_policy_grad_naive`).

``J = pg + vf_coef·vf − ent_coef·entropy + kl_coef·kl`` (step 9 of the pipeline); the entropy is an
input, so its term adds nothing to either gradient.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from refppo.conventions import LossAgg, PolicyLoss
from refppo.core import _pyfloat as pf
from refppo.core.aggregate import Prompts, agg_weights_naive, prompt_weights_naive
from refppo.core.grad import kl_loss_grad_naive, policy_grad_naive, value_grad_naive
from refppo.core.gspo import gspo_policy_grad_naive
from refppo.errors import ConventionError, DumpError
from refppo.pipeline.blocks import Evaluation, Normalisers
from refppo.pipeline.naive_update import normaliser_kwargs
from refppo.pipeline.needs import kl_loss_needs, missing_line
from refppo.pipeline.row_subset import kept_rows, put_rows, take_rows
from refppo.pipeline.settings import Convention, Hyperparams


def _pg_grad(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    hp: Hyperparams,
    conv: Convention,
    pol: dict[str, float],
    prompts: Prompts | None = None,
) -> Tensor:
    """``∂pg/∂logprobs`` by ``conv.policy.loss``: GSPO's (:func:`refppo.core.gspo.gspo_policy_grad_naive`)
    or the per-token ratio's (:func:`policy_grad_naive`), with the normalisers ``pol``. ``prompt-mean``:
    ``1/(P·N_p(b))`` times the ``token-sum`` gradient of row ``b`` (the loss of row ``b`` reads row
    ``b``'s log-probs alone, and ``prompt-mean`` weighs the whole row by that constant)."""
    if conv.agg.loss is LossAgg.PROMPT_MEAN:
        if prompts is None:
            raise ConventionError("loss_agg=prompt-mean needs group_index [B] (the prompt each row answers)")
        as_sum = replace(conv, agg=replace(conv.agg, loss=LossAgg.TOKEN_SUM))
        g = _pg_grad(logprobs, old_logprobs, advantages, mask, hp=hp, conv=as_sum, pol={})
        return g * torch.tensor(prompt_weights_naive(mask, prompts), dtype=g.dtype, device=g.device)
    if conv.policy.loss is PolicyLoss.CISPO:
        return cispo_grad_naive(logprobs, old_logprobs, advantages, mask, hp=hp, conv=conv, pol=pol)
    if conv.policy.loss is PolicyLoss.GSPO:
        return gspo_policy_grad_naive(
            logprobs,
            old_logprobs,
            advantages,
            mask,
            clip_low=hp.cliprange,
            clip_high=hp.cliprange_high,
            agg=conv.agg.loss,
            log_ratio_max=conv.policy.log_ratio_clamp,
            **pol,
        )
    return policy_grad_naive(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_low=hp.cliprange,
        clip_high=hp.cliprange_high,
        dual_clip=conv.policy.dual_clip,
        agg=conv.agg.loss,
        log_ratio_clamp=conv.policy.log_ratio_clamp,
        **pol,
    )


def cispo_grad_naive(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    hp: Hyperparams,
    conv: Convention,
    pol: dict[str, float],
) -> Tensor:
    """``∂pg/∂l_t = w(b,t)·(−c_t·A_t)`` of ``policy_loss=cispo``, token by token: ``c_t =
    clip(exp(clamp(l_t − l^old_t, ±κ)), 1 − ε_low, 1 + ε_high)`` is detached, so every token keeps
    its gradient (no clip gate); ``w(b,t)`` the aggregation weight (:func:`agg_weights_naive`)."""
    lo, hi = 1.0 - hp.cliprange, 1.0 + hp.clip_high
    k = conv.policy.log_ratio_clamp
    w = agg_weights_naive(mask, conv.agg.loss, **pol)
    lp, lo_p, advs, ms = pf.rows(logprobs), pf.rows(old_logprobs), pf.rows(advantages), pf.mask_rows(mask)
    out = []
    for b, mrow in enumerate(ms):
        row = []
        for t, ok in enumerate(mrow):
            d = lp[b][t] - lo_p[b][t]
            c = min(max(math.exp(min(max(d, -k), k) if k is not None else d), lo), hi) if ok else 0.0
            row.append(w[b][t] * -c * advs[b][t] if ok else 0.0)
        out.append(row)
    return torch.tensor(out, dtype=torch.float64, device=mask.device)


def objective_grads_naive(
    *,
    logprobs: Tensor,
    values: Tensor,
    old_logprobs: Tensor,
    old_values: Tensor,
    advantages: Tensor,
    returns: Tensor,
    mask: Tensor,
    value_mask_: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    hp: Hyperparams,
    conv: Convention,
    norm: Normalisers | None = None,
    is_weights: Tensor | None = None,
    group_index: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(∂J/∂logprobs, ∂J/∂values)`` of :func:`refppo.pipeline.step.update_quantities` (same args).

    ``J = pg + vf_coef·vf − ent_coef·entropy + kl_coef·kl`` with the pipeline's normalisers: the
    policy and KL terms use ``token_count``, ``seq_count`` and ``hp.horizon``; the value term the same
    but ``value_token_count`` for ``token_count`` when given, over ``value_mask_`` (default ``mask``).
    ``entropy`` is accepted (the pipeline's arguments) and unused: the entropy is an input, so
    ``ent_coef·entropy`` adds nothing to either gradient. ``is_weights``: the rollout correction's
    detached ``w'`` [B, T]: ``∂(agg(w'·ℓ))/∂l_t = w'_t·∂agg(ℓ)/∂l_t`` (``ℓ_t`` reads ``l_t`` alone, ``agg``
    is linear in ``ℓ``). ``group_index``: the prompt of each row (``loss_agg=prompt-mean``).
    """
    del entropy
    pol = normaliser_kwargs(norm, hp.horizon, value=False)
    val = normaliser_kwargs(norm, hp.horizon, value=True)
    prompts = (norm or Normalisers()).prompts(conv.agg.loss, group_index)
    g_lp = _pg_grad(logprobs, old_logprobs, advantages, mask, hp=hp, conv=conv, pol=pol, prompts=prompts)
    if is_weights is not None:
        g_lp = g_lp * is_weights.to(g_lp.dtype)
    if conv.kl.placement.in_loss and (ref_logprobs is not None or hp.loss_beta > 0):
        if ref_logprobs is None:
            raise DumpError(missing_line("ref_logprobs", "kl_loss", kl_loss_needs(conv, hp)["ref_logprobs"]))
        est, lrc, vc = conv.kl.loss_kl()
        g_kl = kl_loss_grad_naive(
            logprobs, ref_logprobs, mask, est, conv.agg.of("kl"), log_ratio_clamp=lrc,
            value_clamp=vc, logp_old=old_logprobs, grad_is_clip=conv.kl.grad_is_clip, **pol,
        )  # fmt: skip
        g_lp = g_lp + hp.loss_beta * g_kl
    g_v = value_grad_naive(
        values,
        old_values,
        returns,
        mask if value_mask_ is None else value_mask_,
        clip=hp.cliprange_value,
        kind=conv.value.loss,
        agg=conv.agg.loss if conv.agg.value is None else conv.agg.value,
        clip_form=conv.value.clip_form,
        **val,
    )
    return g_lp, hp.vf_coef * g_v


def grads_naive(q: Mapping[str, Any], conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """Naive twin of :func:`refppo.pipeline.update.grads_stage`: :func:`objective_grads_naive` on the
    update's inputs in ``q`` (the value term over the value stage's mask), 0 outside the masks; rows
    the rejection gate emptied (``rollout_rs_effect=drop_mask``) are 0, the rest computed without
    them (:mod:`refppo.pipeline.row_subset`)."""
    rows = kept_rows(q)
    if rows is not None:
        out: dict[str, Any] = {}
        put_rows(out, grads_naive(take_rows(q, rows), conv, hp, ev), rows, ("grad_logprobs", "grad_values"))
        return out
    g_lp, g_v = objective_grads_naive(
        logprobs=q["logprobs"], values=q["values"], old_logprobs=q["old_logprobs"],
        old_values=q["old_values"], advantages=q["advantages"], returns=q["returns"], mask=q["mask"],
        value_mask_=q["vf_loss_mask"],
        ref_logprobs=q.get("ref_logprobs"), entropy=q.get("entropy"), hp=hp, conv=conv, norm=ev.norm,
        is_weights=q.get("is_weights"), group_index=q.get("group_index"),
    )  # fmt: skip
    zero = torch.zeros((), dtype=g_lp.dtype)
    return {
        "grad_logprobs": torch.where(q["mask"], g_lp, zero),
        "grad_values": torch.where(q["vf_loss_mask"], g_v, zero),
    }
