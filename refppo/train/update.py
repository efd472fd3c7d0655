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
from dataclasses import dataclass, field

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
from refppo.pipeline.step import RolloutQuantities, UpdateQuantities, update_quantities
from refppo.train.update_config import Behaviour, CaptureRequest, MinibatchRecord, PPOUpdateConfig, PtxBatch

LOSS_KEYS = ("loss", "pg_loss", "vf_loss", "entropy", "kl_loss", "ptx_loss")
"""The minibatch sums of the losses (``entropy`` is ``UpdateQuantities.entropy_loss``)."""


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
    minibatch; ``advantages``/``returns`` ``[B, T]`` in the dtype of ``scored.old_logprobs``."""

    actor: nn.Module
    critic: nn.Module | None
    optimizers: list[torch.optim.Optimizer]
    scored: ScoredRollout
    quantities: RolloutQuantities
    advantages: Tensor
    returns: Tensor
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


@dataclass
class _Sums:
    """One minibatch's running sums over its micro-batches (Python floats, in micro-batch order):
    the losses, the token-weighted clip fractions and approx-KL, the max |ratio − 1|, the log-probs."""

    st: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LOSS_KEYS, 0.0))
    clip_w: float = 0.0
    akl_w: float = 0.0
    vclip_w: float = 0.0
    ratio_dev: float = 0.0
    lp_parts: list[Tensor] = field(default_factory=list)

    def add(self, uq: UpdateQuantities, logp: Tensor, m: Tensor, vm: Tensor) -> None:
        """Add micro-batch ``uq`` (its policy mask ``m`` and value mask ``vm``, ``[b, T]``)."""
        self.st["loss"] += float(uq.loss.detach())
        self.st["pg_loss"] += float(uq.pg_loss.detach())
        self.st["vf_loss"] += float(uq.vf_loss.detach())
        self.st["entropy"] += float(uq.entropy_loss.detach())
        assert uq.kl_loss is not None  # the trainer always holds ref_logprobs
        self.st["kl_loss"] += float(uq.kl_loss.detach())
        n_m = float(m.sum())
        self.clip_w += float(uq.pg_clipfrac) * n_m
        self.akl_w += float(uq.approx_kl) * n_m
        self.vclip_w += float(uq.vf_clipfrac) * float(vm.sum())
        dev = torch.where(m, (uq.ratio.detach() - 1.0).abs(), torch.zeros_like(logp))
        self.ratio_dev = max(self.ratio_dev, float(dev.max()))
        self.lp_parts.append(logp.detach())

    def stats(self, n_tok: float, n_vtok: float) -> dict[str, float]:
        """The minibatch scalars: loss sums, then the clip fractions and approx-KL as token means
        over ``n_tok`` (policy) / ``n_vtok`` (value) valid tokens of this rank, then the ratio."""
        st = dict(self.st)
        st["pg_clipfrac"] = self.clip_w / n_tok
        st["approx_kl"] = self.akl_w / n_tok
        st["vf_clipfrac"] = self.vclip_w / n_vtok
        st["ratio_max_dev"] = self.ratio_dev
        return st


def _record(
    rec: StepRecorder,
    k: int,
    logp: Tensor,
    values: Tensor | None,
    entropy: Tensor,
    idx: Tensor,
    scored: ScoredRollout,
    q: RolloutQuantities,
    uq: UpdateQuantities,
    world_size: int,
    group_index: Tensor | None,
    behaviour: Behaviour | None = None,
) -> None:
    """Record micro-batch ``k`` (rows ``idx``); the losses as passed to backward (× world_size);
    a critic-free step (``values`` None) carries no value quantity (``old_values``, ``values``,
    ``grad_values``, ``vf_loss``: the oracle's critic-free dump) and its rows' ``group_index``."""
    more: dict[str, Tensor] = {"group_index": group_index[idx]} if group_index is not None else {}
    more.update(behaviour.select(idx) if behaviour is not None else {})  # the seam mode's roles
    if values is not None:
        more["old_values"] = scored.old_values[idx]
    rec.record(
        micro_batch=k,
        logprobs=logp,
        values=values,
        response_mask=scored.batch.response_mask[idx],
        old_logprobs=scored.old_logprobs[idx],
        ref_logprobs=scored.ref_logprobs[idx],
        scores=scored.scores[idx],
        entropy=entropy,
        advantages=q.advantages[idx],
        returns=q.returns[idx],
        **{
            n: getattr(uq, n) * world_size
            for n in ("loss", "pg_loss", "vf_loss", "entropy_loss", "kl_loss")
            if n != "vf_loss" or values is not None
        },
        **more,
    )


def _normalisers(u: _Update, rows: Tensor) -> Normalisers:
    """The minibatch's global ``[tokens, sequences, value tokens]`` (all-reduced under DDP)."""
    mask, vmask = u.scored.batch.response_mask, u.quantities.value_mask
    counts = torch.tensor(
        [float(mask[rows].sum()), float(u.mb_size), float(vmask[rows].sum())],
        dtype=torch.float64,
        device=mask.device,
    )
    if u.all_reduce is not None:
        counts = u.all_reduce(counts)
    return Normalisers(
        token_count=float(counts[0]), seq_count=float(counts[1]), value_token_count=float(counts[2])
    )


def _micro_step(
    u: _Update, sums: _Sums, k: int, idx: Tensor, norm: Normalisers, rec: StepRecorder | None
) -> None:
    """Micro-batch ``k`` (rows ``idx``): forwards, losses, backward of ``loss · world_size``."""
    scored, q = u.scored, u.quantities
    mask, vmask = scored.batch.response_mask, q.value_mask
    sub = scored.batch.select(idx)
    logp, ent = response_logprobs(u.actor, sub, scored.temperature)
    values = response_values(u.critic, sub) if u.critic is not None else None
    uq = update_quantities(
        logprobs=logp,
        values=values,
        old_logprobs=scored.old_logprobs[idx],
        old_values=scored.old_values[idx] if u.critic is not None else None,
        advantages=u.advantages[idx],
        returns=u.returns[idx],
        mask=mask[idx],
        value_mask_=vmask[idx],
        ref_logprobs=scored.ref_logprobs[idx],
        entropy=ent,
        rollout_logprobs=u.behaviour.rollout_logprobs[idx] if u.behaviour is not None else None,
        hp=u.hp,
        conv=u.conv,
        norm=norm,
    )
    if rec is not None:
        _record(rec, k, logp, values, ent, idx, scored, q, uq, u.world_size, u.group_index, u.behaviour)
    torch.autograd.backward(uq.loss * u.world_size)
    sums.add(uq, logp, mask[idx], vmask[idx])


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
    norm = _normalisers(u, rows)
    for opt in u.optimizers:
        opt.zero_grad(set_to_none=True)
    sums = _Sums()
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
    mask, vmask = u.scored.batch.response_mask, u.quantities.value_mask
    st = sums.stats(float(mask[rows].sum()), float(vmask[rows].sum()))
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
    return _Update(
        actor=actor,
        critic=critic,
        optimizers=optimizers,
        scored=scored,
        quantities=quantities,
        advantages=quantities.advantages.to(dtype),
        returns=quantities.returns.to(dtype),
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
