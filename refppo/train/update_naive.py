"""Naive twin of :func:`refppo.train.update.ppo_update`: token by token, a real π_old snapshot network.

π_old is a deep copy of the actor taken before the update; its log-probs are recomputed at every
minibatch instead of being cached. Each row's per-token losses are 0-dim tensors built in Python
loops (:func:`_policy_row`, :func:`_value_row`) and aggregated by explicit per-mode sums
(:func:`_aggregate`): no micro-batching, no normalisers, the whole minibatch at once::

    ρ_t = exp(l_t − l^old_t)       ℓ^pg_t = max(−A_t ρ_t, −A_t clip(ρ_t, 1−ε_low, 1+ε_high))
    ℓ^vf_t = ½ max((V_t − R_t)², (V^clip_t − R_t)²)   (or ½ (V_t − R_t)² unclipped)
    H_t = −Σ_v π(v) log π(v)       ℓ^kl_t = k(l_t − l^ref_t)   (kl_in = loss)
    J = agg(ℓ^pg) + c_vf·agg_vf(ℓ^vf) − c_ent·agg_ent(H) + β·agg_kl(ℓ^kl)

Re-exported by :mod:`refppo.pipeline.naive` (the import path of every caller).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from refppo.conventions import KLEstimator, KLPlacement, LossAgg, PolicyLoss, ValueClipForm, ValueLoss
from refppo.errors import ConventionError
from refppo.models.batch import SequenceBatch
from refppo.models.naive import prefix_logits, prefix_value
from refppo.models.roles import eval_mode, make_reference
from refppo.models.rollout import ScoredRollout
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import RolloutQuantities
from refppo.train.update_config import PPOUpdateConfig


@dataclass(frozen=True)
class NaiveStep:
    """One minibatch step of the naive update."""

    epoch: int
    index: int
    rows: list[int]
    snapshot_logprobs: Tensor
    """``[b, T]`` π_old log-probs recomputed from the snapshot network at this step."""
    stats: dict[str, float]


@dataclass(frozen=True)
class _Setup:
    """What every minibatch of one naive update reads (taken once, before the first step)."""

    actor: nn.Module
    critic: nn.Module | None
    snapshot: nn.Module
    batch: SequenceBatch
    device: torch.device
    tau: float
    eps_lo: float
    eps_hi: float
    horizon: float
    adv: list[list[float]]
    ret: list[list[float]]
    vold: list[list[float]]
    vmask: list[list[bool]]
    ref_logprobs: Tensor
    hp: Hyperparams
    conv: Convention


@dataclass
class _Counts:
    """A minibatch's running counts, added to token by token in row order."""

    n_clip: int = 0
    n_vclip: int = 0
    kl_sum: float = 0.0


def _aggregate(per_seq: list[list[Tensor]], agg: LossAgg, horizon: float, n_seq: int) -> tuple[Tensor, int]:
    """Aggregate per-sequence lists of 0-dim losses (one entry per valid token) by ``agg``."""
    total = torch.zeros(())
    n_tok = sum(len(s) for s in per_seq)
    if agg in (LossAgg.SEQ_MEAN_TOKEN_MEAN, LossAgg.SEQ_MEAN_TOKEN_SUM_NORM):
        # a mean over sequences of each row's token mean, or of its token sum over the horizon H
        for s in per_seq:
            seq_sum = torch.zeros(())
            for x in s:
                seq_sum = seq_sum + x
            total = total + seq_sum / (len(s) if agg is LossAgg.SEQ_MEAN_TOKEN_MEAN else horizon)
        return total / n_seq, n_tok
    for s in per_seq:
        for x in s:
            total = total + x
    if agg is LossAgg.TOKEN_SUM:
        return total, n_tok
    if agg is LossAgg.TOKEN_MEAN:
        return total / n_tok, n_tok
    if agg is LossAgg.SEQ_MEAN_TOKEN_SUM:
        return total / n_seq, n_tok
    raise ConventionError(f"ppo_update_naive: unknown loss_agg {agg!r}")


def _kl_scalar(d: Tensor, est: KLEstimator) -> Tensor:
    if est.straight_through:  # the base value, the gradient of ½ d² (verl "k3+")
        half_sq = 0.5 * d * d
        return half_sq - half_sq.detach() + _kl_scalar(d, est.base).detach()
    if est is KLEstimator.K1:
        return d
    if est is KLEstimator.K2:
        return 0.5 * d * d
    if est is KLEstimator.K3:
        return torch.exp(-d) - 1.0 + d
    return d.abs()


