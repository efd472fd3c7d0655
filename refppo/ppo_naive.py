"""Naive twin of :mod:`refppo.ppo` and :mod:`refppo.rollout`'s scoring: step by step, no caching tricks.

- every model read-out is per sequence, per token, per prefix (:mod:`refppo.models.naive`);
- π_old is a REAL snapshot network (a deep copy of the actor taken before the update) whose
  log-probs are recomputed at every minibatch instead of being cached;
- rollout quantities come from the naive twins of the core (``refppo.core.*_naive``);
- the PPO loss is built token by token from 0-dim tensors with Python loops and aggregated by
  explicit per-mode sums (no micro-batching, no normalisers: the whole minibatch at once).

Supported subset (what the goldens exercise): ``dual_clip``, ``log_ratio_clamp`` and the KL
clamps must be None, ``dropout_in_update`` False and no PPO-ptx; critic-free: ``critic=None`` with
every critic-free ``advantage`` but ``reinforce++``, and ``group_kl=fold``; anything else raises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from refppo.conventions import (
    AdvantageEstimator,
    GaePadding,
    GroupKL,
    KLEstimator,
    KLPlacement,
    LossAgg,
    PolicyLoss,
    ScorePosition,
    ValueClipForm,
    ValueLoss,
    Variance,
    WhitenHoles,
    Whitening,
)
from refppo.core.gae import gae_naive
from refppo.core.group import GROUP_ESTIMATORS, group_advantages_naive
from refppo.core.kl import token_kl_naive
from refppo.core.normalize import normalize_naive
from refppo.core.rewards import token_rewards_naive
from refppo.core.score_map import map_scores_naive
from refppo.errors import ConventionError
from refppo.models import Reward, RewardModel, SequenceBatch, eval_mode, make_reference
from refppo.models.naive import (
    prefix_logits,
    prefix_value,
    response_logprobs_naive,
    response_values_naive,
    reward_scores_naive,
)
from refppo.pipeline import Convention, Hyperparams, RolloutQuantities, ScoreMap
from refppo.ppo import PPOUpdateConfig
from refppo.rollout import ScoredRollout


def score_rollout_naive(
    actor: nn.Module,
    reference: nn.Module,
    critic: nn.Module | None,
    reward: Reward,
    batch: SequenceBatch,
    *,
    temperature: float = 1.0,
    eos_token_id: int,
    missing_eos_penalty: float | None = None,
) -> ScoredRollout:
    """Naive twin of :func:`refppo.rollout.score_rollout` (per-prefix forwards, Python loops);
    ``critic=None``: zero values, as there."""
    with torch.no_grad(), eval_mode(actor, reference, *([critic] if critic is not None else [])):
        old, ent = response_logprobs_naive(actor, batch, temperature)
        ref, _ = response_logprobs_naive(reference, batch, temperature)
        values = torch.zeros_like(old) if critic is None else response_values_naive(critic, batch)
        if isinstance(reward, RewardModel):
            with eval_mode(reward):
                raw = reward_scores_naive(reward, batch)
        else:
            raw = torch.tensor([float(reward(*batch.unpadded(b))) for b in range(batch.batch_size)])
    eos_list = [eos_token_id in batch.unpadded(b)[1] for b in range(batch.batch_size)]
    scores = [
        float(raw[b]) - (missing_eos_penalty if (missing_eos_penalty is not None and not e) else 0.0)
        for b, e in enumerate(eos_list)
    ]
    return ScoredRollout(
        batch,
        old,
        ref,
        values,
        ent,
        raw.to(torch.float32),
        torch.tensor(scores, dtype=torch.float32),
        torch.tensor(eos_list, dtype=torch.bool),
        temperature,
    )


def value_mask_naive(mask: Tensor, score_at: ScorePosition) -> Tensor:
    """Naive twin of :func:`refppo.pipeline.value_mask`: the mask plus the score slot, row by row."""
    rows = (mask != 0).tolist()
    out = []
    for row in rows:
        T = len(row)
        L = 1 + max(t for t, ok in enumerate(row) if ok)  # the last valid token + 1 (holes allowed)
        if score_at is ScorePosition.LAST_VALID:
            slot = L - 1
        elif score_at is ScorePosition.AFTER_LAST_VALID:
            slot = min(L, T - 1)
        else:
            slot = T - 1
        out.append([ok or t == slot for t, ok in enumerate(row)])
    return torch.tensor(out, dtype=torch.bool)


def rollout_quantities_naive(
    *,
    scores: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor,
    old_values: Tensor,
    mask: Tensor,
    hp: Hyperparams,
    conv: Convention,
    group_index: Tensor | None = None,
    score_map: ScoreMap | None = None,
) -> RolloutQuantities:
    """Naive twin of :func:`refppo.pipeline.rollout_quantities` from the ``*_naive`` core twins
    (critic-free: the group score of row i is Σ_t r_{i,t} over the value mask, as ``group_kl=fold``;
    ``score_map``: step 0 by :func:`refppo.core.score_map.map_scores_naive`)."""
    if score_map is not None:
        mapped = map_scores_naive(scores, bias=score_map.bias, scale=score_map.scale, clip=score_map.clip)
        scores = torch.tensor(mapped, dtype=scores.dtype, device=scores.device)
    kl = token_kl_naive(
        old_logprobs,
        ref_logprobs,
        mask,
        conv.kl_estimator,
        log_ratio_clamp=conv.kl_log_ratio_clamp,
        value_clamp=conv.kl_value_clamp,
    )
    beta = hp.kl_coef if conv.kl_in is KLPlacement.REWARD else 0.0
    rewards = token_rewards_naive(scores, kl if beta > 0 else None, mask, beta, score_at=conv.score_at)
    vmask = value_mask_naive(mask, conv.score_at)
    unbiased = conv.whiten_variance is Variance.UNBIASED
    if conv.whiten_rewards is not Whitening.NONE:
        rewards = normalize_naive(
            rewards,
            vmask,
            conv.whiten_rewards,
            unbiased=unbiased,
            eps=hp.whiten_eps,
            eps_at=conv.whiten_eps_at,
        )
    if conv.advantage is AdvantageEstimator.GAE:
        gae_mask = vmask if conv.gae_padding is GaePadding.MASKED else torch.ones_like(vmask)
        adv_raw, returns = gae_naive(
            rewards, old_values, gae_mask, gamma=hp.gamma, lam=hp.lam, holes=conv.gae_holes
        )
    else:
        adv_raw = returns = _group_naive(rewards, vmask, mask, conv, group_index)
    wmask = mask
    if conv.whiten_holes is WhitenHoles.INCLUDE:  # each row up to its last valid token, holes included
        rows = mask.bool().tolist()
        wmask = torch.tensor([[any(row[t:]) for t in range(len(row))] for row in rows], dtype=torch.bool)
    adv = normalize_naive(
        adv_raw,
        wmask,
        conv.whiten_advantages,
        unbiased=unbiased,
        eps=hp.whiten_eps,
        eps_at=conv.whiten_eps_at,
    )
    if conv.kl_in is KLPlacement.LOSS:
        kl = torch.zeros_like(kl)
    return RolloutQuantities(kl, rewards, adv_raw, adv, returns, vmask)


def _group_naive(
    rewards: Tensor, vmask: Tensor, mask: Tensor, conv: Convention, group_index: Tensor | None
) -> Tensor:
    """Every critic-free estimator but ``reinforce++``: the core's naive group twin on the folded scores.

    ``reinforce++-baseline`` is ``s − μ_G`` here (its whitening is step 4's, as in the pipeline);
    ``flash-reinforce`` needs no ``group_index``.
    """
    est = conv.advantage
    supported = (*GROUP_ESTIMATORS, AdvantageEstimator.FLASH_REINFORCE)
    needs_groups = est is not AdvantageEstimator.FLASH_REINFORCE
    if est not in supported or conv.group_kl is not GroupKL.FOLD or (needs_groups and group_index is None):
        raise ConventionError(
            "rollout_quantities_naive: critic-free supports the group estimators (with a group_index) "
            "and flash-reinforce, with group_kl=fold"
        )
    if est is AdvantageEstimator.REINFORCE_PP_BASELINE:
        est = AdvantageEstimator.DR_GRPO  # the same s − μ_G; the naive core twin would whiten it too
    rows, vm = rewards.tolist(), vmask.tolist()
    folded = [sum(r for r, ok in zip(row, m, strict=True) if ok) for row, m in zip(rows, vm, strict=True)]
    return group_advantages_naive(
        torch.tensor(folded, dtype=rewards.dtype),
        group_index,
        mask,
        estimator=est,
        unbiased_std=conv.group_std is Variance.UNBIASED,
        std_level=conv.group_std_level,
        eps=conv.group_eps,
        singleton=conv.group_singleton.value,
    )


@dataclass(frozen=True)
class NaiveStep:
    """One minibatch step of the naive update."""

    epoch: int
    index: int
    rows: list[int]
    snapshot_logprobs: Tensor
    """``[b, T]`` π_old log-probs recomputed from the snapshot network at this step."""
    stats: dict[str, float]


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
    """Naive twin of :func:`refppo.ppo.ppo_update` with the row permutation of each epoch given.

    A deep-copied snapshot of the actor is taken first and is the ONLY source of π_old.
    ``critic=None``: no value term (``vf_loss``, ``vf_clipfrac``, ``critic_grad_norm`` are 0).
    """
    if conv.dual_clip is not None or conv.log_ratio_clamp is not None:
        raise ConventionError("ppo_update_naive: dual_clip and log_ratio_clamp are not supported")
    if conv.policy_loss is not PolicyLoss.VANILLA:
        raise ConventionError(f"ppo_update_naive: policy_loss={conv.policy_loss} is not supported")
    if conv.kl_log_ratio_clamp is not None or conv.kl_value_clamp is not None:
        raise ConventionError("ppo_update_naive: KL clamps are not supported")
    if cfg.dropout_in_update:
        raise ConventionError("ppo_update_naive: dropout_in_update is not supported")
    if len(perms) != cfg.ppo_epochs:
        raise ValueError(f"perms: expected {cfg.ppo_epochs} permutations, got {len(perms)}")
    snapshot = make_reference(actor)
    batch = scored.batch
    device = batch.prompt_ids.device
    tau = scored.temperature
    mb_size = batch.batch_size // cfg.num_minibatches
    eps_lo = hp.cliprange
    eps_hi = hp.cliprange_high if hp.cliprange_high is not None else hp.cliprange
    horizon = hp.horizon if hp.horizon is not None else float(batch.response_width)
    adv = quantities.advantages.tolist()
    ret = quantities.returns.tolist()
    vold = scored.old_values.tolist()
    vmask = quantities.value_mask.tolist()
    optimizers = [actor_optimizer] + ([critic_optimizer] if critic_optimizer is not None else [])
    steps: list[NaiveStep] = []
    with eval_mode(actor, *([critic] if critic is not None else [])):
        for epoch, perm in enumerate(perms):
            for mb in range(cfg.num_minibatches):
                rows = [int(r) for r in perm[mb * mb_size : (mb + 1) * mb_size]]
                for opt in optimizers:
                    opt.zero_grad(set_to_none=True)
                pol: list[list[Tensor]] = []
                ents: list[list[Tensor]] = []
                kls: list[list[Tensor]] = []
                vals: list[list[Tensor]] = []
                snap = torch.zeros(len(rows), batch.response_width)
                n_clip = n_vclip = 0
                kl_sum = 0.0
                for i, b in enumerate(rows):
                    x, y = batch.unpadded(b)
                    prow: list[Tensor] = []
                    erow: list[Tensor] = []
                    krow: list[Tensor] = []
                    for t in range(len(y)):
                        z = prefix_logits(actor, x + y[:t], device) / tau
                        logz = torch.log_softmax(z, dim=-1)
                        lp = logz[y[t]]
                        with torch.no_grad():
                            old = float(
                                torch.log_softmax(prefix_logits(snapshot, x + y[:t], device) / tau, -1)[y[t]]
                            )
                        snap[i, t] = old
                        ratio = torch.exp(lp - old)
                        a = adv[b][t]
                        l1 = -a * ratio
                        l2 = -a * torch.clamp(ratio, 1.0 - eps_lo, 1.0 + eps_hi)
                        if float(l2.detach()) > float(l1.detach()):
                            n_clip += 1
                        kl_sum += old - float(lp.detach())
                        prow.append(torch.maximum(l1, l2))
                        erow.append(-(torch.exp(logz) * logz).sum())
                        if conv.kl_in is KLPlacement.LOSS:
                            krow.append(_kl_scalar(lp - float(scored.ref_logprobs[b, t]), conv.kl_estimator))
                    vrow: list[Tensor] = []
                    for t in range(batch.response_width):
                        if critic is None or not vmask[b][t]:
                            continue
                        v = prefix_value(critic, x + y[:t], device)
                        r = ret[b][t]
                        unclipped = (v - r) ** 2
                        if conv.value_loss is ValueLoss.CLIPPED:
                            eps_v = hp.cliprange_value
                            if conv.value_clip_form is ValueClipForm.DELTA:
                                vc = vold[b][t] + torch.clamp(v - vold[b][t], -eps_v, eps_v)
                            else:
                                vc = torch.clamp(v, vold[b][t] - eps_v, vold[b][t] + eps_v)
                            clipped = (vc - r) ** 2
                            if float(clipped.detach()) > float(unclipped.detach()):
                                n_vclip += 1
                            vrow.append(0.5 * torch.maximum(unclipped, clipped))
                        else:
                            vrow.append(0.5 * unclipped)
                    pol.append(prow)
                    ents.append(erow)
                    kls.append(krow)
                    vals.append(vrow)
                pg_loss, n_tok = _aggregate(pol, conv.loss_agg, horizon, len(rows))
                vf_agg = conv.value_loss_agg if conv.value_loss_agg is not None else conv.loss_agg
                vf_loss, n_vtok = (
                    _aggregate(vals, vf_agg, horizon, len(rows))
                    if critic is not None
                    else (torch.zeros(()), 1)
                )
                ent_agg = conv.entropy_agg if conv.entropy_agg is not None else conv.loss_agg
                ent_loss, _ = _aggregate(ents, ent_agg, horizon, len(rows))
                loss = pg_loss + hp.vf_coef * vf_loss - hp.ent_coef * ent_loss
                kl_loss = torch.zeros(())
                if conv.kl_in is KLPlacement.LOSS:
                    kl_agg = conv.kl_loss_agg if conv.kl_loss_agg is not None else conv.loss_agg
                    kl_loss, _ = _aggregate(kls, kl_agg, horizon, len(rows))
                    loss = loss + hp.kl_coef * kl_loss
                torch.autograd.backward(loss)
                gn_a = _clip(actor, cfg.max_grad_norm)
                gn_c = _clip(critic, cfg.max_grad_norm) if critic is not None else 0.0
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
                    "pg_clipfrac": n_clip / n_tok,
                    "approx_kl": kl_sum / n_tok,
                    "vf_clipfrac": n_vclip / n_vtok,
                    "actor_grad_norm": gn_a,
                    "critic_grad_norm": gn_c,
                }
                steps.append(NaiveStep(epoch, mb, rows, snap, stats))
    return steps


def _clip(model: nn.Module, max_norm: float | None) -> float:
    """Global grad norm of ``model`` (before clipping), clipped in place to ``max_norm``."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    if max_norm is not None and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for g in grads:
            g.mul_(scale)
    return total


__all__ = [
    "NaiveStep",
    "ppo_update_naive",
    "rollout_quantities_naive",
    "score_rollout_naive",
    "value_mask_naive",
]
