"""verl 0.9.1's GRPO advantages under rollout rejection sampling that empties a row (``verl-openrlhf``
venv; nothing from refppo).

``ray_trainer.py`` writes the mask of ``rollout_corr_helper.py::compute_rollout_correction_and_rejection_
mask`` into ``response_mask`` before ``compute_advantage``; ``core_algos.py::compute_grpo_outcome_advantage``
then takes each row's score as ``token_level_rewards.sum(-1)`` (not masked), forms the group mean and
std over EVERY row of the group (the emptied ones included) and multiplies the result by the reduced
mask. Both are called here as installed, on a batch whose ``seq_mean_k3`` gate (threshold 0.5) rejects
row 2 whole (its behaviour log-probs 1.5 below the proximal ones). The file holds the inputs, verl's
reduced mask and verl's advantages.
"""

from __future__ import annotations

from pathlib import Path

from peers.makers.verl_correction import verl_fns

B, T = 6, 5
GROUPS = [0, 0, 0, 1, 1, 1]
SCORES = [1.0, 0.0, 1.0, 0.5, 0.0, 1.0]


def make(out: Path) -> Path:
    """Write ``verl_rollout_rs_grpo.pt``; returns its path."""
    import numpy as np
    import torch

    ca, rch = verl_fns()
    g = torch.Generator().manual_seed(0)
    m = torch.ones(B, T)
    m[1, 3:] = 0
    old = -torch.rand(B, T, generator=g)
    beh = old.clone()
    beh[2] = old[2] - 1.5
    scores = torch.tensor(SCORES)
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), m.sum(-1).long() - 1] = scores
    _, m2, _ = rch.compute_rollout_correction_and_rejection_mask(
        old_log_prob=old, rollout_log_prob=beh, response_mask=m, rollout_is=None,
        rollout_rs="seq_mean_k3", rollout_rs_threshold=0.5,
    )  # fmt: skip
    index = np.array(GROUPS)
    adv, _ = ca.compute_grpo_outcome_advantage(rewards, m2, index, norm_adv_by_std_in_grpo=True)
    path = out / "verl_rollout_rs_grpo.pt"
    torch.save(
        {"mask": m, "old": old, "beh": beh, "scores": scores, "group_index": torch.tensor(GROUPS),
         "mask_gated": m2, "advantages": adv},
        path,
    )  # fmt: skip
    return path