def _check_supported(conv: Convention, cfg: PPOUpdateConfig, perms: list[Tensor]) -> None:
    """The naive update's subset (:mod:`refppo.pipeline.naive`); anything else raises."""
    if conv.policy.dual_clip is not None or conv.policy.log_ratio_clamp is not None:
        raise ConventionError("ppo_update_naive: dual_clip and log_ratio_clamp are not supported")
    if conv.policy.loss is not PolicyLoss.VANILLA:
        raise ConventionError(f"ppo_update_naive: policy_loss={conv.policy.loss} is not supported")
    if conv.kl.log_ratio_clamp is not None or conv.kl.value_clamp is not None:
        raise ConventionError("ppo_update_naive: KL clamps are not supported")
    if cfg.dropout_in_update:
        raise ConventionError("ppo_update_naive: dropout_in_update is not supported")
    if len(perms) != cfg.ppo_epochs:
        raise ValueError(f"perms: expected {cfg.ppo_epochs} permutations, got {len(perms)}")


def ppo_update_naive(
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
    perms: list[Tensor],
) -> list[NaiveStep]:
    """Naive twin of :func:`refppo.train.update.ppo_update` with the row permutation of each epoch given.

    A deep-copied snapshot of the actor is taken first and is the ONLY source of π_old.
    ``critic=None``: no value term (``vf_loss``, ``vf_clipfrac``, ``critic_grad_norm`` are 0).
    """
    _check_supported(conv, cfg, perms)
    batch = scored.batch
    su = _Setup(
        actor=actor,
        critic=critic,
        snapshot=make_reference(actor),
        batch=batch,
        device=batch.prompt_ids.device,
        tau=scored.temperature,
        eps_lo=hp.cliprange,
        eps_hi=hp.cliprange_high if hp.cliprange_high is not None else hp.cliprange,
        horizon=hp.horizon if hp.horizon is not None else float(batch.response_width),
        adv=quantities.advantages.tolist(),
        ret=quantities.returns.tolist(),
        vold=scored.old_values.tolist(),
        vmask=quantities.value_mask.tolist(),
        ref_logprobs=scored.ref_logprobs,
        hp=hp,
        conv=conv,
    )
    mb_size = batch.batch_size // cfg.num_minibatches
    optimizers = [actor_optimizer] + ([critic_optimizer] if critic_optimizer is not None else [])
    steps: list[NaiveStep] = []
    with eval_mode(actor, *([critic] if critic is not None else [])):
        for epoch, perm in enumerate(perms):
            for mb in range(cfg.num_minibatches):
                rows = [int(r) for r in perm[mb * mb_size : (mb + 1) * mb_size]]
                snap, stats = _minibatch(su, rows, optimizers, cfg.max_grad_norm)
                steps.append(NaiveStep(epoch, mb, rows, snap, stats))
    return steps


def _minibatch(
    su: _Setup, rows: list[int], optimizers: list[torch.optim.Optimizer], max_grad_norm: float | None
) -> tuple[Tensor, dict[str, float]]:
    """One optimizer step on ``rows``: ``(snapshot log-probs [b, T], the step's stats)``."""
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    batch, hp, conv = su.batch, su.hp, su.conv
    pol: list[list[Tensor]] = []
    ents: list[list[Tensor]] = []
    kls: list[list[Tensor]] = []
    vals: list[list[Tensor]] = []
    snap = torch.zeros(len(rows), batch.response_width)
    counts = _Counts()
    for i, b in enumerate(rows):
        x, y = batch.unpadded(b)
        prow, erow, krow = _policy_row(su, b, x, y, snap[i], counts)
        vrow = _value_row(su, b, x, y, counts)
        pol.append(prow)
        ents.append(erow)
        kls.append(krow)
        vals.append(vrow)
    pg_loss, n_tok = _aggregate(pol, conv.agg.loss, su.horizon, len(rows))
    vf_agg = conv.agg.value if conv.agg.value is not None else conv.agg.loss
    vf_loss, n_vtok = (
        _aggregate(vals, vf_agg, su.horizon, len(rows)) if su.critic is not None else (torch.zeros(()), 1)
    )
    ent_agg = conv.agg.entropy if conv.agg.entropy is not None else conv.agg.loss
    ent_loss, _ = _aggregate(ents, ent_agg, su.horizon, len(rows))
    loss = pg_loss + hp.vf_coef * vf_loss - hp.ent_coef * ent_loss
    kl_loss = torch.zeros(())
    if conv.kl.placement is KLPlacement.LOSS:
        kl_agg = conv.agg.kl if conv.agg.kl is not None else conv.agg.loss
        kl_loss, _ = _aggregate(kls, kl_agg, su.horizon, len(rows))
        loss = loss + hp.kl_coef * kl_loss
    torch.autograd.backward(loss)
    gn_a = _clip(su.actor, max_grad_norm)
    gn_c = _clip(su.critic, max_grad_norm) if su.critic is not None else 0.0
    for opt in optimizers:
        opt.step()
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    stats = {
        "loss": float(loss.detach()),
        "pg_loss": float(pg_loss.detach()),
        "vf_loss": float(vf_loss.detach()),
        "entropy": float(ent_loss.detach()),
        "kl_loss": float(kl_loss.detach()),
        "pg_clipfrac": counts.n_clip / n_tok,
        "approx_kl": counts.kl_sum / n_tok,
        "vf_clipfrac": counts.n_vclip / n_vtok,
        "actor_grad_norm": gn_a,
        "critic_grad_norm": gn_c,
    }
    return snap, stats


