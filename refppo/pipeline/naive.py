"""Naive twins of the rollout stages (steps 0–4, :mod:`refppo.pipeline.rollout`): each the same
``fn(q, conv, hp, ev)`` on the naive twins of the core (``refppo.core.*_naive``, Python floats), the
critic-free step 3 in :mod:`refppo.pipeline.naive_group`. ``ev`` is not read: the naive twins run on
one process, the whole batch at once. The whole-step walk is
:func:`refppo.pipeline.step.rollout_quantities_naive`.

Supported subset (what the goldens exercise): critic-free: every critic-free ``advantage`` but
``reinforce++``, and ``group_kl=fold``; anything else raises.
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
)
from refppo.core.gae import gae_naive
from refppo.core.kl import token_kl_naive
from refppo.core.normalize import normalize_naive
from refppo.core.rewards import token_rewards_naive
from refppo.core.score_map import map_scores_naive
from refppo.pipeline.blocks import Evaluation
from refppo.pipeline.naive_group import critic_free_advantages_naive
from refppo.pipeline.needs import advantages_needs, kl_needs, require_input
from refppo.pipeline.settings import Convention, Hyperparams

Q = Mapping[str, Any]


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
        elif score_at is ScorePosition.AFTER_LAST_VALID_UNLESS_FIRST:  # one token: its own slot
            slot = L - 1 if L == 1 else min(L, T - 1)
        else:
            slot = T - 1
        out.append([ok or t == slot for t, ok in enumerate(row)])
    return torch.tensor(out, dtype=torch.bool)


def score_map_naive(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """Step 0 by :func:`refppo.core.score_map.map_scores_naive`, as a tensor of the scores' dtype."""
    scores, sm = q["scores"], conv.score
    mapped = map_scores_naive(scores, bias=sm.bias, scale=sm.scale, clip=sm.clip)
    return {"mapped_scores": torch.tensor(mapped, dtype=scores.dtype, device=scores.device)}


def kl_naive(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor | None]:
    """Step 1 by :func:`refppo.core.kl.token_kl_naive`; None without ``ref_logprobs`` where nothing
    reads the KL (as :func:`refppo.pipeline.rollout.kl_stage`)."""
    if q.get("ref_logprobs") is None:
        require_input(q, "ref_logprobs", "kl", kl_needs(conv, hp))
        return {"kl": None}
    k = conv.kl
    kl = token_kl_naive(
        q["old_logprobs"], q["ref_logprobs"], q["mask"], k.estimator,
        log_ratio_clamp=k.log_ratio_clamp, value_clamp=k.value_clamp,
    )  # fmt: skip
    return {"kl": kl}


def value_mask_naive_stage(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """The value mask by :func:`value_mask_naive`."""
    return {"value_mask": value_mask_naive(q["mask"], conv.reward.score_at)}


def rewards_naive(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """Step 2 by :func:`refppo.core.rewards.token_rewards_naive` (under ``score_slot_kl=kl`` the KL of
    :func:`refppo.core.kl.token_kl_naive` over the value mask)."""
    beta = hp.kl_coef if conv.kl.placement.in_reward else 0.0
    kl, kl_mask = q["kl"] if beta > 0 else None, None
    at_slot = conv.reward.slot_kl is ScoreSlotKL.KL and conv.reward.score_at is not ScorePosition.LAST_VALID
    if beta > 0 and at_slot:  # the KL over the value mask (the slot's token too)
        k, kl_mask = conv.kl, q["value_mask"]
        kl = token_kl_naive(
            q["old_logprobs"], q["ref_logprobs"], kl_mask, k.estimator,
            log_ratio_clamp=k.log_ratio_clamp, value_clamp=k.value_clamp,
        )  # fmt: skip
    raw = token_rewards_naive(
        q["mapped_scores"], kl, q["mask"], beta, score_at=conv.reward.score_at, kl_mask=kl_mask
    )
    return {"token_rewards_raw": raw}


def reward_whitening_naive(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """Step 2b: the reward whitening by :func:`refppo.core.normalize.normalize_naive` over the value
    mask (``whiten_rewards=none``: the raw rewards)."""
    rewards = q["token_rewards_raw"]
    if conv.reward.whiten is not Whitening.NONE:
        rewards = normalize_naive(
            rewards, q["value_mask"], conv.reward.whiten, unbiased=conv.norm.variance is Variance.UNBIASED,
            eps=hp.whiten_eps, eps_at=conv.norm.eps_at,
        )  # fmt: skip
    return {"token_rewards": rewards}


def advantages_naive(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """Step 3: :func:`refppo.core.gae.gae_naive` over the value mask (every position under
    ``gae_padding=through``), or the critic-free twin (the group score of row i is Σ_t r_{i,t} over
    the value mask, as ``group_kl=fold``)."""
    rewards, vmask = q["token_rewards"], q["value_mask"]
    if conv.adv.estimator is AdvantageEstimator.GAE:
        gae_mask = vmask if conv.adv.gae_padding is GaePadding.MASKED else torch.ones_like(vmask)
        adv_raw, returns = gae_naive(
            rewards, q["old_values"], gae_mask, gamma=hp.gamma, lam=hp.lam, holes=conv.adv.gae_holes,
            last_values=_last_values_naive(q, conv, hp),
        )  # fmt: skip
        return {"advantages_raw": adv_raw, "returns": returns}
    adv_raw = critic_free_advantages_naive(rewards, vmask, q["mask"], conv, q.get("group_index"))
    return {"advantages_raw": adv_raw, "returns": adv_raw}


def _last_values_naive(q: Q, conv: Convention, hp: Hyperparams) -> Tensor | None:
    """Naive twin of :func:`refppo.pipeline.rollout.gae_last_values`, row by row: a row is
    truncated by its ``truncated`` flag, else when its last position is valid."""
    if conv.adv.gae_bootstrap is GaeBootstrap.NONE:
        return None
    require_input(q, "bootstrap_values", "advantages", advantages_needs(conv, hp))
    boot, flags, rows = q["bootstrap_values"], q.get("truncated"), q["mask"].tolist()
    cut = [bool(row[-1]) for row in rows] if flags is None else [bool(f) for f in flags.tolist()]
    vals = [float(b) if c else 0.0 for b, c in zip(boot.tolist(), cut, strict=True)]
    return torch.tensor(vals, dtype=boot.dtype, device=boot.device)


def whitening_naive(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """Step 4 by :func:`refppo.core.normalize.normalize_naive`, over the mask or its envelope."""
    adv = normalize_naive(
        q["advantages_raw"], _whiten_mask_naive(q["mask"], conv.whiten.holes), conv.whiten.advantages,
        unbiased=conv.norm.variance is Variance.UNBIASED, eps=hp.whiten_eps, eps_at=conv.norm.eps_at,
    )  # fmt: skip
    return {"advantages": adv}


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
    "advantages_naive",
    "kl_naive",
    "reward_whitening_naive",
    "rewards_naive",
    "score_map_naive",
    "value_mask_naive",
    "value_mask_naive_stage",
    "whitening_naive",
]
