"""Naive twin of :func:`refppo.models.rollout.score_rollout`: per-prefix forwards, Python loops.

Every model read-out is per sequence, per token, per prefix (:mod:`refppo.models.naive`).
"""

from __future__ import annotations

import torch
from torch import nn

from refppo.models.batch import SequenceBatch
from refppo.models.naive import response_logprobs_naive, response_values_naive, reward_scores_naive
from refppo.models.roles import Reward, RewardModel, eval_mode
from refppo.models.rollout import ScoredRollout


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
    """Naive twin of :func:`refppo.models.rollout.score_rollout` (per-prefix forwards, Python loops);
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
