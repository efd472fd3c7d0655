"""Steps 5–9 of the pipeline: per PPO epoch / minibatch, with the current policy and critic
(split out of ``refppo/pipeline.py``, which re-exports every name; the numbered pipeline order is
there).

    policy_term             steps 5–6: ratio and the policy loss of ``conv.policy_loss``
    update_quantities       steps 5–9: + value loss, entropy bonus, KL loss, total loss
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from refppo.conventions import AdvantageEstimator, KLPlacement, PolicyLoss
from refppo.core.by_rows import (
    entropy_bonus_by_rows,
    kl_loss_by_rows,
    policy_loss_by_rows,
    value_loss_by_rows,
)
from refppo.core.checks import check_mask
from refppo.core.gspo import gspo_policy_loss
from refppo.core.objective import entropy_bonus, kl_loss, total_loss
from refppo.core.policy import PolicyLossOutput, clipped_policy_loss
from refppo.core.value import value_loss
from refppo.errors import ConventionError
from refppo.pipeline.blocks import update_rows
from refppo.pipeline.settings import Convention, Hyperparams


@dataclass(frozen=True)
class UpdateQuantities:
    """Steps 5–9 for one (mini/micro-)batch. Losses are 0-dim and differentiable."""

    loss: Tensor
    pg_loss: Tensor
    vf_loss: Tensor
    entropy_loss: Tensor
    kl_loss: Tensor
    ratio: Tensor
    pg_clipfrac: Tensor
    pg_clipfrac_lower: Tensor
    approx_kl: Tensor
    vf_clipfrac: Tensor

    def stats(self) -> dict[str, float]:
        """The scalars as Python floats (detached) for logging."""
        names: tuple[str, ...] = ("loss", "pg_loss", "vf_loss", "entropy_loss", "kl_loss", "pg_clipfrac")
        names = (*names, "pg_clipfrac_lower", "approx_kl", "vf_clipfrac")
        return {n: float(getattr(self, n).detach()) for n in names}


@dataclass(frozen=True)
class Normalisers:
    """Global normalisers when one optimizer step is split into micro-batches or ranks.

    ``token_count``/``seq_count`` are the valid-token and sequence counts of the WHOLE step
    (policy mask), ``value_token_count`` the valid-token count of the value mask. None: local.
    """

    token_count: float | None = None
    seq_count: float | None = None
    value_token_count: float | None = None

    def kwargs(self, horizon: float | None, *, value: bool = False) -> dict[str, float]:
        """The normaliser keyword arguments of the policy terms (``value``: the value term's, whose
        ``token_count`` is ``value_token_count`` when given), ``horizon`` = ``hp.horizon``; None
        entries are left out (local counts, the padded length)."""
        out = {"token_count": self.token_count, "seq_count": self.seq_count, "horizon": horizon}
        if value and self.value_token_count is not None:
            out["token_count"] = self.value_token_count
        return {k: v for k, v in out.items() if v is not None}


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
    """Step 5–6 of the module docstring: the policy loss of ``conv.policy_loss`` (per token and
    aggregated), as :func:`update_quantities` computes it; the oracle's gradient diagnosis reads
    its per-token loss ``ℓ`` [B, T] (``∂pg/∂A``, :mod:`refppo.oracle.check.grad_diagnose`).
    ``rows``: evaluate by blocks of that many rows (:mod:`refppo.core.by_rows`: the same values bit
    for bit, no autograd graph); None: the whole batch at once."""
    pol_norm = (norm or Normalisers()).kwargs(hp.horizon)
    if rows is not None:
        gspo = conv.policy_loss is PolicyLoss.GSPO
        return policy_loss_by_rows(
            rows, logprobs, old_logprobs, advantages, mask, gspo=gspo, clip_low=hp.cliprange,
            clip_high=hp.cliprange_high, dual_clip=None if gspo else conv.dual_clip, agg=conv.loss_agg,
            log_ratio_clamp=conv.log_ratio_clamp, **pol_norm,
        )  # fmt: skip
    if conv.policy_loss is PolicyLoss.GSPO:
        return gspo_policy_loss(
            logprobs,
            old_logprobs,
            advantages,
            mask,
            clip_low=hp.cliprange,
            clip_high=hp.cliprange_high,
            agg=conv.loss_agg,
            log_ratio_max=conv.log_ratio_clamp,
            **pol_norm,
        )
    return clipped_policy_loss(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_low=hp.cliprange,
        clip_high=hp.cliprange_high,
        dual_clip=conv.dual_clip,
        agg=conv.loss_agg,
        log_ratio_clamp=conv.log_ratio_clamp,
        **pol_norm,
    )


def update_quantities(
    *,
    logprobs: Tensor,
    values: Tensor | None,
    old_logprobs: Tensor,
    old_values: Tensor | None,
    advantages: Tensor,
    returns: Tensor,
    mask: Tensor,
    value_mask_: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    hp: Hyperparams,
    conv: Convention,
    norm: Normalisers | None = None,
) -> UpdateQuantities:
    """Steps 5–9 of the module docstring.

    ``values``/``old_values`` None (a critic-free step, ``conv.advantage`` ≠ ``gae``): no value
    loss, ``vf_loss`` and ``vf_clipfrac`` are 0 and the total loss has no value term.
    Without an autograd graph (no input requires a gradient, or grad mode is off: the oracle's
    recompute) a batch over :data:`ROW_BLOCK_ELEMENTS` elements is evaluated by blocks of rows
    (:func:`update_rows`, :mod:`refppo.core.by_rows`): the same values bit for bit, without the
    whole-batch per-token temporaries. The trainer's differentiated call takes the whole batch.
    """
    m = check_mask("response_mask", mask)
    vm = m if value_mask_ is None else check_mask("value_mask", value_mask_)
    nm = norm or Normalisers()
    pol_norm = nm.kwargs(hp.horizon)
    val_norm = nm.kwargs(hp.horizon, value=True)
    rows = update_rows(
        m, logprobs, values, old_logprobs, old_values, advantages, returns, ref_logprobs, entropy
    )
    pg = policy_term(logprobs, old_logprobs, advantages, m, hp=hp, conv=conv, norm=nm, rows=rows)
    # Keep what is returned; the per-token loss [B, T] is not, so it is freed before the value
    # loss allocates its own (under autograd the graph keeps what the backward pass needs).
    pg_loss, pg_ratio, pg_clipfrac, pg_clipfrac_lower, pg_approx_kl = (
        pg.loss, pg.ratio, pg.clipfrac, pg.clipfrac_lower, pg.approx_kl
    )  # fmt: skip
    del pg
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    if values is None or old_values is None:
        if conv.advantage is AdvantageEstimator.GAE:
            raise ConventionError("advantage=gae needs values and old_values for the value loss")
        vf_loss, vf_clipfrac = zero, zero
    else:
        vf_fn = value_loss if rows is None else partial(value_loss_by_rows, rows)
        vf = vf_fn(
            values,
            old_values,
            returns,
            vm,
            clip=hp.cliprange_value,
            kind=conv.value_loss,
            agg=conv.loss_agg if conv.value_loss_agg is None else conv.value_loss_agg,
            clip_form=conv.value_clip_form,
            **val_norm,
        )
        vf_loss, vf_clipfrac = vf.loss, vf.clipfrac
        del vf
    ent_agg = conv.loss_agg if conv.entropy_agg is None else conv.entropy_agg
    if entropy is None:
        ent = zero
    elif rows is None:
        ent = entropy_bonus(entropy, m, ent_agg, **pol_norm)
    else:
        ent = entropy_bonus_by_rows(rows, entropy, m, ent_agg, **pol_norm)
    if conv.kl_in is KLPlacement.LOSS:
        if ref_logprobs is None:
            raise ConventionError("kl_in=loss needs ref_logprobs for the KL loss on the current log-probs")
        kl_fn = kl_loss if rows is None else partial(kl_loss_by_rows, rows)
        kll = kl_fn(
            logprobs,
            ref_logprobs,
            m,
            conv.kl_estimator,
            conv.loss_agg if conv.kl_loss_agg is None else conv.kl_loss_agg,
            log_ratio_clamp=conv.kl_log_ratio_clamp,
            value_clamp=conv.kl_value_clamp,
            **pol_norm,
        )
    else:
        kll = zero
    loss = total_loss(
        pg_loss,
        vf_loss,
        ent,
        kll,
        vf_coef=hp.vf_coef,
        ent_coef=hp.ent_coef,
        kl_coef=hp.kl_coef if conv.kl_in is KLPlacement.LOSS else 0.0,
    )
    return UpdateQuantities(
        loss=loss,
        pg_loss=pg_loss,
        vf_loss=vf_loss,
        entropy_loss=ent,
        kl_loss=kll,
        ratio=pg_ratio,
        pg_clipfrac=pg_clipfrac,
        pg_clipfrac_lower=pg_clipfrac_lower,
        approx_kl=pg_approx_kl,
        vf_clipfrac=vf_clipfrac,
    )
