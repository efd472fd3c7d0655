"""SkyRL-train 0.3.1 step dumps with truncated IS (``use_tis``) and CISPO, from its own code
(``skyrl-areal`` venv).

``skyrl_train/utils/ppo_utils.py::ppo_policy_loss`` with ``use_tis: true``: the weight
``clamp(exp(clamp(l^old − l^rollout, ±20)), max=tis_imp_ratio_cap)`` times the (dual-)clipped
surrogate (refppo ``rollout_is=token, rollout_is_mode=truncate, rollout_is_high=cap``);
``compute_policy_loss_cispo`` (``policy_loss_type: cispo``, ``cispo_eps_clip_low/high``; refppo
``policy_loss=cispo, log_ratio_clamp=20``). The rest of the step is :func:`peers.makers.skyrl._skyrl_step`
(SkyRL's KL, GAE, critic loss, the loss sum of ``worker.py``) with the policy loss replaced by these
calls (the rollout log-probs passed, the gradient ``grad_logprobs`` taken by autograd through
SkyRL's function; v2, one rank). float32. Behaviour log-probs ``l^old − 0.6·N(0, 1)``.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

from peers.makers.common import HP, inputs, install_stubs, mount, save
from peers.makers.skyrl import REDUCTION_TO_REFPPO, _loss_config, _skyrl_step

# (name, policy_loss_type, loss_reduction, eps_low, eps_high, tis cap or None)
CASES: list[tuple[str, str, str, float, float, float | None]] = [
    ("regular_tis2_token_mean", "regular", "token_mean", 0.2, 0.2, 2.0),
    ("dual_clip_tis1.5_sequence_mean", "dual_clip", "sequence_mean", 0.2, 0.28, 1.5),
    ("cispo_token_mean", "cispo", "token_mean", 0.2, 0.2, None),
    ("cispo_sequence_mean_asym", "cispo", "sequence_mean", 0.1, 0.3, None),
]


def _peer(pu: Any, rollout: Any, grads: dict[str, Any]) -> Any:
    """``pu`` with ``ppo_policy_loss`` calling the configured policy loss with the rollout log-probs
    on a leaf copy of the current log-probs (its gradient into ``grads``)."""
    import torch

    def policy_loss(log_probs: Any, old: Any, adv: Any, cfg: Any, loss_mask: Any) -> Any:
        lp = log_probs.clone().requires_grad_(True)
        fn = pu.compute_policy_loss_cispo if cfg.policy_loss_type == "cispo" else pu.ppo_policy_loss
        loss, clip_ratio = fn(lp, old, adv, cfg, loss_mask=loss_mask, rollout_logprobs=rollout)
        (grads["grad_logprobs"],) = torch.autograd.grad(loss, (lp,))
        return loss.detach(), clip_ratio

    names = {
        n: getattr(pu, n) for n in ("compute_approx_kl", "compute_gae_advantage_return", "ppo_critic_loss")
    }
    return types.SimpleNamespace(**names, masked_mean=pu.masked_mean, ppo_policy_loss=policy_loss)


def make(out: Path) -> list[str]:
    import torch
    from omegaconf import OmegaConf  # type: ignore[import-not-found]  # side venv only

    install_stubs()
    mount("skyrl_train")
    mount("skyrl_train.utils")
    from skyrl_train.utils import ppo_utils as pu  # type: ignore[import-not-found]  # side venv only

    made = []
    for i, (name, plt, red, lo, hi, cap) in enumerate(CASES):
        x = inputs(600 + i, dtype=torch.float32)
        m = x["response_mask"]
        g = torch.Generator().manual_seed(650 + i)
        beh = x["old_logprobs"] - 0.6 * torch.randn(m.shape, generator=g, dtype=torch.float32)
        x["rollout_logprobs"] = torch.where(m.bool(), beh, torch.full_like(beh, 7.5))
        cfg = OmegaConf.merge(
            _loss_config(red, m.shape[1], plt, lo, hi),
            {"use_tis": cap is not None, "tis_imp_ratio_cap": cap or 1.0,
             "cispo": {"cispo_eps_clip_low": lo, "cispo_eps_clip_high": hi}},
        )  # fmt: skip
        grads: dict[str, Any] = {}
        dump = _skyrl_step(_peer(pu, x["rollout_logprobs"], grads), cfg, x, "k1", "reward", 0.0)
        dump.update(
            grad_logprobs=torch.where(m.bool(), grads["grad_logprobs"], 0.0), grad_values=torch.zeros_like(m)
        )
        hp = dict(HP, cliprange=lo, ent_coef=0.0, world_size=1, micro_batches=1)
        if hi != lo:
            hp["cliprange_high"] = hi
        conv: dict[str, Any] = {"kl_estimator": "k1", "kl_in": "reward", "loss_agg": REDUCTION_TO_REFPPO[red]}
        if plt == "dual_clip":
            conv["dual_clip"] = 1.5
        if plt == "cispo":
            conv.update(policy_loss="cispo", dual_clip="none", log_ratio_clamp=20.0)
            control: dict[str, Any] = {"policy_loss": "vanilla"}
        else:
            conv.update(rollout_is="token", rollout_is_mode="truncate", rollout_is_high=cap)
            control = {"rollout_is_mode": "mask"}
        made.append(save(out, f"skyrl_{name}", dump, hp, conv, control))
    return made
