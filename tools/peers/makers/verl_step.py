"""The parts of one verl 0.9.1 step that every verl maker shares (``verl-openrlhf`` venv; nothing
from refppo).

verl ``verl/trainer/ppo/core_algos.py`` (``ca``): ``kl_penalty``, ``compute_value_loss``,
``agg_loss``. Restated, because the real functions want a ``DataProto``: ``ray_trainer.
apply_kl_penalty`` (token rewards ``score at the last valid token − β·KL·mask``) and the loss sum of
``verl/workers/utils/losses.py::ppo_loss`` (``pg − entropy_coeff·entropy + kl_loss_coef·kl_loss``).
Used by :mod:`peers.makers.verl_openrlhf`, :mod:`peers.makers.verl_gspo`,
:mod:`peers.makers.critic_free` and :mod:`peers.makers.holes`.
"""

from __future__ import annotations

from typing import Any

from peers.makers.common import HP

VERL_KL = {"k1": "kl", "k2": "mse", "k3": "low_var_kl", "abs": "abs"}
"""refppo's KL estimator → verl's ``kl_penalty`` name."""


class VerlActorConfig:
    """The attributes ``compute_policy_loss_vanilla`` reads from verl's ``ActorConfig``."""

    def __init__(self, clip: float, low: float | None, high: float | None, c: float) -> None:
        self.clip_ratio = clip
        self.clip_ratio_low = low
        self.clip_ratio_high = high
        self.c = c
        self.global_batch_info: dict[str, Any] = {}

    def get(self, key: str, default: Any) -> Any:
        return {"clip_ratio_c": self.c}.get(key, default)


def score_at(m: Any, scores: Any, last: Any) -> Any:
    """Token rewards holding each row's score at position ``last[b]`` and 0 elsewhere."""
    import torch

    rewards = torch.zeros_like(m)
    rewards[torch.arange(m.shape[0]), last] = scores
    return rewards


def reward_kl(ca: Any, x: dict[str, Any], est: str, kl_in: str, last: Any = None) -> tuple[Any, Any]:
    """``(kl, token_rewards)``: verl's ``kl_penalty`` of the rollout against the reference, and the
    score at ``last`` (default: the last valid token, ``sum(mask) − 1``) minus ``β·KL·mask`` when the
    KL is in the reward (``apply_kl_penalty``, restated)."""
    m = x["response_mask"]
    kl = ca.kl_penalty(x["old_logprobs"], x["ref_logprobs"], kl_penalty=VERL_KL[est])
    rewards = score_at(m, x["scores"], (m.sum(dim=1) - 1).long() if last is None else last)
    if kl_in == "reward":
        rewards = rewards - HP["kl_coef"] * kl * m
    return kl, rewards


def critic(ca: Any, x: dict[str, Any], ret: Any, agg: str) -> dict[str, Any]:
    """The value loss (``compute_value_loss`` at ``HP["cliprange_value"]``) and its clip fraction."""
    import torch

    vf, vf_clipfrac = ca.compute_value_loss(
        x["values"], ret, x["old_values"], x["response_mask"], cliprange_value=HP["cliprange_value"],
        loss_agg_mode=agg,
    )  # fmt: skip
    return {"vf_loss": vf.detach(), "vf_clipfrac": torch.as_tensor(vf_clipfrac, dtype=torch.float64)}


def entropy(ca: Any, x: dict[str, Any], agg: str) -> Any:
    """The entropy term as ``ppo_loss`` aggregates it (``agg_loss`` under the policy's mode)."""
    return ca.agg_loss(loss_mat=x["entropy"], loss_mask=x["response_mask"], loss_agg_mode=agg)


def policy_terms(pg: Any, metrics: dict[str, Any]) -> dict[str, Any]:
    """The policy loss and the two statistics verl logs with it (``actor/pg_clipfrac``, ``actor/ppo_kl``)."""
    import torch

    return {
        "pg_loss": pg.detach(),
        "pg_clipfrac": torch.tensor(metrics["actor/pg_clipfrac"], dtype=torch.float64),
        "approx_kl": torch.tensor(metrics["actor/ppo_kl"], dtype=torch.float64),
    }


def kl_loss(
    ca: Any, x: dict[str, Any], est: str, kl_in: str, agg: str, dump: dict[str, Any], loss: Any
) -> Any:
    """``loss`` plus ``kl_loss_coef·kl_loss`` when the KL is a loss (``dump["kl_loss"]`` set then);
    ``loss`` unchanged otherwise."""
    if kl_in != "loss":
        return loss
    kld = ca.kl_penalty(x["logprobs"], x["ref_logprobs"], kl_penalty=VERL_KL[est])
    term = ca.agg_loss(loss_mat=kld, loss_mask=x["response_mask"], loss_agg_mode=agg)
    dump["kl_loss"] = term.detach()
    return loss + term * HP["kl_coef"]
