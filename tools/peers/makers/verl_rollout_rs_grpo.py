"""verl 0.9.1's GRPO advantages under rollout rejection sampling that empties a row (``verl-openrlhf`` venv;
nothing from refppo).

``ray_trainer.py`` writes the mask of
``rollout_corr_helper.py::compute_rollout_correction_and_rejection_mask`` into ``response_mask`` before
``compute_advantage``; ``core_algos.py::compute_grpo_outcome_advantage`` then takes each row's score as
``token_level_rewards.sum(-1)`` (not masked), forms the group mean and std over EVERY row of the group
(the emptied ones included) and multiplies the result by the reduced mask. Both are called here as
installed, on a batch whose ``seq_mean_k3`` gate (threshold 0.5) rejects row 2 whole (its behaviour
log-probs 1.5 below the proximal ones). The file holds the inputs, verl's reduced mask and verl's
advantages.

:func:`make_dumps` writes whole-step dumps for ``refppo diff`` (``--preset verl`` + the ``--set`` keys of
``advantage=grpo`` and the gate, ``rollout_rs_effect=drop_mask``; control ``weight``): the grouped batch
of :mod:`peers.makers.critic_free` (12 rows, groups of 4, 4, 3 and 1; no reference, β = 0: the reward is
the score at the last token, as its ``_noref`` dumps), rows 1 and 6 rejected whole, then verl's GRPO (ε =
1e-6), Dr.GRPO (``norm_adv_by_std_in_grpo=False``) or RLOO (:data:`DUMP_CASES`; the calls of
``critic_free._verl_advantages``) and ``compute_policy_loss_vanilla`` (clip 0.2, dual clip 3; its
``agg_loss`` on the reduced mask) with the gradient by autograd on a leaf copy of the current log-probs
(v2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peers.makers.common import save
from peers.makers.critic_free import NOREF_HP, _grouped, _last_token, _verl_advantages, without_reference
from peers.makers.verl_correction import ACTOR, verl_fns
from peers.makers.verl_step import policy_terms

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


DROPPED = (1, 6)
"""The rows of :func:`make_dumps`' batches whose behaviour log-probs sit 1.5 below the proximal ones."""
DUMP_CASES = [
    ("token_mean", "token-mean", 610, "grpo", "grpo"),
    ("seq_mean", "seq-mean-token-mean", 611, "grpo", "grpo"),
    ("rloo", "token-mean", 612, "rloo", "rloo"),
    ("dr_grpo", "seq-mean-token-mean", 613, "grpo_nostd", "dr-grpo"),
]
"""(name, loss_agg_mode, seed, verl estimator call of ``critic_free._verl_advantages``, refppo's
``advantage``)."""


def _grpo_step(ca: Any, rch: Any, x: dict[str, Any], agg: str, call: str) -> dict[str, Any]:
    import torch

    m = x["response_mask"]
    rewards = _last_token(m, x["scores"])
    _, m2, _ = rch.compute_rollout_correction_and_rejection_mask(
        old_log_prob=x["old_logprobs"], rollout_log_prob=x["rollout_logprobs"], response_mask=m,
        rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.5,
    )  # fmt: skip
    emptied = (m.sum(-1) > 0) & (m2.sum(-1) == 0)
    assert emptied.nonzero().flatten().tolist() == list(DROPPED), emptied
    adv, ret = _verl_advantages(ca, call, rewards, m2, x["group_index"].numpy())
    lp = x["logprobs"].clone().requires_grad_(True)
    pg, metrics = ca.compute_policy_loss_vanilla(
        x["old_logprobs"], lp, adv, m2, loss_agg_mode=agg, config=ACTOR
    )
    (grad,) = torch.autograd.grad(pg, (lp,))
    dump: dict[str, Any] = dict(x)
    dump.update(
        token_rewards=rewards, advantages=adv, returns=ret, **policy_terms(pg, metrics), loss=pg.detach(),
        grad_logprobs=torch.where(m.bool(), grad, 0.0),
    )  # fmt: skip
    return dump


def make_dumps(out: Path) -> list[str]:
    """The v1 (scalars) and v2 (with ``grad_logprobs``) dumps of :data:`DUMP_CASES`; returns their names."""
    import torch

    ca, rch = verl_fns()
    made = []
    for name, agg, seed, call, est in DUMP_CASES:
        x = without_reference(_grouped(seed, torch.float64))
        m = x["response_mask"]
        g = torch.Generator().manual_seed(seed + 1)
        beh = x["old_logprobs"] - 0.05 * torch.randn(m.shape, generator=g, dtype=m.dtype)
        for r in DROPPED:
            beh[r] = x["old_logprobs"][r] - 1.5
        x["rollout_logprobs"] = torch.where(m.bool(), beh, 7.5)
        dump = _grpo_step(ca, rch, x, agg, call)
        keys = {"advantage": est, "loss_agg": agg, "dual_clip": 3.0, "rollout_rs": "sequence",
                "rollout_rs_stat": "k3", "rollout_rs_order": "behaviour", "rollout_rs_reduce": "mean",
                "rollout_rs_low": None, "rollout_rs_high": 0.5, "rollout_rs_effect": "drop_mask"}  # fmt: skip
        hp = dict(NOREF_HP, cliprange_high=0.2)
        for tag in ("v1", "v2"):
            d = dict(dump) if tag == "v2" else {k: v for k, v in dump.items() if k != "grad_logprobs"}
            made.append(
                save(out, f"verl_rollout_rs_grpo_{name}_{tag}", d, hp, keys, {"rollout_rs_effect": "weight"})
            )
    return made
