"""Naive twin of the pipeline's critic-free step 3 (:func:`refppo.pipeline.rollout.advantages_stage`).

The group score of row i is its token rewards summed over the value mask, ``s_i = Σ_t r_{i,t}``
(the KL folded into the score: ``group_kl=fold``, verl, SkyRL), read one Python float at a time;
the advantages are then the core's naive group twin
(:func:`refppo.core.group_naive.group_advantages_naive`) on those scores. Used by
:func:`refppo.pipeline.step.rollout_quantities_naive`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from refppo.conventions import AdvantageEstimator, Variance
from refppo.core._group_checks import GROUP_ESTIMATORS
from refppo.core.group_naive import group_advantages_naive
from refppo.errors import ConventionError
from refppo.group_conventions import GroupKL
from refppo.pipeline.settings import Convention


def critic_free_advantages_naive(
    rewards: Tensor, vmask: Tensor, mask: Tensor, conv: Convention, group_index: Tensor | None
) -> Tensor:
    """Every critic-free estimator but ``reinforce++``: the core's naive group twin on the folded
    scores; ``[B, T]`` advantages (also the returns), 0 on padding.

    ``reinforce++-baseline`` is ``s − μ_G`` here (its whitening is step 4's, as in the pipeline);
    ``flash-reinforce`` needs no ``group_index``.
    """
    est = conv.adv.estimator
    supported = (*GROUP_ESTIMATORS, AdvantageEstimator.FLASH_REINFORCE)
    needs_groups = est is not AdvantageEstimator.FLASH_REINFORCE
    if (
        est not in supported
        or conv.adv.group_kl is not GroupKL.FOLD
        or (needs_groups and group_index is None)
    ):
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
        unbiased_std=conv.adv.group_std is Variance.UNBIASED,
        std_level=conv.adv.group_std_level,
        eps=conv.adv.group_eps,
        singleton=conv.adv.group_singleton.value,
    )


def times_mask_naive(adv: Tensor, mask: Tensor) -> Tensor:
    """A group estimator's advantages under a ``drop_mask`` gate, token by token: ``A'_bt = A_bt`` where
    the gate kept the token (``m'_bt``), else 0 (verl 0.9.1 ``scores.unsqueeze(-1) * response_mask``)."""
    rows = [
        [a if keep else 0.0 for a, keep in zip(ar, kr, strict=True)]
        for ar, kr in zip(adv.tolist(), mask.tolist(), strict=True)
    ]
    return torch.tensor(rows, dtype=adv.dtype, device=adv.device)


__all__ = ["critic_free_advantages_naive", "times_mask_naive"]
