"""One PPO iteration (:func:`iteration`): rollout, scoring, the rollout stages
(:func:`refppo.pipeline.step.rollout_quantities`), the update (:func:`refppo.train.update.ppo_update`),
and the rollout's scalars (:func:`rollout_metrics`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from refppo.conventions import AdvantageEstimator
from refppo.core.masked import AllReduce, masked_mean, masked_sum
from refppo.models.batch import SequenceBatch
from refppo.models.roles import Reward
from refppo.models.rollout import RolloutConfig, ScoredRollout, generate_rollout, score_rollout
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.stages import BY_NAME
from refppo.pipeline.step import RolloutQuantities, rollout_quantities
from refppo.train.seam import seam_metrics
from refppo.train.update import ppo_update
from refppo.train.update_config import Behaviour, CaptureRequest, MinibatchRecord, PPOUpdateConfig, PtxBatch


def rollout_metrics(
    scored: ScoredRollout, quantities: RolloutQuantities, hp: Hyperparams, conv: Convention
) -> dict[str, float]:
    """Scalars of one rollout (formulas in spec/models.md):

    ``score`` mean of the scores entering the rewards (after the missing-EOS penalty);
    ``raw_score``; ``kl`` = mean over sequences of Σ_t KL_t(old‖ref) (``conv.kl.estimator``,
    whatever the KL placement); ``non_score_reward`` = mean_b Σ_t (r_t − score·[t = score slot]);
    ``response_length`` mean number of valid response tokens; ``eos_frac``; ``old_entropy``
    token mean; ``advantage_mean``, ``return_mean``, ``value_mean`` over valid tokens
    (``value_mean`` only with a critic, ``conv.adv.estimator = gae``: a critic-free rollout has no values;
    ``return_mean`` and ``value_mean`` over the value mask, the gate's under ``drop_mask``).
    """
    m = scored.batch.response_mask
    q = {
        "old_logprobs": scored.old_logprobs.double(),
        "ref_logprobs": scored.ref_logprobs.double(),
        "mask": m,
    }
    kl = BY_NAME["kl"].run(q, conv, hp)["kl"]  # the pipeline's KL stage, in float64
    assert quantities.kl is not None  # the trainer always holds ref_logprobs
    beta = hp.kl_coef if conv.kl.placement.in_reward else 0.0
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
        "return_mean": _value_token_mean(quantities.returns.double(), vm),
    }
    if conv.adv.estimator is AdvantageEstimator.GAE:  # critic-free: the zeros stand in for no critic
        out["value_mean"] = _value_token_mean(scored.old_values.double(), vm)
    return out


def _value_token_mean(x: Tensor, vm: Tensor) -> float:
    """``Σ vm·x / Σ vm`` over the value mask, whose rows the rejection gate may have emptied
    (``rollout_rs_effect=drop_mask``; 0 over no token)."""
    n = vm.sum()
    return float(masked_sum(x, vm) / n.to(x.dtype)) if bool(n > 0) else 0.0


@dataclass(frozen=True)
class IterationResult:
    """One PPO iteration: the metrics (rollout ∪ update) and the cached rollout tensors."""

    metrics: dict[str, float]
    scored: ScoredRollout
    quantities: RolloutQuantities


def _score(
    actor: nn.Module,
    reference: nn.Module,
    critic: nn.Module | None,
    reward: Reward,
    batch: SequenceBatch,
    rollout_cfg: RolloutConfig,
) -> ScoredRollout:
    """Step 2: π_old, π_ref log-probs, V_old and scores of ``batch`` (one pass each, no grad)."""
    return score_rollout(
        actor,
        reference,
        critic,
        reward,
        batch,
        temperature=rollout_cfg.temperature,
        eos_token_id=rollout_cfg.eos_token_id,
        missing_eos_penalty=rollout_cfg.missing_eos_penalty,
    )


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
    behaviour: Behaviour | None = None,
) -> IterationResult:
    """Rollout → scoring → rollout quantities → update (:mod:`refppo.ppo`, steps 1–4).

    ``batch``: replay these responses instead of sampling (the prompts must be ``prompt_ids``);
    the generator is then not used for sampling. ``critic=None``: a critic-free
    ``conv.adv.estimator`` (see :func:`ppo_update`). ``group_index`` ``[B]``: the prompt each row
    answers (group estimators); ``groups_on_rank``: the caller guarantees that every group's rows
    are on this rank (see :func:`refppo.pipeline.step.rollout_quantities`). The score map
    (the pipeline's step 0) is ``conv.score``. ``behaviour`` (the seam mode, with ``batch``): the
    engine's log-probs of ``batch`` for the update (:mod:`refppo.train.seam`) and the ``seam_*`` metrics.
    """
    if batch is None:
        batch = generate_rollout(actor, prompt_ids, prompt_mask, rollout_cfg, generator)
    scored = _score(actor, reference, critic, reward, batch, rollout_cfg)
    if behaviour is not None:  # the gate and the update read the behaviour log-probs in the proximal's dtype
        lp = behaviour.rollout_logprobs.to(scored.old_logprobs.dtype)
        behaviour = Behaviour(lp, behaviour.policy_version, behaviour.version)
    quantities = rollout_quantities(
        scores=scored.scores, old_logprobs=scored.old_logprobs, ref_logprobs=scored.ref_logprobs,
        old_values=scored.old_values if critic is not None else None,  # no critic: no values
        mask=batch.response_mask, hp=hp, conv=conv, all_reduce=all_reduce, group_index=group_index,
        groups_on_rank=groups_on_rank,
        rollout_logprobs=behaviour.rollout_logprobs if behaviour is not None else None,  # drop_mask's gate
    )  # fmt: skip
    metrics = rollout_metrics(scored, quantities, hp, conv)
    if behaviour is not None:
        metrics.update(seam_metrics(scored.old_logprobs, behaviour, batch.response_mask))
    update = ppo_update(
        actor, critic, actor_optimizer, critic_optimizer, scored, quantities, hp=hp, conv=conv,
        cfg=update_cfg, generator=generator, world_size=world_size, all_reduce=all_reduce,
        ptx_batch=ptx_batch, on_minibatch=on_minibatch, capture=capture, group_index=group_index,
        behaviour=behaviour,
    )  # fmt: skip
    metrics.update(update)
    return IterationResult(metrics, scored, quantities)