def _policy_row(
    su: _Setup, b: int, x: list[int], y: list[int], snap_row: Tensor, counts: _Counts
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Row ``b``'s per-token ``(ℓ^pg, H, ℓ^kl)`` (module docstring), one prefix forward each; writes
    π_old's log-probs into ``snap_row`` and counts the clipped tokens and ``Σ (l^old − l)``."""
    prow: list[Tensor] = []
    erow: list[Tensor] = []
    krow: list[Tensor] = []
    for t in range(len(y)):
        z = prefix_logits(su.actor, x + y[:t], su.device) / su.tau
        logz = torch.log_softmax(z, dim=-1)
        lp = logz[y[t]]
        with torch.no_grad():
            old = float(
                torch.log_softmax(prefix_logits(su.snapshot, x + y[:t], su.device) / su.tau, -1)[y[t]]
            )
        snap_row[t] = old
        ratio = torch.exp(lp - old)
        a = su.adv[b][t]
        l1 = -a * ratio
        l2 = -a * torch.clamp(ratio, 1.0 - su.eps_lo, 1.0 + su.eps_hi)
        if float(l2.detach()) > float(l1.detach()):
            counts.n_clip += 1
        counts.kl_sum += old - float(lp.detach())
        prow.append(torch.maximum(l1, l2))
        erow.append(-(torch.exp(logz) * logz).sum())
        if su.conv.kl.placement is KLPlacement.LOSS:
            krow.append(_kl_scalar(lp - float(su.ref_logprobs[b, t]), su.conv.kl.estimator))
    return prow, erow, krow


def _value_row(su: _Setup, b: int, x: list[int], y: list[int], counts: _Counts) -> list[Tensor]:
    """Row ``b``'s per-token ``ℓ^vf`` over its value mask (empty without a critic); counts the
    clipped tokens."""
    vrow: list[Tensor] = []
    for t in range(su.batch.response_width):
        if su.critic is None or not su.vmask[b][t]:
            continue
        v = prefix_value(su.critic, x + y[:t], su.device)
        r = su.ret[b][t]
        unclipped = (v - r) ** 2
        if su.conv.value.loss is ValueLoss.CLIPPED:
            eps_v, v_old = su.hp.cliprange_value, su.vold[b][t]
            if su.conv.value.clip_form is ValueClipForm.DELTA:
                vc = v_old + torch.clamp(v - v_old, -eps_v, eps_v)
            else:
                vc = torch.clamp(v, v_old - eps_v, v_old + eps_v)
            clipped = (vc - r) ** 2
            if float(clipped.detach()) > float(unclipped.detach()):
                counts.n_vclip += 1
            vrow.append(0.5 * torch.maximum(unclipped, clipped))
        else:
            vrow.append(0.5 * unclipped)
    return vrow


def _clip(model: nn.Module, max_norm: float | None) -> float:
    """Global grad norm of ``model`` (before clipping), clipped in place to ``max_norm``."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    if max_norm is not None and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for g in grads:
            g.mul_(scale)
    return total


__all__ = ["NaiveStep", "ppo_update_naive"]
