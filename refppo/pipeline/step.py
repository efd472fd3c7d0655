"""The PPO step as walks of the stage table (:mod:`refppo.pipeline.stages`): the entry points the
trainer, the oracle and the goldens call.

    reward_quantities        stages score_map … rewards          -> (kl, token_rewards, value_mask)
    rollout_quantities       the rollout stages (steps 0–4)       -> RolloutQuantities
    rollout_quantities_naive the same walk through the naive twins
    update_quantities        the update stages (steps 5–9)        -> UpdateQuantities
    update_quantities_naive  the same walk through the naive twins

Each is :func:`refppo.pipeline.stages.walk` on the step's inputs; what a walk does not return is
freed as soon as no later stage reads it (the per-token policy loss before the value loss).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from refppo.core.checks import check_mask
from refppo.core.masked import AllReduce
from refppo.pipeline.blocks import Evaluation, Normalisers, update_rows
from refppo.pipeline.row_subset import put_rows, rows_in_loss, take_rows, whole_normalisers
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.stages import BY_NAME, ROLLOUT_STAGES, UPDATE_STAGES, Stage, walk

REWARD_STAGES = tuple(BY_NAME[n] for n in ("score_map", "kl", "value_mask", "rewards", "reward_whitening"))
"""Steps 0–2: what :func:`reward_quantities` walks (the oracle's diagnosis pre-test)."""


@dataclass(frozen=True)
class RolloutQuantities:
    """Steps 1–4: computed once per rollout from cached tensors. All ``[B, T]``."""

    kl: Tensor | None
    """Per-token KL (old vs ref) — the one that enters the reward (zeros if KL is in the loss); None
    without ``ref_logprobs`` where nothing reads it (:func:`refppo.pipeline.needs.kl_needs`)."""
    token_rewards: Tensor
    advantages_raw: Tensor
    """GAE advantages before whitening."""
    advantages: Tensor
    """As fed to the policy loss (after whitening)."""
    returns: Tensor
    """``advantages_raw + old_values``: the value targets."""
    value_mask: Tensor
    """Mask of GAE and the value loss (see :func:`refppo.pipeline.rollout.value_mask`)."""


_ROLLOUT_OUT = ("kl", "token_rewards", "advantages_raw", "advantages", "returns", "value_mask")


def _rollout_inputs(
    scores: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor | None,
    mask: Tensor,
    kl: Tensor | None,
    **more: Any,
) -> dict[str, Any]:
    q: dict[str, Any] = {
        "scores": scores,
        "old_logprobs": old_logprobs,
        "ref_logprobs": ref_logprobs,
        "mask": check_mask("response_mask", mask),
        **more,
    }
    if kl is not None:
        q["kl"] = kl
    return q


def reward_quantities(
    *,
    scores: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor | None,
    mask: Tensor,
    hp: Hyperparams,
    conv: Convention,
    all_reduce: AllReduce | None = None,
    kl: Tensor | None = None,
) -> tuple[Tensor | None, Tensor, Tensor]:
    """Steps 0–2 (:data:`REWARD_STAGES`): ``(kl, token_rewards, value_mask)``, all ``[B, T]``.

    The per-token KL of the old vs reference log-probs (always, also when KL is placed in the loss),
    the token rewards and the value mask: :func:`rollout_quantities`' first stages (the same calls,
    so the same values). ``kl``: step 1's result when the caller already holds it (that stage is then
    not run: the oracle's candidates with the same KL keys share it).
    """
    q = _rollout_inputs(scores, old_logprobs, ref_logprobs, mask, kl)
    out = walk(REWARD_STAGES, q, conv, hp, Evaluation(all_reduce=all_reduce))
    return out["kl"], out["token_rewards"], out["value_mask"]


def _rollout_result(out: dict[str, Any], conv: Convention) -> RolloutQuantities:
    kl = out["kl"]
    if not conv.kl.placement.in_reward and kl is not None:
        kl = torch.zeros_like(kl)
    return RolloutQuantities(
        kl, out["token_rewards"], out["advantages_raw"], out["advantages"], out["returns"], out["value_mask"]
    )


def rollout_quantities(
    *,
    scores: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor | None,
    old_values: Tensor | None,
    mask: Tensor,
    hp: Hyperparams,
    conv: Convention,
    all_reduce: AllReduce | None = None,
    group_index: Tensor | None = None,
    groups_on_rank: bool = False,
    kl: Tensor | None = None,
    bootstrap_values: Tensor | None = None,
    truncated: Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
) -> RolloutQuantities:
    """Steps 0–4: a walk of :data:`refppo.pipeline.stages.ROLLOUT_STAGES`.

    ``all_reduce`` (a SUM all-reduce across ranks; None on one process): the tensors are this
    rank's rows and the whitening moments (step 4) are all-reduced, so each rank's advantages equal
    its rows of one process whitening the whole global batch (as verl). Steps 1–3 are per row and
    need no communication. Every rank must call it (the whitening is a collective).

    Step 3 is GAE for ``advantage = gae`` (needs ``old_values``); otherwise the critic-free
    estimator (``old_values`` unused, may be None; the group estimators need ``group_index`` ``[B]``,
    the prompt each row answers). Critic-free ``returns`` are the raw advantages.
    ``groups_on_rank``: with ``all_reduce``, the caller guarantees that every group's rows are on
    this rank (the trainer samples whole groups per rank and checks it), so the per-process group
    statistics are the global ones; without it a group estimator under ``all_reduce`` is refused.
    ``kl``: step 1's result when the caller already holds it (as :func:`reward_quantities`).
    ``bootstrap_values``, ``truncated`` ``[B]``: read by GAE under ``gae_bootstrap=truncated``.
    ``rollout_logprobs``: read by the rejection gate under ``rollout_rs_effect=drop_mask`` (its kept
    tokens are the mask of GAE and the whitening; ``value_mask`` is then the gate's).
    """
    q = _rollout_inputs(
        scores, old_logprobs, ref_logprobs, mask, kl, old_values=old_values, group_index=group_index,
        bootstrap_values=bootstrap_values, truncated=truncated, rollout_logprobs=rollout_logprobs,
    )  # fmt: skip
    ev = Evaluation(all_reduce=all_reduce, groups_on_rank=groups_on_rank)
    return _rollout_result(walk(ROLLOUT_STAGES, q, conv, hp, ev, keep=_ROLLOUT_OUT), conv)


def rollout_quantities_naive(
    *,
    scores: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor | None,
    old_values: Tensor | None,
    mask: Tensor,
    hp: Hyperparams,
    conv: Convention,
    group_index: Tensor | None = None,
    bootstrap_values: Tensor | None = None,
    truncated: Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
) -> RolloutQuantities:
    """:func:`rollout_quantities` through each stage's naive twin (one process)."""
    q = _rollout_inputs(
        scores, old_logprobs, ref_logprobs, mask, None, old_values=old_values, group_index=group_index,
        bootstrap_values=bootstrap_values, truncated=truncated, rollout_logprobs=rollout_logprobs,
    )  # fmt: skip
    return _rollout_result(walk(ROLLOUT_STAGES, q, conv, hp, keep=_ROLLOUT_OUT, naive=True), conv)


@dataclass(frozen=True)
class UpdateQuantities:
    """Steps 5–9 for one (mini/micro-)batch. Losses are 0-dim and differentiable."""

    loss: Tensor
    pg_loss: Tensor
    vf_loss: Tensor
    entropy_loss: Tensor
    kl_loss: Tensor | None
    """None under ``kl_in=loss`` at β = 0 without ``ref_logprobs`` (not read by the total)."""
    kl_metric: Tensor | None
    """The logged KL metric (the dumped ``kl_loss``): ``kl_loss`` unless ``kl_metric_agg`` differs."""
    ratio: Tensor
    pg_clipfrac: Tensor
    pg_clipfrac_lower: Tensor
    approx_kl: Tensor
    vf_clipfrac: Tensor

    def stats(self) -> dict[str, float]:
        """The scalars as Python floats (detached) for logging."""
        names: tuple[str, ...] = ("loss", "pg_loss", "vf_loss", "entropy_loss", "kl_loss", "pg_clipfrac")
        names = (*names, "pg_clipfrac_lower", "approx_kl", "vf_clipfrac")
        return {n: float(getattr(self, n).detach()) for n in names if getattr(self, n) is not None}


_UPDATE_OUT = tuple(UpdateQuantities.__dataclass_fields__)


def update_inputs(
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
    rollout_logprobs: Tensor | None = None,
    truncated: Tensor | None = None,
    group_index: Tensor | None = None,
) -> dict[str, Any]:
    """The quantities the update stages read, with the masks validated (``value_mask_`` None: the
    response mask; ``rollout_logprobs``: the behaviour log-probs, read only by the rollout
    correction when it is on; ``truncated`` [B]: read under ``truncated_rows`` ≠ ``keep``,
    :mod:`refppo.pipeline.row_subset`; ``group_index`` ``[B]``: the prompt of each row, read by
    ``loss_agg=prompt-mean``)."""
    m = check_mask("response_mask", mask)
    return {
        "logprobs": logprobs,
        "values": values,
        "old_logprobs": old_logprobs,
        "old_values": old_values,
        "advantages": advantages,
        "returns": returns,
        "mask": m,
        # a value mask may have rows the rejection gate emptied (rollout_rs_effect=drop_mask)
        "value_mask": m
        if value_mask_ is None
        else check_mask("value_mask", value_mask_, require_nonempty_rows=False),
        "ref_logprobs": ref_logprobs,
        "entropy": entropy,
        "rollout_logprobs": rollout_logprobs,
        "truncated": truncated,
        **({} if group_index is None else {"group_index": group_index}),  # absent: a caller's own kept
    }


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
    rollout_logprobs: Tensor | None = None,
    truncated: Tensor | None = None,
    group_index: Tensor | None = None,
    hp: Hyperparams,
    conv: Convention,
    norm: Normalisers | None = None,
    stages: Sequence[Stage] = UPDATE_STAGES,
) -> UpdateQuantities:
    """Steps 5–9: a walk of :data:`refppo.pipeline.stages.UPDATE_STAGES` (inputs: :func:`update_inputs`;
    ``stages``: a variant of them, :func:`refppo.pipeline.bugs.variant`).

    ``values``/``old_values`` None (a critic-free step, ``advantage`` ≠ ``gae``): no value
    loss, ``vf_loss`` and ``vf_clipfrac`` are 0 and the total loss has no value term.
    Without an autograd graph (no input requires a gradient, or grad mode is off: the oracle's
    recompute) a batch over :data:`refppo.pipeline.blocks.ROW_BLOCK_ELEMENTS` elements is evaluated
    by blocks of rows (:func:`refppo.pipeline.blocks.update_rows`): the same values bit for bit,
    without the whole-batch per-token temporaries. The trainer's differentiated call takes the
    whole batch.
    """
    q = update_inputs(
        logprobs=logprobs, values=values, old_logprobs=old_logprobs, old_values=old_values,
        advantages=advantages, returns=returns, mask=mask, value_mask_=value_mask_, ref_logprobs=ref_logprobs,
        entropy=entropy, rollout_logprobs=rollout_logprobs, truncated=truncated, group_index=group_index,
    )  # fmt: skip
    q, norm, keep = _in_loss(q, conv, norm)
    rows = update_rows(
        q["mask"], logprobs, values, old_logprobs, old_values, advantages, returns, ref_logprobs, entropy
    )
    out = walk(stages, q, conv, hp, Evaluation(rows=rows, norm=norm), keep=_UPDATE_OUT)
    return _scattered(out, keep)


