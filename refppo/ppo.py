"""The PPO loop on real models: rollout → scoring → rollout quantities → K epochs of updates.

Public API (stable; the trainer, tools/make_golden.py and the tests call it)::

    PPOUpdateConfig                    frozen: ppo_epochs, num_minibatches, micro_batch_size,
                                       max_grad_norm, ptx_coef, dropout_in_update, shuffle
    PtxBatch                           frozen: input_ids [N, S], attention_mask [N, S] (SFT/pretrain ids)
    MinibatchRecord                    what ``on_minibatch`` receives after each optimizer step
    ppo_update(actor, critic, actor_optimizer, critic_optimizer, scored, quantities, *, hp, conv,
               cfg, generator, world_size=1, all_reduce=None, ptx_batch=None,
               on_minibatch=None, capture=None) -> dict[str, float]
    CaptureRequest                     frozen: epoch, minibatch, recorder, path (one step as a v2 dump)
    IterationResult                    frozen: metrics, scored, quantities
    iteration(actor, reference, critic, reward, actor_optimizer, critic_optimizer, prompt_ids,
              prompt_mask, *, rollout_cfg, update_cfg, hp, conv, generator, world_size=1,
              all_reduce=None, ptx_batch=None, batch=None, on_minibatch=None) -> IterationResult
    rollout_metrics(scored, quantities, hp, conv) -> dict[str, float]
    ptx_loss(actor, ptx) -> Tensor

Numbered skeleton of :func:`iteration` (lm-human-preferences / TRL ppov2)::

    1. responses  = generate_rollout(actor, prompts)        (or ``batch=`` to replay given tokens)
    2. scored     = score_rollout(...)                      π_old, π_ref log-probs, V_old, scores
                                                            (eval mode, no_grad, ONE pass each)
    3. quantities = refppo.pipeline.rollout_quantities(...) kl → token rewards → GAE → whitening
    4. for epoch in range(ppo_epochs):                      rows shuffled by ``generator``
         for minibatch in split(perm, num_minibatches):     loud failure on uneven splits
           normalisers = global token/seq counts of the minibatch (all_reduce'd across ranks)
           for micro in split(minibatch, micro_batch_size):
             logp, H = response_logprobs(actor, micro)      SAME dropout setting as π_old (eval)
             V       = response_values(critic, micro)
             loss    = update_quantities(..., norm=normalisers).loss · world_size
             backward(loss)                                  gradients accumulate
           backward(ptx_coef · ptx_loss)                     optional, InstructGPT PPO-ptx
           clip grad norms (actor and critic separately); optimizer step(s); zero grads

Design decisions:

- **Optimizers.** ``actor_optimizer`` and ``critic_optimizer`` are separate (TRL/OpenRLHF/verl
  keep two). Pass ``critic_optimizer=None`` when ``actor_optimizer`` holds the parameters of both
  models (one joint optimizer). Gradient clipping is always per model: ``max_grad_norm`` bounds
  the actor's and the critic's gradient norms separately. The actor and the critic share no
  parameters, so the single backward of ``pg + vf_coef·vf`` gives each model exactly its own
  loss's gradient.
- **Exact accumulation.** Every micro-batch's loss uses the WHOLE minibatch's normalisers
  (:class:`refppo.pipeline.Normalisers`), so the sum of the micro losses is the minibatch loss in
  every ``loss_agg`` mode and the accumulated gradient equals the one-shot gradient.
- **DDP hook.** The trainer wraps actor and critic in ``DistributedDataParallel`` itself and
  passes ``all_reduce`` (a SUM all-reduce of a float64 tensor, e.g.
  ``lambda t: (dist.all_reduce(t), t)[1]``) and ``world_size``. The counts
  ``[tokens, sequences, value tokens]`` are all-reduced, so the normalisers are global; DDP
  averages gradients (divides by world_size), hence each loss is multiplied by ``world_size``:
  the resulting gradient equals single-process training on the concatenated batch. The PPO-ptx
  term is a per-rank mean and is NOT scaled (DDP's average of per-rank means). The loss metrics
  returned are this rank's share (with global normalisers their sum over ranks is the global
  value); clip fractions and approx-KL are this rank's token means. In :func:`iteration` the same
  hook makes the advantage whitening of step 3 global (mean and variance all-reduced over every
  rank's rows, as verl), so a DDP iteration equals one process on the concatenated batch.
- **Dropout.** The current log-probs are recomputed in eval mode (``dropout_in_update=False``,
  as TRL), like the cached old log-probs, so the ratio of the first minibatch of the first epoch
  is 1 and clipfrac/approx-KL are 0 there. With ``dropout_in_update=True`` the models are in
  train mode during the update (old log-probs stay dropout-free).
- **Old policy.** No copy of the actor is kept: π_old enters only through the cached
  ``scored.old_logprobs`` (see spec/models.md; tests/unit/test_old_policy.py compares it with a
  deep-copied snapshot network at every epoch and minibatch).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from refppo.capture import StepRecorder
from refppo.conventions import AdvantageEstimator, KLPlacement
from refppo.core.kl import token_kl
from refppo.core.masked import AllReduce, masked_mean, masked_sum
from refppo.errors import HyperparameterError, ShapeError
from refppo.models import (
    Reward,
    SequenceBatch,
    eval_mode,
    position_ids_from_mask,
    response_logprobs,
    response_values,
)
from refppo.pipeline import (
    Convention,
    Hyperparams,
    Normalisers,
    RolloutQuantities,
    ScoreMap,
    UpdateQuantities,
    rollout_quantities,
    update_quantities,
)
from refppo.rollout import RolloutConfig, ScoredRollout, generate_rollout, score_rollout


@dataclass(frozen=True)
class PPOUpdateConfig:
    """How the cached rollout is consumed by the PPO epochs."""

    ppo_epochs: int = 4
    """K: passes over the rollout batch."""
    num_minibatches: int = 1
    """Optimizer steps per epoch; the batch size must be divisible by it."""
    micro_batch_size: int | None = None
    """Rows per forward/backward (gradient accumulation); None = the whole minibatch."""
    max_grad_norm: float | None = 1.0
    """Clip of the global gradient norm, per model (actor and critic separately); None = off."""
    ptx_coef: float = 0.0
    """γ_ptx of InstructGPT's PPO-ptx: weight of the LM loss on ``ptx_batch`` (0 = off)."""
    dropout_in_update: bool = False
    """False (default, TRL): update forwards in eval mode, same as the cached old log-probs."""
    shuffle: bool = True
    """Shuffle rows (with the ``generator``) at every epoch."""

    def __post_init__(self) -> None:
        if self.ppo_epochs < 1:
            raise HyperparameterError(f"ppo_epochs: expected >= 1, got {self.ppo_epochs}")
        if self.num_minibatches < 1:
            raise HyperparameterError(f"num_minibatches: expected >= 1, got {self.num_minibatches}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise HyperparameterError(f"micro_batch_size: expected >= 1, got {self.micro_batch_size}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise HyperparameterError(f"max_grad_norm: expected > 0 or None, got {self.max_grad_norm}")
        if not (math.isfinite(self.ptx_coef) and self.ptx_coef >= 0):
            raise HyperparameterError(f"ptx_coef: expected >= 0, got {self.ptx_coef}")


@dataclass(frozen=True)
class CaptureRequest:
    """Dump one optimizer step of :func:`ppo_update` as a v2 dump through ``recorder``
    (:class:`refppo.capture.StepRecorder`, ``reduce="mean"``: DDP averages) to ``path``."""

    epoch: int
    minibatch: int
    recorder: StepRecorder
    path: str

    def wants(self, epoch: int, minibatch: int) -> StepRecorder | None:
        return self.recorder if (epoch, minibatch) == (self.epoch, self.minibatch) else None


@dataclass(frozen=True)
class PtxBatch:
    """Pretraining/SFT token ids for the PPO-ptx term: ``[N, S]`` ids and attention mask."""

    input_ids: Tensor
    attention_mask: Tensor


@dataclass(frozen=True)
class MinibatchRecord:
    """Passed to ``on_minibatch`` after each optimizer step (all tensors detached)."""

    epoch: int
    index: int
    """Minibatch index within the epoch."""
    rows: Tensor
    """``[b]`` row indices of the minibatch in the rollout batch."""
    old_logprobs: Tensor
    """``[b, T]`` the cached π_old log-probs used for the ratio."""
    logprobs: Tensor
    """``[b, T]`` current log-probs before this step (as used in the loss)."""
    stats: dict[str, float] = field(default_factory=dict)
    """Minibatch scalars (losses, clip fractions, approx-KL, grad norms, max |ratio − 1|)."""


def ptx_loss(actor: nn.Module, ptx: PtxBatch) -> Tensor:
    """Token-mean next-token NLL of ``actor`` on ``ptx`` (InstructGPT's pretraining LM loss).

    Logits at position p predict token p+1; a pair counts when both positions are real tokens.
    """
    am = ptx.attention_mask.long()
    out = actor(input_ids=ptx.input_ids, attention_mask=am, position_ids=position_ids_from_mask(am))
    logits: Tensor = out.logits[:, :-1, :]
    labels = ptx.input_ids[:, 1:]
    valid = (am[:, :-1] * am[:, 1:]).bool()
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    n = valid.sum().clamp(min=1)
    return -(torch.where(valid, logp, torch.zeros_like(logp)).sum() / n)


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
) -> None:
    """Record micro-batch ``k`` (rows ``idx``); the losses as passed to backward (× world_size);
    a critic-free step (``values`` None) carries no value quantity (``old_values``, ``values``,
    ``grad_values``, ``vf_loss``: the oracle's critic-free dump) and its rows' ``group_index``."""
    more: dict[str, Tensor] = {"group_index": group_index[idx]} if group_index is not None else {}
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
) -> dict[str, float]:
    """K PPO epochs over shuffled minibatches of one scored rollout (module docstring, step 4).

    Returns the means over all minibatch steps of ``loss, pg_loss, vf_loss, entropy, kl_loss,
    ptx_loss, pg_clipfrac, approx_kl, vf_clipfrac, actor_grad_norm, critic_grad_norm`` (grad norms
    before clipping), plus ``first_ratio_max_dev``, ``first_pg_clipfrac`` and ``first_approx_kl``
    of the first minibatch of the first epoch. ``capture``: record one optimizer step (every
    micro-batch, as passed to backward) and write it as one v2 dump after its backward(s);
    ``group_index`` ``[B]`` is written with it (critic-free group estimators).
    ``critic=None`` (a critic-free ``conv.advantage``): no value forward and no value loss
    (``vf_loss``, ``vf_clipfrac`` and ``critic_grad_norm`` are 0); pass ``critic_optimizer=None``.
    """
    if world_size < 1:
        raise HyperparameterError(f"world_size: expected >= 1, got {world_size}")
    batch = scored.batch
    B = batch.batch_size
    mb_size = _splits(B, cfg.num_minibatches, "num_minibatches")
    micro = cfg.micro_batch_size or mb_size
    n_micro = _splits(mb_size, micro, "micro_batch_size") if micro <= mb_size else 1
    micro = min(micro, mb_size)
    mask = batch.response_mask
    vmask = quantities.value_mask
    advantages = quantities.advantages.to(scored.old_logprobs.dtype)
    returns = quantities.returns.to(scored.old_logprobs.dtype)
    actor_params = _params(actor)
    critic_params = _params(critic) if critic is not None else []
    models = (actor,) if critic is None else (actor, critic)
    optimizers = [actor_optimizer] + ([critic_optimizer] if critic_optimizer is not None else [])
    sums: dict[str, float] = {}
    first: dict[str, float] = {}
    n_steps = 0
    device = mask.device
    with eval_mode(*models):
        if cfg.dropout_in_update:
            for model in models:
                model.train()
        for epoch in range(cfg.ppo_epochs):
            perm = torch.randperm(B, generator=generator) if cfg.shuffle else torch.arange(B)
            perm = perm.to(device)
            for mb in range(cfg.num_minibatches):
                rows = perm[mb * mb_size : (mb + 1) * mb_size]
                counts = torch.tensor(
                    [float(mask[rows].sum()), float(mb_size), float(vmask[rows].sum())],
                    dtype=torch.float64,
                    device=device,
                )
                if all_reduce is not None:
                    counts = all_reduce(counts)
                norm = Normalisers(
                    token_count=float(counts[0]),
                    seq_count=float(counts[1]),
                    value_token_count=float(counts[2]),
                )
                for opt in optimizers:
                    opt.zero_grad(set_to_none=True)
                st = {k: 0.0 for k in ("loss", "pg_loss", "vf_loss", "entropy", "kl_loss", "ptx_loss")}
                n_tok_local = float(mask[rows].sum())
                n_vtok_local = float(vmask[rows].sum())
                clip_w = akl_w = vclip_w = 0.0
                ratio_dev = 0.0
                lp_parts: list[Tensor] = []
                rec = capture.wants(epoch, mb) if capture is not None else None
                for k in range(n_micro):
                    idx = rows[k * micro : (k + 1) * micro]
                    sub = batch.select(idx)
                    logp, ent = response_logprobs(actor, sub, scored.temperature)
                    values = response_values(critic, sub) if critic is not None else None
                    uq = update_quantities(
                        logprobs=logp,
                        values=values,
                        old_logprobs=scored.old_logprobs[idx],
                        old_values=scored.old_values[idx] if critic is not None else None,
                        advantages=advantages[idx],
                        returns=returns[idx],
                        mask=mask[idx],
                        value_mask_=vmask[idx],
                        ref_logprobs=scored.ref_logprobs[idx],
                        entropy=ent,
                        hp=hp,
                        conv=conv,
                        norm=norm,
                    )
                    if rec is not None:
                        _record(
                            rec, k, logp, values, ent, idx, scored, quantities, uq, world_size, group_index
                        )
                    torch.autograd.backward(uq.loss * world_size)
                    st["loss"] += float(uq.loss.detach())
                    st["pg_loss"] += float(uq.pg_loss.detach())
                    st["vf_loss"] += float(uq.vf_loss.detach())
                    st["entropy"] += float(uq.entropy_loss.detach())
                    st["kl_loss"] += float(uq.kl_loss.detach())
                    n_m = float(mask[idx].sum())
                    clip_w += float(uq.pg_clipfrac) * n_m
                    akl_w += float(uq.approx_kl) * n_m
                    vclip_w += float(uq.vf_clipfrac) * float(vmask[idx].sum())
                    dev = torch.where(mask[idx], (uq.ratio.detach() - 1.0).abs(), torch.zeros_like(logp))
                    ratio_dev = max(ratio_dev, float(dev.max()))
                    lp_parts.append(logp.detach())
                if ptx_batch is not None and cfg.ptx_coef > 0:
                    lm = ptx_loss(actor, ptx_batch)
                    torch.autograd.backward(cfg.ptx_coef * lm)
                    st["ptx_loss"] = float(lm.detach())
                    st["loss"] += cfg.ptx_coef * st["ptx_loss"]
                if rec is not None and capture is not None:
                    rec.write(capture.path)  # a collective: every rank reaches it
                st["pg_clipfrac"] = clip_w / n_tok_local
                st["approx_kl"] = akl_w / n_tok_local
                st["vf_clipfrac"] = vclip_w / n_vtok_local
                st["ratio_max_dev"] = ratio_dev
                st["actor_grad_norm"] = _grad_norm(actor_params, cfg.max_grad_norm)
                st["critic_grad_norm"] = _grad_norm(critic_params, cfg.max_grad_norm)
                for opt in optimizers:
                    opt.step()
                for opt in optimizers:
                    opt.zero_grad(set_to_none=True)
                if epoch == 0 and mb == 0:
                    first = {
                        "first_ratio_max_dev": ratio_dev,
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
                            old_logprobs=scored.old_logprobs[rows].detach(),
                            logprobs=torch.cat(lp_parts, dim=0),
                            stats=dict(st),
                        )
                    )
    metrics = {k: v / n_steps for k, v in sums.items() if k != "ratio_max_dev"}
    metrics.update(first)
    return metrics


