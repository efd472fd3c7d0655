"""``--preset deepspeed-chat``: DeepSpeed-Chat's PPO step (microsoft/DeepSpeedExamples
``applications/DeepSpeed-Chat/dschat/rlhf/ppo_trainer.py`` @3b45859: DeepSpeedPPOTrainer's
compute_rewards, get_advantages_and_returns, actor_loss_fn, critic_loss_fn; the defaults set in its
``__init__``). Spelled out in spec/conventions.md.
"""

from __future__ import annotations

from refppo.oracle.presets.base import Preset, Sourced, make_preset
from refppo.oracle.presets.kl_clamps import no_kl_clamps

_T = "dschat/rlhf/ppo_trainer.py::DeepSpeedPPOTrainer"

CONVENTIONS: dict[str, Sourced] = {
    "kl_estimator": ("k1", f"{_T}.compute_rewards (−β·(log π − log π_ref))"),
    "kl_in": ("reward", f"{_T}.compute_rewards"),
    "score_at": ("after_last_valid", f"{_T}.compute_rewards (ends = start + n + 1)"),
    "score_slot_kl": (
        "kl",
        f"{_T}.compute_rewards (rewards = −β·(log π − log π_ref) everywhere; "
        "rewards[j, start:ends[j]][−1] += score: the slot keeps its own −β·KL)",
    ),
    "whiten_advantages": ("none", f"{_T}.get_advantages_and_returns (advantages not whitened)"),
    "whiten_variance": ("unbiased", f"{_T}.get_advantages_and_returns (no whitening: refppo's default)"),
    "loss_agg": ("token-mean", f"{_T}.actor_loss_fn (sum(loss·mask) / sum(mask))"),
    "value_loss_agg": (None, f"{_T}.critic_loss_fn (token-mean, as the policy loss)"),
    "value_loss": ("clipped", f"{_T}.critic_loss_fn (½·max of the clipped and unclipped squares)"),
    "value_clip_form": ("around_old", f"{_T}.critic_loss_fn (torch.clamp(values, old_values ± ε_v))"),
    "dual_clip": (None, f"{_T}.actor_loss_fn (no dual clip)"),
    "log_ratio_clamp": (None, f"{_T}.actor_loss_fn (exp((l − l_old)·mask), no clamp)"),
    "score_clip": (5.0, f"{_T}.compute_rewards (clip_reward_value = 5, set in __init__)"),
    "approx_kl": ("k1", f"{_T}.actor_loss_fn (not logged by DeepSpeed-Chat: refppo's default)"),
    "vf_mask": ("response", f"{_T}.critic_loss_fn (action_mask, not the score slot)"),
    "whiten_eps_at": ("variance", f"{_T}.get_advantages_and_returns (no whitening: refppo's default)"),
    "whiten_rewards": ("none", f"{_T}.compute_rewards (rewards not whitened)"),
    "gae_padding": ("masked", f"{_T}.get_advantages_and_returns (r, V zeroed from ends)"),
    # no multi-turn path: refppo's defaults (not validated with holes)
    "gae_holes": ("skip", f"{_T}.get_advantages_and_returns (no multi-turn path: refppo's default)"),
    "whiten_holes": ("exclude", f"{_T}.get_advantages_and_returns (no multi-turn path: refppo's default)"),
    "kl_loss_agg": (None, f"{_T}.actor_loss_fn (no KL loss)"),
    "entropy_agg": (None, f"{_T}.actor_loss_fn (no entropy loss)"),
}

HPARAMS: dict[str, Sourced] = {
    "gamma": (1.0, f"{_T}.__init__ (self.gamma = 1.0)"),
    "lam": (0.95, f"{_T}.__init__ (self.lam = 0.95)"),
    "kl_coef": (0.1, f"{_T}.__init__ (self.kl_ctl = 0.1)"),
    "cliprange": (0.2, f"{_T}.__init__ (self.cliprange = 0.2)"),
    "cliprange_value": (0.2, f"{_T}.__init__ (self.cliprange_value = 0.2)"),
    "vf_coef": (0.0, f"{_T}.train_rlhf (actor and critic losses through their own engines)"),
    "ent_coef": (0.0, f"{_T}.actor_loss_fn (no entropy term)"),
}

PRESET: Preset = make_preset(
    "deepspeed-chat",
    CONVENTIONS,
    HPARAMS,
    no_kl_clamps,
    (
        "dschat/rlhf/ppo_trainer.py::DeepSpeedPPOTrainer.compute_rewards",
        "dschat/rlhf/ppo_trainer.py::DeepSpeedPPOTrainer.get_advantages_and_returns",
        "dschat/rlhf/ppo_trainer.py::DeepSpeedPPOTrainer.actor_loss_fn",
        "dschat/rlhf/ppo_trainer.py::DeepSpeedPPOTrainer.critic_loss_fn",
    ),
)

__all__ = ["CONVENTIONS", "HPARAMS", "PRESET"]
