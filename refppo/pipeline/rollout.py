"""Steps 0–4 of the pipeline: once per rollout, from the cached rollout tensors (split out of
``refppo/pipeline.py``, which re-exports every name; the numbered pipeline order is there).

    reward_quantities       steps 0–2: score map, per-token KL, token rewards (+ whitening), value mask
    rollout_quantities      steps 0–4: + advantages (GAE, or critic_free_advantages) and whitening
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from refppo.conventions import (
    AdvantageEstimator,
    GaePadding,
    GroupKL,
    KLPlacement,
    ScorePosition,
    Variance,
    WhitenHoles,
    Whitening,
)
from refppo.core.checks import check_mask
from refppo.core.gae import envelope
from refppo.core.group import discounted_returns, group_advantages
from refppo.core.kl import token_kl
from refppo.core.masked import AllReduce
from refppo.core.normalize import normalize
from refppo.core.rewards import score_positions, token_rewards
from refppo.core.score_map import map_scores
from refppo.errors import ConventionError, SingletonGroupError
from refppo.pipeline.blocks import gae_by_rows
from refppo.pipeline.settings import Convention, Hyperparams, ScoreMap


def value_mask(mask: Tensor, score_at: ScorePosition) -> Tensor:
    """The mask used by GAE and the value loss: ``mask`` plus the score slot when it is outside it.

    ``after_last_valid`` adds position ``L`` (TRL ``padding_mask_p1``); ``last_position`` adds ``T−1``.
    """
    m = check_mask("response_mask", mask)
    pos = score_positions(m, score_at)
    # m | one_hot(pos), without the [B, T] int64 one-hot: a copy of m with each row's slot set
    return m.clone().scatter_(1, pos.unsqueeze(1), True)


def clipped_scores(scores: Tensor, score_clip: float | None, bias: float = 0.0, scale: float = 1.0) -> Tensor:
    """Step 0: ``clip((s + bias)·scale, ±score_clip)`` (:func:`refppo.core.score_map.map_scores`;
    bias 0 and scale 1 leave ``s`` as is). The oracle's fast paths call it by this name."""
    return map_scores(scores, bias=bias, scale=scale, clip=score_clip)


def mapped_scores(scores: Tensor, score_map: ScoreMap | None) -> Tensor:
    """Step 0 under ``score_map`` (None: the identity, ``scores`` itself)."""
    if score_map is None:
        return scores
    return clipped_scores(scores, score_map.clip, score_map.bias, score_map.scale)


@dataclass(frozen=True)
class RolloutQuantities:
    """Steps 1–4: computed once per rollout from cached tensors. All ``[B, T]``."""

    kl: Tensor
    """Per-token KL (old vs ref) — the one that enters the reward (zeros if KL is in the loss)."""
    token_rewards: Tensor
    advantages_raw: Tensor
    """GAE advantages before whitening."""
    advantages: Tensor
    """As fed to the policy loss (after whitening)."""
    returns: Tensor
    """``advantages_raw + old_values``: the value targets."""
    value_mask: Tensor
    """Mask of GAE and the value loss (see :func:`value_mask`)."""