def rollout_metrics(
    scored: ScoredRollout, quantities: RolloutQuantities, hp: Hyperparams, conv: Convention
) -> dict[str, float]:
    """Scalars of one rollout (formulas in spec/models.md):

    ``score`` mean of the scores entering the rewards (after the missing-EOS penalty);
    ``raw_score``; ``kl`` = mean over sequences of Σ_t KL_t(old‖ref) (``conv.kl_estimator``,
    whatever the KL placement); ``non_score_reward`` = mean_b Σ_t (r_t − score·[t = score slot]);
    ``response_length`` mean number of valid response tokens; ``eos_frac``; ``old_entropy``
    token mean; ``advantage_mean``, ``return_mean``, ``value_mean`` over valid tokens
    (``value_mean`` only with a critic, ``conv.advantage = gae``: a critic-free rollout has no values).
    """
    m = scored.batch.response_mask
    kl = token_kl(
        scored.old_logprobs.double(),
        scored.ref_logprobs.double(),
        m,
        conv.kl_estimator,
        log_ratio_clamp=conv.kl_log_ratio_clamp,
        value_clamp=conv.kl_value_clamp,
    )
    beta = hp.kl_coef if conv.kl_in is KLPlacement.REWARD else 0.0
    vm = quantities.value_mask
    out = {
        "score": float(scored.scores.double().mean()),
        "raw_score": float(scored.raw_scores.double().mean()),
        "kl": float(masked_sum(kl, m, dim=1).mean()),
        "non_score_reward": float(masked_sum(-beta * quantities.kl.double(), m, dim=1).mean()),
        "response_length": float(m.sum(dim=1).double().mean()),
        "eos_frac": float(scored.has_eos.double().mean()),
        "old_entropy": float(masked_mean(scored.old_entropy.double(), m)),
        "advantage_mean": float(masked_mean(quantities.advantages.double(), m)),
        "return_mean": float(masked_mean(quantities.returns.double(), vm)),
    }
    if conv.advantage is AdvantageEstimator.GAE:  # critic-free: the zeros stand in for no critic
        out["value_mean"] = float(masked_mean(scored.old_values.double(), vm))
    return out


