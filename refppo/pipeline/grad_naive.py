"""Naive twin of the gradient of one update step: ``(∂J/∂logprobs, ∂J/∂values)`` of
:func:`refppo.pipeline.update.update_quantities`, from the closed-form per-token gradients of the core
(:mod:`refppo.core.grad`, :func:`refppo.core.gspo.gspo_policy_grad_naive`).

``J = pg + vf_coef·vf − ent_coef·entropy + kl_coef·kl`` (step 9 of the pipeline); the entropy is an
input, so its term adds nothing to either gradient.
"""

from __future__ import annotations

from torch import Tensor

from refppo.conventions import KLPlacement, PolicyLoss
from refppo.core.grad import kl_loss_grad_naive, policy_grad_naive, value_grad_naive
from refppo.core.gspo import gspo_policy_grad_naive
from refppo.errors import ConventionError
from refppo.pipeline.blocks import Normalisers
from refppo.pipeline.settings import Convention, Hyperparams


def _normaliser_kwargs(norm: Normalisers | None, horizon: float | None, *, value: bool) -> dict[str, float]:
    """The twin's own reading of the normalisers (restated, not :meth:`Normalisers.kwargs`, so a slip
    there is not copied here): ``token_count`` (the value term: ``value_token_count`` when given),
    ``seq_count`` and ``horizon``, each only when set."""
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


def _pg_grad(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    hp: Hyperparams,
    conv: Convention,
    pol: dict[str, float],
) -> Tensor:
    """``∂pg/∂logprobs`` by ``conv.policy.loss``: GSPO's (:func:`refppo.core.gspo.gspo_policy_grad_naive`)
    or the per-token ratio's (:func:`policy_grad_naive`), with the normalisers ``pol``."""
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
) -> tuple[Tensor, Tensor]:
    """``(∂J/∂logprobs, ∂J/∂values)`` of :func:`refppo.pipeline.update.update_quantities` (same args).

    ``J = pg + vf_coef·vf − ent_coef·entropy + kl_coef·kl`` with the pipeline's normalisers: the
    policy and KL terms use ``token_count``, ``seq_count`` and ``hp.horizon``; the value term the same
    but ``value_token_count`` for ``token_count`` when given, over ``value_mask_`` (default ``mask``).
    ``entropy`` is accepted (the pipeline's arguments) and unused: the entropy is an input, so
    ``ent_coef·entropy`` adds nothing to either gradient.
    """
    del entropy
    pol = _normaliser_kwargs(norm, hp.horizon, value=False)
    val = _normaliser_kwargs(norm, hp.horizon, value=True)
    g_lp = _pg_grad(logprobs, old_logprobs, advantages, mask, hp=hp, conv=conv, pol=pol)
    if conv.kl.placement is KLPlacement.LOSS:
        if ref_logprobs is None:
            raise ConventionError("kl_in=loss needs ref_logprobs for the KL loss on the current log-probs")
        g_kl = kl_loss_grad_naive(
            logprobs,
            ref_logprobs,
            mask,
            conv.kl.estimator,
            conv.agg.loss if conv.agg.kl is None else conv.agg.kl,
            log_ratio_clamp=conv.kl.log_ratio_clamp,
            value_clamp=conv.kl.value_clamp,
            **pol,
        )
        g_lp = g_lp + hp.kl_coef * g_kl
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
