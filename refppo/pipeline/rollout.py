"""The rollout stages' functions (steps 0–4 of :mod:`refppo.pipeline`, once per rollout, from the
cached rollout tensors), each ``fn(q, conv, hp, ev) -> {quantity: tensor}`` of
:class:`refppo.pipeline.stages.Stage`::

    score_map_stage      scores                        -> mapped_scores      map_scores
    kl_stage             old_logprobs, ref_logprobs    -> kl                 token_kl
    value_mask_stage     mask                          -> value_mask         value_mask
    rewards_stage        mapped_scores, kl (value_mask)-> token_rewards_raw  token_rewards
    reward_whitening_stage token_rewards_raw, value_mask -> token_rewards    normalize
    advantages_stage     token_rewards, old_values, …  -> advantages_raw,    gae_by_rows, or
                         (bootstrap_values, truncated)   returns            critic_free_advantages
    whitening_stage      advantages_raw                -> advantages         normalize

``q`` maps quantity names to tensors (or None: no critic, no ``group_index``); ``mask`` there is the
validated bool response mask.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from refppo.conventions import (
    AdvantageEstimator,
    GaeBootstrap,
    GaePadding,
    ScorePosition,
    ScoreSlotKL,
    Variance,
    WhitenHoles,
    Whitening,
    parse,
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
from refppo.group_conventions import GroupKL
from refppo.pipeline.blocks import Evaluation, gae_by_rows
from refppo.pipeline.needs import advantages_needs, kl_needs, require_input
from refppo.pipeline.settings import Convention, Hyperparams

Q = Mapping[str, Any]
"""The quantities a stage reads (name → tensor, or None where absent)."""


def value_mask(mask: Tensor, score_at: ScorePosition) -> Tensor:
    """The mask used by GAE and the value loss: ``mask`` plus the score slot when it is outside it.

    ``after_last_valid`` adds position ``L`` (TRL ``padding_mask_p1``); ``last_position`` adds ``T−1``.
    """
    m = check_mask("response_mask", mask)
    pos = score_positions(m, score_at)
    # m | one_hot(pos), without the [B, T] int64 one-hot: a copy of m with each row's slot set
    return m.clone().scatter_(1, pos.unsqueeze(1), True)


def same_slots_as_after_last_valid(mask: Tensor, score_at: ScorePosition | str) -> bool:
    """Whether ``score_at`` is ``after_last_valid_unless_first`` and puts every row of ``mask`` where
    ``after_last_valid`` does (no row's only valid token is position 0 with ``T > 1``): on such a
    batch the two cannot be told apart, so a search (``--detect``, the diagnosis) tries one of them."""
    where = parse(ScorePosition, score_at, what="score_at")
    if where is not ScorePosition.AFTER_LAST_VALID_UNLESS_FIRST:
        return False
    m = check_mask("mask", mask)
    return bool(torch.equal(score_positions(m, where), score_positions(m, ScorePosition.AFTER_LAST_VALID)))


def score_map_stage(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """Step 0: ``clip((s + bias)·scale, ±clip)`` of ``conv.score`` (the identity leaves ``s`` as is)."""
    sm = conv.score
    return {"mapped_scores": map_scores(q["scores"], bias=sm.bias, scale=sm.scale, clip=sm.clip)}


def kl_stage(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor | None]:
    """Step 1: the per-token KL of the old vs reference log-probs (also when KL is placed in the
    loss), by ``conv.kl``'s estimator and clamps. Without ``ref_logprobs``: None where nothing reads
    the KL (:func:`refppo.pipeline.needs.kl_needs`; a one-line DumpError where something does)."""
    if q.get("ref_logprobs") is None:
        require_input(q, "ref_logprobs", "kl", kl_needs(conv, hp))
        return {"kl": None}
    k = conv.kl
    kl = token_kl(
        q["old_logprobs"], q["ref_logprobs"], q["mask"], k.estimator,
        log_ratio_clamp=k.log_ratio_clamp, value_clamp=k.value_clamp,
    )  # fmt: skip
    return {"kl": kl}


def value_mask_stage(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """The value mask (:func:`value_mask` at ``score_at``)."""
    return {"value_mask": value_mask(q["mask"], conv.reward.score_at)}


def slot_kl_on(conv: Convention, hp: Hyperparams) -> bool:
    """The KL penalty reaches a score slot outside the mask (``score_slot_kl=kl`` with the KL in the
    reward, β > 0 and the score after the last valid token)."""
    return (
        conv.reward.slot_kl is ScoreSlotKL.KL
        and conv.kl.placement.in_reward
        and hp.kl_coef > 0
        and conv.reward.score_at is not ScorePosition.LAST_VALID
    )


def rewards_stage(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """Step 2: the token rewards before whitening, ``r = s·[t = p] − β·KL`` (``−β·KL`` only when KL
    is in the reward), ``[B, T]``. Under ``score_slot_kl=kl`` (:func:`slot_kl_on`) the KL is taken
    over the value mask (the slot's token too: ``conv.kl``'s estimator and clamps on the old and
    reference log-probs) and subtracted there."""
    beta = hp.kl_coef if conv.kl.placement.in_reward else 0.0
    kl = q["kl"] if beta > 0 else None
    kl_mask = None
    if slot_kl_on(conv, hp):
        k, kl_mask = conv.kl, q["value_mask"]
        kl = token_kl(
            q["old_logprobs"], q["ref_logprobs"], kl_mask, k.estimator,
            log_ratio_clamp=k.log_ratio_clamp, value_clamp=k.value_clamp,
        )  # fmt: skip
    raw = token_rewards(
        q["mapped_scores"], kl, q["mask"], beta, score_at=conv.reward.score_at, kl_mask=kl_mask
    )
    return {"token_rewards_raw": raw}


def reward_whitening_stage(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """Step 2b: the optional reward whitening of ``token_rewards_raw`` over the value mask (a
    collective under ``all_reduce``); ``whiten_rewards=none`` passes them through."""
    rewards = q["token_rewards_raw"]
    if conv.reward.whiten is not Whitening.NONE:
        rewards = normalize(
            rewards,
            q["value_mask"],
            conv.reward.whiten,
            unbiased=conv.norm.variance is Variance.UNBIASED,
            eps=hp.whiten_eps,
            eps_at=conv.norm.eps_at,
            all_reduce=ev.all_reduce,
        )
    return {"token_rewards": rewards}


def advantages_stage(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """Step 3: ``(advantages_raw, returns)``: GAE for ``advantage=gae`` (needs ``old_values``; returns
    = raw advantages + old values), else :func:`critic_free_advantages` (``old_values`` unused; the
    group estimators need ``group_index`` ``[B]``; returns = the raw advantages, as verl and OpenRLHF).
    A group estimator under ``all_reduce`` needs ``ev.groups_on_rank``."""
    if conv.adv.estimator is AdvantageEstimator.GAE:
        boot = gae_last_values(q, conv, hp)
        adv_raw, returns = _gae_advantages(
            q["token_rewards"], q.get("old_values"), q["value_mask"], hp=hp, conv=conv, last_values=boot
        )
        return {"advantages_raw": adv_raw, "returns": returns}
    adv_raw = critic_free_advantages(
        scores=q["mapped_scores"], kl=q["kl"], rewards=q["token_rewards"], mask=q["mask"],
        value_mask_=q["value_mask"], group_index=q.get("group_index"), hp=hp, conv=conv,
        distributed=ev.all_reduce is not None and not ev.groups_on_rank, all_reduce=ev.all_reduce,
    )  # fmt: skip
    return {"advantages_raw": adv_raw, "returns": adv_raw}


def whiten_advantages(
    adv_raw: Tensor, mask: Tensor, conv: Convention, hp: Hyperparams, all_reduce: AllReduce | None = None
) -> Tensor:
    """Step 4 on ``adv_raw`` ``[B, T]``: ``conv.whiten.advantages`` over ``mask`` (or its envelope,
    holes included, under ``whiten_holes=include``) with ``conv.norm``'s moments; 0 off ``mask``."""
    return normalize(
        adv_raw,
        mask if conv.whiten.holes is WhitenHoles.EXCLUDE else envelope(mask),
        conv.whiten.advantages,
        unbiased=conv.norm.variance is Variance.UNBIASED,
        eps=hp.whiten_eps,
        eps_at=conv.norm.eps_at,
        all_reduce=all_reduce,
    )


def whitening_stage(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """Step 4: the advantages as fed to the policy loss (:func:`whiten_advantages` over the response
    mask); global under ``all_reduce``, so each rank's advantages equal its rows of one process
    whitening the whole batch (as verl)."""
    return {"advantages": whiten_advantages(q["advantages_raw"], q["mask"], conv, hp, ev.all_reduce)}


def gae_last_values(q: Q, conv: Convention, hp: Hyperparams) -> Tensor | None:
    """GAE's ``V_{t_L}`` ``[B]`` under ``gae_bootstrap=truncated``: ``bootstrap_values`` on the
    truncated rows (``truncated`` [B] when given, else the rows whose last position is valid in
    ``mask``: they fill the frame), 0 on the rest (``torch.where``: the others' entries are never
    read); None under ``none``. A one-line DumpError without ``bootstrap_values``."""
    if conv.adv.gae_bootstrap is GaeBootstrap.NONE:
        return None
    require_input(q, "bootstrap_values", "advantages", advantages_needs(conv, hp))
    boot: Tensor = q["bootstrap_values"]
    flag = q.get("truncated")
    cut = q["mask"][:, -1] if flag is None else flag.to(torch.bool)
    return torch.where(cut, boot, torch.zeros((), dtype=boot.dtype, device=boot.device))


def _gae_advantages(
    rewards: Tensor,
    old_values: Tensor | None,
    vmask: Tensor,
    *,
    hp: Hyperparams,
    conv: Convention,
    last_values: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Step 3 with a critic: ``(advantages, returns)`` ``[B, T]`` of GAE over the value mask
    (``gae_padding=masked``) or every position (``unmasked``), by row blocks (:func:`gae_by_rows`);
    ``last_values``: :func:`gae_last_values`."""
    if old_values is None:
        raise ConventionError(
            "advantage=gae needs old_values (the critic's rollout values); a critic-free estimator "
            "(advantage=grpo, dr-grpo, rloo, reinforce++, reinforce++-baseline, opo, gpg, grpo-passk, "
            "flash-reinforce) does not"
        )
    gae_mask = vmask if conv.adv.gae_padding is GaePadding.MASKED else torch.ones_like(vmask)
    return gae_by_rows(
        rewards, old_values, gae_mask, gamma=hp.gamma, lam=hp.lam, holes=conv.adv.gae_holes,
        last_values=last_values,
    )  # fmt: skip


def _group_scores(
    scores: Tensor,
    kl: Tensor | None,
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
    if conv.adv.group_kl is GroupKL.FOLD:
        s = torch.where(value_mask_, rewards, zero).sum(dim=1)
    else:
        s = scores.to(rewards.dtype)
        if conv.kl.placement.in_reward and hp.kl_coef > 0:
            assert kl is not None  # the kl stage needs ref_logprobs then (needs.kl_needs)
            penalty = torch.where(mask, -hp.kl_coef * kl, zero)
    return s, penalty


def critic_free_advantages(
    *,
    scores: Tensor,
    kl: Tensor | None,
    rewards: Tensor,
    mask: Tensor,
    value_mask_: Tensor,
    group_index: Tensor | None,
    hp: Hyperparams,
    conv: Convention,
    distributed: bool = False,
    all_reduce: AllReduce | None = None,
) -> Tensor:
    """Step 3 without a critic: the raw advantages ``[B, T]`` of ``conv.adv.estimator`` (before step 4).

    - ``reinforce++``: ``R_t = Σ_{k≥t} γ^{k−t} r_k`` of the token ``rewards`` over the value mask,
      across interior holes by ``conv.adv.gae_holes`` (:func:`refppo.core.group.discounted_returns`;
      verl 0.9.1 ``compute_reinforce_plus_plus_outcome_advantage``, OpenRLHF 0.11.2 ``reinforce``);
    - group estimators (:func:`refppo.core.group.group_advantages`, whitening left to step 4):
      with ``group_kl=fold`` the score of row i is ``Σ_t r_{i,t}`` over the value mask (KL and score
      together, verl ``token_level_rewards.sum(-1)``); with ``to_go`` it is ``scores`` and
      ``−β·KL_t`` is added as its return-to-go (OpenRLHF), β = 0 when the KL is in the loss;
      ``opo``'s lengths are the valid tokens of ``mask``;
    - ``flash-reinforce`` (the batch-mean baseline) needs no ``group_index``; its batch sums,
      ``gpg``'s and ``grpo``'s batch std (``conv.adv.group_std_level`` ``batch``/``batch-centred``) go
      through ``all_reduce`` (every rank's rows, as one process on the whole batch).
    """
    if conv.adv.estimator is AdvantageEstimator.REINFORCE_PP:
        return discounted_returns(rewards, value_mask_, gamma=hp.gamma, holes=conv.adv.gae_holes)
    what = f"advantage={conv.adv.estimator.value}"
    batch_only = conv.adv.estimator is AdvantageEstimator.FLASH_REINFORCE
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
            estimator=conv.adv.estimator,
            unbiased_std=conv.adv.group_std is Variance.UNBIASED,
            std_level=conv.adv.group_std_level,
            eps=conv.adv.group_eps,
            singleton=conv.adv.group_singleton.value,
            token_penalty=penalty,
            whiten=False,
            all_reduce=all_reduce,
        )
    except SingletonGroupError as exc:
        raise ConventionError(
            f"group_index: prompts {exc.groups} have one response under group_singleton=error "
            "(set group_singleton=score, as verl/SkyRL GRPO, or zero, as verl rloo_vectorized)"
        ) from None