def reward_quantities(
    *,
    scores: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    hp: Hyperparams,
    conv: Convention,
    all_reduce: AllReduce | None = None,
    kl: Tensor | None = None,
    score_map: ScoreMap | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Steps 0–2 of the module docstring: ``(kl, token_rewards, value_mask)``, all ``[B, T]``.

    The per-token KL of the old vs reference log-probs (always, also when KL is placed in the loss),
    the token rewards (score at ``score_at``, ``−β·KL`` when KL is in the reward, then the optional
    reward whitening over the value mask) and the value mask. :func:`rollout_quantities` continues
    from here; the oracle's diagnosis pre-test stops here (the same calls, so the same values).
    ``kl``: step 1's result when the caller already holds it (this very ``token_kl`` call, made for
    another setting with the same estimator and clamps: the oracle's candidates share it).
    ``score_map``: step 0 (:func:`mapped_scores`; None: the scores as given).
    """
    m = check_mask("response_mask", mask)
    scores = mapped_scores(scores, score_map)
    if kl is None:
        kl = token_kl(
            old_logprobs,
            ref_logprobs,
            m,
            conv.kl_estimator,
            log_ratio_clamp=conv.kl_log_ratio_clamp,
            value_clamp=conv.kl_value_clamp,
        )
    beta = hp.kl_coef if conv.kl_in is KLPlacement.REWARD else 0.0
    rewards = token_rewards(scores, kl if beta > 0 else None, m, beta, score_at=conv.score_at)
    vmask = value_mask(m, conv.score_at)
    if conv.whiten_rewards is not Whitening.NONE:
        rewards = normalize(
            rewards,
            vmask,
            conv.whiten_rewards,
            unbiased=conv.whiten_variance is Variance.UNBIASED,
            eps=hp.whiten_eps,
            eps_at=conv.whiten_eps_at,
            all_reduce=all_reduce,
        )
    return kl, rewards, vmask


def _gae_advantages(
    rewards: Tensor, old_values: Tensor | None, vmask: Tensor, *, hp: Hyperparams, conv: Convention
) -> tuple[Tensor, Tensor]:
    """Step 3 with a critic: ``(advantages, returns)`` ``[B, T]`` of GAE over the value mask
    (``gae_padding=masked``) or every position (``unmasked``), by row blocks (:func:`gae_by_rows`)."""
    if old_values is None:
        raise ConventionError(
            "advantage=gae needs old_values (the critic's rollout values); a critic-free estimator "
            "(advantage=grpo, dr-grpo, rloo, reinforce++, reinforce++-baseline, opo, gpg, grpo-passk, "
            "flash-reinforce) does not"
        )
    gae_mask = vmask if conv.gae_padding is GaePadding.MASKED else torch.ones_like(vmask)
    return gae_by_rows(rewards, old_values, gae_mask, gamma=hp.gamma, lam=hp.lam, holes=conv.gae_holes)


def rollout_quantities(
    *,
    scores: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor,
    old_values: Tensor | None,
    mask: Tensor,
    hp: Hyperparams,
    conv: Convention,
    all_reduce: AllReduce | None = None,
    group_index: Tensor | None = None,
    groups_on_rank: bool = False,
    score_map: ScoreMap | None = None,
    kl: Tensor | None = None,
) -> RolloutQuantities:
    """Steps 0–4 of the module docstring (steps 0–2: :func:`reward_quantities`).

    ``all_reduce`` (a SUM all-reduce across ranks; None on one process): the tensors are this
    rank's rows and the whitening moments (step 4) are all-reduced, so each rank's advantages equal
    its rows of one process whitening the whole global batch (as verl). Steps 1–3 are per row and
    need no communication. Every rank must call it (the whitening is a collective).

    Step 3 is GAE for ``conv.advantage = gae`` (needs ``old_values``); otherwise the critic-free
    estimator of :func:`critic_free_advantages` (``old_values`` unused, may be None; the group
    estimators need ``group_index`` ``[B]``, the prompt each row answers). Critic-free
    ``returns`` are the raw advantages (verl and OpenRLHF return them as the returns).
    ``groups_on_rank``: with ``all_reduce``, the caller guarantees that every group's rows are on
    this rank (the trainer samples whole groups per rank and checks it), so the per-process group
    statistics are the global ones; without it a group estimator under ``all_reduce`` is refused.
    ``kl``: step 1's result when the caller already holds it (as :func:`reward_quantities`).
    """
    m = check_mask("response_mask", mask)
    scores = mapped_scores(scores, score_map)  # step 0, once: the critic-free estimators read it too
    kl, rewards, vmask = reward_quantities(
        scores=scores, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, mask=m, hp=hp, conv=conv,
        all_reduce=all_reduce, kl=kl,
    )  # fmt: skip
    if conv.advantage is AdvantageEstimator.GAE:
        adv_raw, returns = _gae_advantages(rewards, old_values, vmask, hp=hp, conv=conv)
    else:
        adv_raw = critic_free_advantages(
            scores=scores, kl=kl, rewards=rewards, mask=m, value_mask_=vmask, group_index=group_index,
            hp=hp, conv=conv, distributed=all_reduce is not None and not groups_on_rank,
            all_reduce=all_reduce,
        )  # fmt: skip
        returns = adv_raw
    adv = normalize(
        adv_raw,
        m if conv.whiten_holes is WhitenHoles.EXCLUDE else envelope(m),
        conv.whiten_advantages,
        unbiased=conv.whiten_variance is Variance.UNBIASED,
        eps=hp.whiten_eps,
        eps_at=conv.whiten_eps_at,
        all_reduce=all_reduce,
    )
    if conv.kl_in is KLPlacement.LOSS:
        kl = torch.zeros_like(kl)
    return RolloutQuantities(kl, rewards, adv_raw, adv, returns, vmask)


def _group_scores(
    scores: Tensor,
    kl: Tensor,
    rewards: Tensor,
    mask: Tensor,
    value_mask_: Tensor,
    *,
    hp: Hyperparams,
    conv: Convention,
) -> tuple[Tensor, Tensor | None]:
    """A group estimator's per-row score ``[B]`` and optional per-token penalty ``[B, T]``
    (:func:`critic_free_advantages`): ``group_kl=fold``: ``Σ_t r_t`` over the value mask, no penalty;
    ``to_go``: ``scores`` and ``−β·KL_t`` on ``mask`` (None when the KL is in the loss or β = 0)."""
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    penalty = None
    if conv.group_kl is GroupKL.FOLD:
        s = torch.where(value_mask_, rewards, zero).sum(dim=1)
    else:
        s = scores.to(rewards.dtype)
        if conv.kl_in is KLPlacement.REWARD and hp.kl_coef > 0:
            penalty = torch.where(mask, -hp.kl_coef * kl, zero)
    return s, penalty


def critic_free_advantages(
    *,
    scores: Tensor,
    kl: Tensor,
    rewards: Tensor,
    mask: Tensor,
    value_mask_: Tensor,
    group_index: Tensor | None,
    hp: Hyperparams,
    conv: Convention,
    distributed: bool = False,
    all_reduce: AllReduce | None = None,
) -> Tensor:
    """Step 3 without a critic: the raw advantages ``[B, T]`` of ``conv.advantage`` (before step 4).

    - ``reinforce++``: ``R_t = Σ_{k≥t} γ^{k−t} r_k`` of the token ``rewards`` over the value mask,
      across interior holes by ``conv.gae_holes`` (:func:`refppo.core.group.discounted_returns`; verl 0.9.1
      ``compute_reinforce_plus_plus_outcome_advantage``, OpenRLHF 0.11.2 ``reinforce``);
    - group estimators (:func:`refppo.core.group.group_advantages`, whitening left to step 4):
      with ``group_kl=fold`` the score of row i is ``Σ_t r_{i,t}`` over the value mask (KL and score
      together, verl ``token_level_rewards.sum(-1)``); with ``to_go`` it is ``scores`` and
      ``−β·KL_t`` is added as its return-to-go (OpenRLHF), β = 0 when the KL is in the loss;
      ``opo``'s lengths are the valid tokens of ``mask``;
    - ``flash-reinforce`` (the batch-mean baseline) needs no ``group_index``; its batch sums,
      ``gpg``'s and ``grpo``'s batch std (``conv.group_std_level`` ``batch``/``batch-centred``) go
      through ``all_reduce`` (every rank's rows, as one process on the whole batch).
    """
    if conv.advantage is AdvantageEstimator.REINFORCE_PP:
        return discounted_returns(rewards, value_mask_, gamma=hp.gamma, holes=conv.gae_holes)
    what = f"advantage={conv.advantage.value}"
    batch_only = conv.advantage is AdvantageEstimator.FLASH_REINFORCE
    if group_index is None and not batch_only:
        raise ConventionError(f"{what} needs group_index [B] (the prompt each row answers)")
    if distributed and not batch_only:
        raise ConventionError(
            f"{what} under a data-parallel all_reduce: the group statistics are per process here; "
            "a group split over ranks would be mis-normalised (not supported yet)"
        )
    s, penalty = _group_scores(scores, kl, rewards, mask, value_mask_, hp=hp, conv=conv)
    try:
        return group_advantages(
            s,
            group_index,
            mask,
            estimator=conv.advantage,
            unbiased_std=conv.group_std is Variance.UNBIASED,
            std_level=conv.group_std_level,
            eps=conv.group_eps,
            singleton=conv.group_singleton.value,
            token_penalty=penalty,
            whiten=False,
            all_reduce=all_reduce,
        )
    except SingletonGroupError as exc:
        raise ConventionError(
            f"group_index: prompts {exc.groups} have one response under group_singleton=error "
            "(set group_singleton=score, as verl/SkyRL GRPO, or zero, as verl rloo_vectorized)"
        ) from None