def _in_loss(
    q: dict[str, Any], conv: Convention, norm: Normalisers | None
) -> tuple[dict[str, Any], Normalisers, Tensor | None]:
    """``q`` on the rows in the loss and the whole batch's normalisers (:mod:`refppo.pipeline.row_subset`;
    ``q`` itself and ``keep`` None under ``truncated_rows=keep``)."""
    keep = rows_in_loss(q, conv)
    if keep is None:
        return q, norm or Normalisers(), None
    sub = take_rows(q, keep)
    return sub, whole_normalisers(sub, int(keep.shape[0]), conv, norm or Normalisers()), keep


def _scattered(out: dict[str, Any], keep: Tensor | None) -> UpdateQuantities:
    """The walk's :class:`UpdateQuantities`, its ``ratio`` back on every row (1 on those out of the loss)."""
    if keep is not None and out["ratio"].numel() > 0:
        out = dict(out)
        put_rows(out, {"ratio": out["ratio"]}, keep, ("ratio",), fill={"ratio": 1.0})
    return UpdateQuantities(**{k: out[k] for k in _UPDATE_OUT})


def update_grads(
    q: dict[str, Any],
    *,
    hp: Hyperparams,
    conv: Convention,
    norm: Normalisers | None = None,
    objective: str = "loss",
    stages: Sequence[Stage] = UPDATE_STAGES,
) -> dict[str, Tensor]:
    """``grad_logprobs``, ``grad_values`` of ``objective`` (``loss`` or ``pg_loss``) and the detached
    ``ratio``: the update stages walked under autograd on fresh leaves of ``q``'s ``logprobs`` and
    ``values`` (the quantities of :func:`update_inputs`), then the grads stage."""
    q, whole, keep = _in_loss(q, conv, norm)
    lp = q["logprobs"].detach().clone().requires_grad_(True)
    v = q["values"].detach().clone().requires_grad_(True)
    out = walk(stages, {**q, "logprobs": lp, "values": v}, conv, hp, Evaluation(norm=whole))
    grads = {
        **BY_NAME["grads"].run({**out, "loss": out[objective]}, conv, hp),
        "ratio": out["ratio"].detach(),
    }
    if keep is None:
        return grads
    whole_grads: dict[str, Tensor] = {}
    put_rows(whole_grads, grads, keep, grads, fill={"ratio": 1.0})
    return whole_grads


def update_quantities_naive(
    q: dict[str, Any], *, hp: Hyperparams, conv: Convention, norm: Normalisers | None = None
) -> UpdateQuantities:
    """:func:`update_quantities` through each stage's naive twin (float64 scalars) on the quantities
    ``q`` of :func:`update_inputs`."""
    q, whole, keep = _in_loss(q, conv, norm)
    out = walk(UPDATE_STAGES, q, conv, hp, Evaluation(norm=whole), naive=True)
    return _scattered(out, keep)


__all__ = [
    "REWARD_STAGES",
    "RolloutQuantities",
    "UpdateQuantities",
    "reward_quantities",
    "rollout_quantities",
    "rollout_quantities_naive",
    "update_grads",
    "update_inputs",
    "update_quantities",
    "update_quantities_naive",
]
