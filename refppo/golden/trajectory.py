"""Running a golden case: the tiny models and optimizers, parameter checksums, the trajectory.

Batched path: sample through :func:`refppo.train.seam.sample` (the policy itself, or for a case with
``seam`` the trainer's :class:`refppo.train.seam.RolloutEngine`) and update through
:func:`refppo.train.iteration.iteration` (the trainer's path).
Naive path: replay a golden's tokens (and the engine's log-probs) and epoch permutations through the
per-prefix read-outs, the core's naive twins and :func:`refppo.train.update_naive.ppo_update_naive`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from refppo.golden.cases import COMPARED_METRICS, GoldenCase
from refppo.models.batch import SequenceBatch, left_pad
from refppo.models.roles import Critic, RewardModel, make_reference
from refppo.models.rollout import ScoredRollout
from refppo.models.rollout_naive import score_rollout_naive
from refppo.models.tiny import tiny_actor, tiny_critic, tiny_reward_model
from refppo.pipeline.step import RolloutQuantities, rollout_quantities_naive
from refppo.train.iteration import iteration, rollout_metrics
from refppo.train.seam import RolloutEngine, sample, seam_metrics
from refppo.train.update_config import Behaviour, MinibatchRecord
from refppo.train.update_naive import ppo_update_naive


@dataclass
class Models:
    actor: nn.Module
    reference: nn.Module
    critic: Critic | None
    reward: RewardModel
    actor_opt: torch.optim.Optimizer
    critic_opt: torch.optim.Optimizer | None


def build(case: GoldenCase, device: torch.device | str = "cpu") -> Models:
    """Models (seeded random init) and optimizers of ``case`` on ``device``."""
    kw: dict[str, Any] = {"hidden": case.hidden, "layers": case.layers, "heads": case.heads}
    actor = tiny_actor(case.arch, case.vocab_size, seed=0, dropout=case.dropout, **kw).to(device)
    critic = None
    if not case.critic_free:
        critic = tiny_critic(case.arch, case.vocab_size, seed=1, dropout=case.dropout, **kw).to(device)
    reward = tiny_reward_model(case.arch, case.vocab_size, seed=2, **kw).to(device)
    reference = make_reference(actor)
    ao = torch.optim.Adam(actor.parameters(), lr=case.lr)
    co = torch.optim.Adam(critic.parameters(), lr=case.lr) if critic is not None else None
    return Models(actor, reference, critic, reward, ao, co)


def checksums(models: Models) -> dict[str, list[float]]:
    """``[Σp, Σp², Σ|p|]`` (float64) of every actor and critic (if any) parameter tensor."""
    out: dict[str, list[float]] = {}
    trained = [("actor", models.actor)] + ([("critic", models.critic)] if models.critic is not None else [])
    for prefix, model in trained:
        for name, p in model.named_parameters():
            d = p.detach().double().cpu()
            out[f"{prefix}.{name}"] = [float(d.sum()), float((d * d).sum()), float(d.abs().sum())]
    return out


@dataclass
class Trajectory:
    """What a run produces: tensors (``it{i}.<field>``) and the JSON-able record."""

    tensors: dict[str, Tensor]
    record: dict[str, Any]


def run(
    case: GoldenCase,
    *,
    device: torch.device | str = "cpu",
    naive_from: Trajectory | None = None,
) -> Trajectory:
    """Run ``case`` for ``case.iterations`` PPO iterations.

    Batched path (default): sample with the seeded generator (by the policy, or by the seam mode's
    engine when ``case.seam``), :func:`refppo.train.iteration.iteration`.
    Naive path (``naive_from`` = a golden): replay its sampled tokens, the engine's log-probs and
    epoch permutations; score with per-prefix forwards, rollout quantities from the core's naive
    twins, update with :func:`refppo.train.update_naive.ppo_update_naive` (a real snapshot network
    for π_old, the ``rollout_correction`` stage's naive twin).
    """
    models = build(case, device)
    engine = RolloutEngine(case.seam, models.actor) if case.seam is not None else None
    rows, group_index = case.rows()
    gi = group_index.to(device) if case.critic_free else None
    prompt_ids, prompt_mask = left_pad(rows, case.rollout.pad_token_id)
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    gen = torch.Generator().manual_seed(case.seed)
    tensors: dict[str, Tensor] = {}
    iters: list[dict[str, Any]] = []
    record: dict[str, Any] = {"init_checksums": checksums(models)}
    for it in range(case.iterations):
        if naive_from is None:
            done = _batched_iteration(case, models, engine, prompt_ids, prompt_mask, gi, gen, it)
        else:
            done = _naive_iteration(case, models, naive_from.tensors, it, device, gi)
        for k, v in _iteration_tensors(done).items():
            tensors[f"it{it}.{k}"] = v.detach().cpu().clone().contiguous()
        iters.append(
            {
                "metrics": {k: float(done.metrics[k]) for k in sorted(done.metrics)},
                "steps": done.steps,
                "checksums": checksums(models),
            }
        )
    record["iterations"] = iters
    return Trajectory(tensors, record)


@dataclass
class _Iteration:
    """One iteration's outputs: the scored rollout, its quantities, the metrics, the epochs' row
    order ``perm [epochs, B]`` and the per-minibatch compared scalars."""

    scored: ScoredRollout
    q: RolloutQuantities
    metrics: dict[str, float]
    perm: Tensor
    steps: list[dict[str, Any]]
    behaviour: Behaviour | None = None


def _batched_iteration(
    case: GoldenCase,
    models: Models,
    engine: RolloutEngine | None,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    gi: Tensor | None,
    gen: torch.Generator,
    it: int,
) -> _Iteration:
    """Sample (the trainer's :func:`refppo.train.seam.sample`) and update through
    :func:`refppo.train.iteration.iteration`; ``perm`` from the minibatch records."""
    recs: list[MinibatchRecord] = []
    batch, behaviour = sample(engine, models.actor, prompt_ids, prompt_mask, case.rollout, gen, it)
    res = iteration(
        models.actor,
        models.reference,
        models.critic,
        models.reward,
        models.actor_opt,
        models.critic_opt,
        prompt_ids,
        prompt_mask,
        rollout_cfg=case.rollout,
        update_cfg=case.update,
        hp=case.hp,
        conv=case.conv,
        generator=gen,
        on_minibatch=recs.append,
        group_index=gi,
        batch=batch,
        behaviour=behaviour,
    )
    scored, q, metrics = res.scored, res.quantities, res.metrics
    perm = torch.stack(
        [torch.cat([r.rows for r in recs if r.epoch == e]) for e in range(case.update.ppo_epochs)]
    )
    steps = [{k: r.stats[k] for k in COMPARED_METRICS if k in r.stats} for r in recs]
    return _Iteration(scored, q, metrics, perm, steps, behaviour)


def _naive_iteration(
    case: GoldenCase,
    models: Models,
    g: dict[str, Tensor],
    it: int,
    device: torch.device | str,
    gi: Tensor | None,
) -> _Iteration:
    """Replay iteration ``it`` of the golden tensors ``g`` through the naive twins."""
    batch = SequenceBatch(
        g[f"it{it}.prompt_ids"].to(device),
        g[f"it{it}.prompt_mask"].to(device),
        g[f"it{it}.response_ids"].to(device),
        g[f"it{it}.response_mask"].to(device),
    )
    scored = score_rollout_naive(
        models.actor,
        models.reference,
        models.critic,
        models.reward,
        batch,
        temperature=case.rollout.temperature,
        eos_token_id=case.rollout.eos_token_id,
        missing_eos_penalty=case.rollout.missing_eos_penalty,
    )
    q = rollout_quantities_naive(
        scores=scored.scores,
        old_logprobs=scored.old_logprobs,
        ref_logprobs=scored.ref_logprobs,
        old_values=scored.old_values,
        mask=batch.response_mask,
        hp=case.hp,
        conv=case.conv,
        group_index=gi,
    )
    perm = g[f"it{it}.perm"]
    beh = None
    if f"it{it}.rollout_logprobs" in g:  # the engine's output, replayed as its tokens are
        beh = Behaviour(g[f"it{it}.rollout_logprobs"].to(device), g[f"it{it}.policy_version"].to(device), it)
    nsteps = ppo_update_naive(
        models.actor,
        models.critic,
        models.actor_opt,
        models.critic_opt,
        scored,
        q,
        hp=case.hp,
        conv=case.conv,
        cfg=case.update,
        perms=list(perm),
        rollout_logprobs=beh.rollout_logprobs if beh is not None else None,
    )
    steps = [{k: s.stats[k] for k in COMPARED_METRICS if k in s.stats} for s in nsteps]
    metrics = rollout_metrics(scored, q, case.hp, case.conv)
    if beh is not None:
        metrics.update(seam_metrics(scored.old_logprobs, beh, batch.response_mask))
    for k in steps[0]:
        metrics[k] = sum(s[k] for s in steps) / len(steps)
    return _Iteration(scored, q, metrics, perm, steps, beh)


def _iteration_tensors(done: _Iteration) -> dict[str, Tensor]:
    """The stored tensors of one iteration (:data:`~refppo.golden.cases.TENSOR_FIELDS` + ``perm``, and
    :data:`~refppo.golden.cases.SEAM_FIELDS` in the seam mode)."""
    scored, q = done.scored, done.q
    b = scored.batch
    assert q.kl is not None  # the goldens always hold ref_logprobs
    return {
        "prompt_ids": b.prompt_ids,
        "prompt_mask": b.prompt_mask,
        "response_ids": b.response_ids,
        "response_mask": b.response_mask,
        "old_logprobs": scored.old_logprobs,
        "ref_logprobs": scored.ref_logprobs,
        "old_values": scored.old_values,
        "raw_scores": scored.raw_scores,
        "scores": scored.scores,
        "kl": q.kl,
        "token_rewards": q.token_rewards,
        "advantages": q.advantages,
        "returns": q.returns,
        "perm": done.perm,
        **(
            {
                "rollout_logprobs": done.behaviour.rollout_logprobs,
                "policy_version": done.behaviour.policy_version,
            }
            if done.behaviour is not None
            else {}
        ),
    }
