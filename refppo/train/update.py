"""Step 4 of :func:`refppo.train.iteration.iteration`: K PPO epochs over one scored rollout
(:func:`ppo_update`).

One call, as nested loops (every loss through :func:`refppo.pipeline.step.update_quantities`)::

    ppo_update          for epoch: perm = randperm(B, generator) (or arange); for each minibatch:
      _minibatch          global normalisers (counts all-reduced), zero grads, then
        _micro_step       per micro-batch: forwards, update_quantities, backward(loss · world_size)
        ptx_loss          optional PPO-ptx backward (γ_ptx · LM loss)
        _finish_step      grad norms before clipping (per model), optimizer step(s), zero grads
    (_epochs: the epoch and minibatch loops and the metric sums; _plan: the sizes, fixed per call)

The Python floats of the metrics are summed in the same order as before the split (micro-batch by
micro-batch, then minibatch by minibatch), so the returned metrics are the same bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from refppo.capture.recorder import StepRecorder
from refppo.core.logprobs import logprobs_from_logits
from refppo.core.masked import AllReduce
from refppo.errors import HyperparameterError, ShapeError
from refppo.models.batch import position_ids_from_mask
from refppo.models.readout import response_logprobs, response_values
from refppo.models.roles import eval_mode
from refppo.models.rollout import ScoredRollout
from refppo.pipeline.blocks import Normalisers
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import RolloutQuantities, update_quantities
from refppo.train.split import LOSS_KEYS, Sums, record_micro, step_normalisers, update_masks
from refppo.train.update_config import Behaviour, CaptureRequest, MinibatchRecord, PPOUpdateConfig, PtxBatch


def ptx_loss(actor: nn.Module, ptx: PtxBatch) -> Tensor:
    """Token-mean next-token NLL of ``actor`` on ``ptx`` (InstructGPT's pretraining LM loss).

    Logits at position p predict token p+1; a pair counts when both positions are real tokens. The
    log-probs are the core's (:func:`refppo.core.logprobs.logprobs_from_logits`).
    """
    am = ptx.attention_mask.long()
    out = actor(input_ids=ptx.input_ids, attention_mask=am, position_ids=position_ids_from_mask(am))
    logits: Tensor = out.logits[:, :-1, :]
    valid = (am[:, :-1] * am[:, 1:]).bool()
    logp = logprobs_from_logits(logits.float(), ptx.input_ids[:, 1:], valid)  # 0 where not valid
    return -(logp.sum() / valid.sum().clamp(min=1))


def _splits(n: int, parts: int, what: str) -> int:
    if n % parts != 0:
        raise ShapeError(f"{what}: {n} rows cannot be split evenly into {parts} parts")
    return n // parts


def _params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _grad_norm(params: list[nn.Parameter], max_norm: float | None) -> float:
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.nn.utils.clip_grad_norm_(grads, max_norm if max_norm is not None else math.inf))


@dataclass(frozen=True)
class _Update:
    """What every minibatch of one :func:`ppo_update` call reads (fixed for the whole call).

    ``mb_size`` rows per minibatch, ``micro`` rows per micro-batch, ``n_micro`` micro-batches per
    minibatch; ``advantages``/``returns`` ``[B, T]`` in the dtype of ``scored.old_logprobs``;
    ``mask``/``value_mask`` ``[B, T]``: the update stages' masks (:func:`refppo.train.split.update_masks`)."""

    actor: nn.Module
    critic: nn.Module | None
    optimizers: list[torch.optim.Optimizer]
    scored: ScoredRollout
    quantities: RolloutQuantities
    advantages: Tensor
    returns: Tensor
    mask: Tensor
    value_mask: Tensor
    hp: Hyperparams
    conv: Convention
    cfg: PPOUpdateConfig
    world_size: int
    all_reduce: AllReduce | None
    ptx_batch: PtxBatch | None
    capture: CaptureRequest | None
    group_index: Tensor | None
    behaviour: Behaviour | None
    mb_size: int
    micro: int
    n_micro: int
    actor_params: list[nn.Parameter]
    critic_params: list[nn.Parameter]


def _micro_step(
    u: _Update, sums: Sums, k: int, idx: Tensor, norm: Normalisers, rec: StepRecorder | None
) -> None:
    """Micro-batch ``k`` (rows ``idx``): forwards, losses, backward of ``loss · world_size``. A
    micro-batch whose rows the rejection gate emptied (``rollout_rs_effect=drop_mask``: no token of
    :func:`refppo.train.split.update_masks`) adds 0 to the step: a zero backward through its forwards
    (every rank runs as many backwards as the others, which DDP's gradient all-reduce needs)."""
    scored, q = u.scored, u.quantities
    sub = scored.batch.select(idx)
    logp, ent = response_logprobs(u.actor, sub, scored.temperature)
    values = response_values(u.critic, sub) if u.critic is not None else None
    uq = None
    if bool(u.mask[idx].any()):
        uq = update_quantities(
            logprobs=logp,
            values=values,
            old_logprobs=scored.old_logprobs[idx],
            old_values=scored.old_values[idx] if u.critic is not None else None,
            advantages=u.advantages[idx],
            returns=u.returns[idx],
            mask=scored.batch.response_mask[idx],
            value_mask_=q.value_mask[idx],
            ref_logprobs=scored.ref_logprobs[idx],
            entropy=ent,
            rollout_logprobs=u.behaviour.rollout_logprobs[idx] if u.behaviour is not None else None,
            group_index=u.group_index[idx] if u.group_index is not None else None,
            hp=u.hp,
            conv=u.conv,
            norm=norm,
        )
    if rec is not None:
        record_micro(rec, k, logp, values, ent, idx, scored, q, uq, u.world_size, u.group_index, u.behaviour)
    if uq is not None:
        torch.autograd.backward(uq.loss * u.world_size)
    else:
        zero = logp.sum() * 0.0 + (values.sum() * 0.0 if values is not None else 0.0)
        torch.autograd.backward(zero)
    sums.add(uq, logp, u.mask[idx], u.value_mask[idx])


def _finish_step(u: _Update, st: dict[str, float]) -> None:
    """Grad norms before clipping (each model clipped to ``max_grad_norm``), step, zero grads."""
    st["actor_grad_norm"] = _grad_norm(u.actor_params, u.cfg.max_grad_norm)
    st["critic_grad_norm"] = _grad_norm(u.critic_params, u.cfg.max_grad_norm)
    for opt in u.optimizers:
        opt.step()
    for opt in u.optimizers:
        opt.zero_grad(set_to_none=True)


def _minibatch(u: _Update, epoch: int, mb: int, rows: Tensor) -> tuple[dict[str, float], list[Tensor]]:
    """One optimizer step on rows ``rows`` ``[mb_size]``: its scalars and its micro-batches'
    current log-probs (``[micro, T]`` each, detached, in row order)."""
    norm = step_normalisers(u.mask, u.value_mask, rows, u.group_index, u.conv, u.all_reduce, u.world_size)
    for opt in u.optimizers:
        opt.zero_grad(set_to_none=True)
    sums = Sums()
    rec = u.capture.wants(epoch, mb) if u.capture is not None else None
    for k in range(u.n_micro):
        _micro_step(u, sums, k, rows[k * u.micro : (k + 1) * u.micro], norm, rec)
    if u.ptx_batch is not None and u.cfg.ptx_coef > 0:
        lm = ptx_loss(u.actor, u.ptx_batch)
        torch.autograd.backward(u.cfg.ptx_coef * lm)
        sums.st["ptx_loss"] = float(lm.detach())
        sums.st["loss"] += u.cfg.ptx_coef * sums.st["ptx_loss"]
    if rec is not None and u.capture is not None:
        rec.write(u.capture.path)  # a collective: every rank reaches it
    st = sums.stats(float(u.mask[rows].sum()), float(u.value_mask[rows].sum()))
    _finish_step(u, st)
    return st, sums.lp_parts


def _plan(
    actor: nn.Module,
    critic: nn.Module | None,
    optimizers: list[torch.optim.Optimizer],
    scored: ScoredRollout,
    quantities: RolloutQuantities,
    *,
    hp: Hyperparams,
    conv: Convention,
    cfg: PPOUpdateConfig,
    world_size: int,
    all_reduce: AllReduce | None,
    ptx_batch: PtxBatch | None,
    capture: CaptureRequest | None,
    group_index: Tensor | None,
    behaviour: Behaviour | None,
) -> _Update:
    """The :class:`_Update` of one call: minibatch and micro-batch sizes (loud on uneven splits),
    the advantages/returns in the log-probs' dtype, the trainable parameters of each model."""
    if world_size < 1:
        raise HyperparameterError(f"world_size: expected >= 1, got {world_size}")
    mb_size = _splits(scored.batch.batch_size, cfg.num_minibatches, "num_minibatches")
    micro = cfg.micro_batch_size or mb_size
    n_micro = _splits(mb_size, micro, "micro_batch_size") if micro <= mb_size else 1
    dtype = scored.old_logprobs.dtype
    mask, value_mask = update_masks(scored, quantities, behaviour, hp=hp, conv=conv)
    return _Update(
        actor=actor,
        critic=critic,
        optimizers=optimizers,
        scored=scored,
        quantities=quantities,
        advantages=quantities.advantages.to(dtype),
        returns=quantities.returns.to(dtype),
        mask=mask,
        value_mask=value_mask,
        hp=hp,
        conv=conv,
        cfg=cfg,
        world_size=world_size,
        all_reduce=all_reduce,
        ptx_batch=ptx_batch,
        capture=capture,
        group_index=group_index,
        behaviour=behaviour,
        mb_size=mb_size,
        micro=min(micro, mb_size),
        n_micro=n_micro,
        actor_params=_params(actor),
        critic_params=_params(critic) if critic is not None else [],
    )


def _epochs(
    u: _Update, generator: torch.Generator, on_minibatch: Callable[[MinibatchRecord], None] | None
) -> dict[str, float]:
    """The K epochs of :func:`ppo_update` (models already in their update mode): the metrics."""
    sums: dict[str, float] = {}
    first: dict[str, float] = {}
    n_steps = 0
    B, device = u.scored.batch.batch_size, u.scored.batch.response_mask.device
    for epoch in range(u.cfg.ppo_epochs):
        perm = torch.randperm(B, generator=generator) if u.cfg.shuffle else torch.arange(B)
        perm = perm.to(device)
        for mb in range(u.cfg.num_minibatches):
            rows = perm[mb * u.mb_size : (mb + 1) * u.mb_size]
            st, lp_parts = _minibatch(u, epoch, mb, rows)
            if epoch == 0 and mb == 0:
                first = {
                    "first_ratio_max_dev": st["ratio_max_dev"],
                    "first_pg_clipfrac": st["pg_clipfrac"],
                    "first_approx_kl": st["approx_kl"],
                }
            for key, val in st.items():
                sums[key] = sums.get(key, 0.0) + val
            n_steps += 1
            if on_minibatch is not None:
                on_minibatch(
                    MinibatchRecord(
                        epoch=epoch,
                        index=mb,
                        rows=rows.detach().cpu(),
                        old_logprobs=u.scored.old_logprobs[rows].detach(),
                        logprobs=torch.cat(lp_parts, dim=0),
                        stats=dict(st),
                    )
                )
    metrics = {k: v / n_steps for k, v in sums.items() if k != "ratio_max_dev"}
    metrics.update(first)
    return metrics


def ppo_update(
    actor: nn.Module,
    critic: nn.Module | None,
    actor_optimizer: torch.optim.Optimizer,
    critic_optimizer: torch.optim.Optimizer | None,
    scored: ScoredRollout,
    quantities: RolloutQuantities,
    *,
    hp: Hyperparams,
    conv: Convention,
    cfg: PPOUpdateConfig,
    generator: torch.Generator,
    world_size: int = 1,
    all_reduce: AllReduce | None = None,
    ptx_batch: PtxBatch | None = None,
    on_minibatch: Callable[[MinibatchRecord], None] | None = None,
    capture: CaptureRequest | None = None,
    group_index: Tensor | None = None,
    behaviour: Behaviour | None = None,
) -> dict[str, float]:
    """K PPO epochs over shuffled minibatches of one scored rollout (:mod:`refppo.ppo`, step 4).

    Returns the means over all minibatch steps of ``loss, pg_loss, vf_loss, entropy, kl_loss,
    ptx_loss, pg_clipfrac, approx_kl, vf_clipfrac, actor_grad_norm, critic_grad_norm`` (grad norms
    before clipping), plus ``first_ratio_max_dev``, ``first_pg_clipfrac`` and ``first_approx_kl``
    of the first minibatch of the first epoch. ``capture``: record one optimizer step (every
    micro-batch, as passed to backward) and write it as one v2 dump after its backward(s);
    ``group_index`` ``[B]`` is written with it (critic-free group estimators). ``behaviour`` (the
    seam mode): the engine's ``rollout_logprobs`` for the ``rollout_correction`` stage, both roles
    and ``policy_version`` in the dump.
    ``critic=None`` (a critic-free ``conv.adv.estimator``): no value forward and no value loss
    (``vf_loss``, ``vf_clipfrac`` and ``critic_grad_norm`` are 0); pass ``critic_optimizer=None``.
    """
    optimizers = [actor_optimizer] + ([critic_optimizer] if critic_optimizer is not None else [])
    u = _plan(
        actor, critic, optimizers, scored, quantities, hp=hp, conv=conv, cfg=cfg, world_size=world_size,
        all_reduce=all_reduce, ptx_batch=ptx_batch, capture=capture, group_index=group_index,
        behaviour=behaviour,
    )  # fmt: skip
    models = (actor,) if critic is None else (actor, critic)
    with eval_mode(*models):
        if cfg.dropout_in_update:
            for model in models:
                model.train()
        return _epochs(u, generator, on_minibatch)


__all__ = ["LOSS_KEYS", "ppo_update", "ptx_loss"]