@dataclass(frozen=True)
class IterationResult:
    """One PPO iteration: the metrics (rollout ∪ update) and the cached rollout tensors."""

    metrics: dict[str, float]
    scored: ScoredRollout
    quantities: RolloutQuantities


def iteration(
    actor: nn.Module,
    reference: nn.Module,
    critic: nn.Module | None,
    reward: Reward,
    actor_optimizer: torch.optim.Optimizer,
    critic_optimizer: torch.optim.Optimizer | None,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    *,
    rollout_cfg: RolloutConfig,
    update_cfg: PPOUpdateConfig,
    hp: Hyperparams,
    conv: Convention,
    generator: torch.Generator,
    world_size: int = 1,
    all_reduce: AllReduce | None = None,
    ptx_batch: PtxBatch | None = None,
    batch: SequenceBatch | None = None,
    on_minibatch: Callable[[MinibatchRecord], None] | None = None,
    capture: CaptureRequest | None = None,
    group_index: Tensor | None = None,
    groups_on_rank: bool = False,
    score_map: ScoreMap | None = None,
) -> IterationResult:
    """Rollout → scoring → rollout quantities → update (module docstring, steps 1–4).

    ``batch``: replay these responses instead of sampling (the prompts must be ``prompt_ids``);
    the generator is then not used for sampling. ``critic=None``: a critic-free
    ``conv.advantage`` (see :func:`ppo_update`). ``group_index`` ``[B]``: the prompt each row
    answers (group estimators); ``groups_on_rank``: the caller guarantees that every group's rows
    are on this rank (see :func:`refppo.pipeline.rollout_quantities`). ``score_map``: the
    pipeline's step 0 on the scores (None: as the reward gives them).
    """
    if batch is None:
        batch = generate_rollout(actor, prompt_ids, prompt_mask, rollout_cfg, generator)
    scored = score_rollout(
        actor,
        reference,
        critic,
        reward,
        batch,
        temperature=rollout_cfg.temperature,
        eos_token_id=rollout_cfg.eos_token_id,
        missing_eos_penalty=rollout_cfg.missing_eos_penalty,
    )
    quantities = rollout_quantities(
        scores=scored.scores,
        old_logprobs=scored.old_logprobs,
        ref_logprobs=scored.ref_logprobs,
        old_values=scored.old_values if critic is not None else None,  # no critic: no values
        mask=batch.response_mask,
        hp=hp,
        conv=conv,
        all_reduce=all_reduce,
        group_index=group_index,
        groups_on_rank=groups_on_rank,
        score_map=score_map,
    )
    metrics = rollout_metrics(scored, quantities, hp, conv)
    metrics.update(
        ppo_update(
            actor,
            critic,
            actor_optimizer,
            critic_optimizer,
            scored,
            quantities,
            hp=hp,
            conv=conv,
            cfg=update_cfg,
            generator=generator,
            world_size=world_size,
            all_reduce=all_reduce,
            ptx_batch=ptx_batch,
            on_minibatch=on_minibatch,
            capture=capture,
            group_index=group_index,
        )
    )
    return IterationResult(metrics, scored, quantities)


__all__ = [
    "AllReduce",
    "CaptureRequest",
    "IterationResult",
    "MinibatchRecord",
    "PPOUpdateConfig",
    "PtxBatch",
    "iteration",
    "ppo_update",
    "ptx_loss",
    "rollout_metrics",
]
