"""Naive twin of steps 0–4 of the pipeline (:func:`refppo.pipeline.rollout.rollout_quantities`):
step by step on the naive twins of the core (``refppo.core.*_naive``); the critic-free step 3 in
:mod:`refppo.pipeline.naive_group`.

Supported subset (what the goldens exercise): the KL clamps must be None; critic-free: every
critic-free ``advantage`` but ``reinforce++``, and ``group_kl=fold``; anything else raises.
"""

from __future__ import annotations

import torch
from torch import Tensor

from refppo.conventions import (
    AdvantageEstimator,
    GaePadding,
    KLPlacement,
    ScorePosition,
    Variance,
    WhitenHoles,
    Whitening,
)
from refppo.core.gae import gae_naive
from refppo.core.kl import token_kl_naive
from refppo.core.normalize import normalize_naive
from refppo.core.rewards import token_rewards_naive
from refppo.core.score_map import map_scores_naive
from refppo.pipeline.naive_group import critic_free_advantages_naive
from refppo.pipeline.rollout import RolloutQuantities
from refppo.pipeline.settings import Convention, Hyperparams, ScoreMap


def value_mask_naive(mask: Tensor, score_at: ScorePosition) -> Tensor:
    """Naive twin of :func:`refppo.pipeline.rollout.value_mask`: the mask plus the score slot, row by row."""
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
    """Naive twin of :func:`refppo.pipeline.rollout.rollout_quantities` from the ``*_naive`` core twins
    (critic-free: the group score of row i is Σ_t r_{i,t} over the value mask, as ``group_kl=fold``;
    ``score_map``: step 0 by :func:`refppo.core.score_map.map_scores_naive`)."""
    if score_map is not None:
        scores = _mapped_naive(scores, score_map)
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
        adv_raw = returns = critic_free_advantages_naive(rewards, vmask, mask, conv, group_index)
    adv = normalize_naive(
        adv_raw,
        _whiten_mask_naive(mask, conv.whiten_holes),
        conv.whiten_advantages,
        unbiased=unbiased,
        eps=hp.whiten_eps,
        eps_at=conv.whiten_eps_at,
    )
    if conv.kl_in is KLPlacement.LOSS:
        kl = torch.zeros_like(kl)
    return RolloutQuantities(kl, rewards, adv_raw, adv, returns, vmask)


def _mapped_naive(scores: Tensor, score_map: ScoreMap) -> Tensor:
    """Step 0: the scores through :func:`refppo.core.score_map.map_scores_naive`, as a tensor."""
    mapped = map_scores_naive(scores, bias=score_map.bias, scale=score_map.scale, clip=score_map.clip)
    return torch.tensor(mapped, dtype=scores.dtype, device=scores.device)


def _whiten_mask_naive(mask: Tensor, holes: WhitenHoles) -> Tensor:
    """The advantage whitening's positions: ``mask`` (``exclude``) or each row up to its last valid
    token, holes included (``include``)."""
    if holes is not WhitenHoles.INCLUDE:
        return mask
    rows = mask.bool().tolist()
    return torch.tensor(
        [[any(row[t:]) for t in range(len(row))] for row in rows],
        dtype=torch.bool,
        device=mask.device,
    )


__all__ = [
    "rollout_quantities_naive",
    "value_mask_naive",
]
