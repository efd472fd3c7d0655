"""``--preset openrlhf``: OpenRLHF 0.11.2's PPO step with a critic, and its critic-free estimators.

Files under ``openrlhf/``: ``models/utils.py`` (compute_approx_kl, compute_reward),
``trainer/ppo_utils/experience_maker.py`` (get_advantages_and_returns,
compute_advantages_and_returns), ``models/loss.py`` (PolicyLoss, ValueLoss, aggregate_loss), the
defaults in ``cli/train_ppo_ray.py``. Validated against the installed code by
``tools/peers presets``; spelled out in spec/conventions.md.
"""

from __future__ import annotations

from refppo.oracle.presets.base import Preset, Sourced, Variant, make_preset
from refppo.oracle.presets.kl_clamps import openrlhf_kl_clamps

_LOSS = "openrlhf/models/loss.py"
_EXP = "openrlhf/trainer/ppo_utils/experience_maker.py"
_CLI = "openrlhf/cli/train_ppo_ray.py"

CONVENTIONS: dict[str, Sourced] = {
    "kl_estimator": ("k1", "openrlhf/models/utils.py::compute_approx_kl (--algo.kl.estimator k1)"),
    "kl_in": ("reward", f"{_EXP}::make_experience (compute_reward adds −β·KL; --algo.kl.use_loss off)"),
    "score_at": ("last_valid", "openrlhf/models/utils.py::compute_reward (last index with action_mask = 1)"),
    "whiten_advantages": ("masked", f"{_EXP}::compute_advantages_and_returns (batch whitening of A)"),
    "whiten_variance": ("population", f"{_EXP}::compute_advantages_and_returns (var = Σ (A − μ)² m / Σ m)"),
    "loss_agg": ("token-mean", f"{_LOSS}::aggregate_loss (token_level_loss=True)"),
    # the critic builds ValueLoss(value_clip): token_level_loss stays True whatever actor.loss_agg_mode
    "value_loss_agg": (
        "token-mean",
        f"{_LOSS}::ValueLoss; openrlhf/trainer/ray/ppo_critic.py (ValueLoss(value_clip))",
    ),
    "value_loss": ("clipped", f"{_LOSS}::ValueLoss (½·max of the clipped and unclipped squares)"),
    "value_clip_form": ("delta", f"{_LOSS}::ValueLoss (old_values + (values − old_values).clamp(±ε_v))"),
    "dual_clip": (None, f"{_LOSS}::PolicyLoss (--actor.dual_clip off by default)"),
    "log_ratio_clamp": (20.0, f"{_LOSS}::PolicyLoss (log_ratio.clamp(−20, 20))"),
    "score_clip": (10.0, f"openrlhf/models/utils.py::compute_reward ({_CLI}: --reward.clip_range −10 10)"),
    "approx_kl": ("k1", f"{_LOSS}::PolicyLoss (ppo_kl)"),
    "vf_mask": ("value", f"{_LOSS}::ValueLoss (action_mask)"),
    "whiten_eps_at": (
        "clamp",
        f"{_EXP}::compute_advantages_and_returns ((A − μ)·clamp(var, min=1e-8).rsqrt())",
    ),
    "whiten_rewards": ("none", f"{_EXP}::compute_advantages_and_returns (rewards as shaped)"),
    "gae_padding": ("masked", f"{_EXP}::get_advantages_and_returns (values, rewards × action_mask)"),
    # agent mode: action_mask zero on environment feedback (run: tools/peers/makers/holes.py::openrlhf_cases)
    "gae_holes": (
        "zero",
        f"{_EXP}::get_advantages_and_returns (recursion over every position, holes zeroed)",
    ),
    "whiten_holes": ("exclude", f"{_EXP}::compute_advantages_and_returns (moments over action_mask)"),
    "kl_loss_agg": (
        "token-mean",
        "openrlhf/trainer/ray/ppo_actor.py::training_step (aggregate_loss, token-level)",
    ),
    "entropy_agg": (
        "token-mean",
        "openrlhf/trainer/ray/ppo_actor.py::training_step (aggregate_loss, token-level)",
    ),
}

HPARAMS: dict[str, Sourced] = {
    "gamma": (1.0, f"{_CLI} (--algo.advantage.gamma 1)"),
    "lam": (1.0, f"{_CLI} (--algo.advantage.lambd 1)"),
    "kl_coef": (0.01, f"{_CLI} (--algo.kl.init_coef 0.01)"),
    "cliprange": (0.2, f"{_CLI} (--actor.eps_clip 0.2)"),
    "cliprange_value": (0.5, f"{_CLI} (--critic.value_clip 0.5)"),
    "vf_coef": (0.0, "openrlhf/trainer/ray/ppo_critic.py (the critic has its own optimizer and loss)"),
    "ent_coef": (0.0, f"{_CLI} (--actor.entropy_coef None: no entropy loss)"),
}

PRESET: Preset = make_preset(
    "openrlhf",
    CONVENTIONS,
    HPARAMS,
    openrlhf_kl_clamps,
    (
        "openrlhf/models/utils.py::compute_approx_kl",
        "openrlhf/models/utils.py::compute_reward",
        "openrlhf/trainer/ppo_utils/experience_maker.py::get_advantages_and_returns",
        "openrlhf/trainer/ppo_utils/experience_maker.py::compute_advantages_and_returns",
        "openrlhf/models/loss.py::PolicyLoss",
        "openrlhf/models/loss.py::ValueLoss (token-mean: value_loss_agg)",
        "openrlhf/trainer/ray/ppo_critic.py (ValueLoss(value_clip), no token_level_loss)",
        "openrlhf/models/loss.py::aggregate_loss (aggregation)",
    ),
)

# ---- critic-free: --algo.advantage.estimator group_norm (grpo), dr_grpo, rloo, reinforce,
# reinforce_baseline, flash_reinforce
_ADV = f"{_EXP}::RemoteExperienceMaker.compute_advantages_and_returns"
_GROUP: Variant = {
    "whiten_advantages": ("none", f"{_ADV} (only gae, reinforce, reinforce_baseline are whitened)"),
    "group_std": ("unbiased", f"{_ADV} (rewards.std(-1))"),
    "group_eps": (1e-9, f"{_ADV} (group_norm: / (std + 1e-9))"),
    "group_singleton": ("error", "openrlhf/cli/train_ppo_ray.py (asserts n_samples_per_prompt > 1)"),
    "group_kl": ("to_go", f"{_ADV} (compute_reward(shaped reward, kl) then get_cumulative_returns)"),
    # compute_reward clamps the SHAPED reward by reward.clip_range: not the raw score (see spec).
    "score_clip": (None, "openrlhf/models/utils.py::compute_reward (clamps the shaped group reward)"),
}
_WHITENED: Variant = {
    "whiten_variance": ("population", f"{_ADV} (var = Σ (A − μ)² m / Σ m)"),
    "whiten_eps_at": ("clamp", f"{_ADV} (var.clamp(min=1e-8).rsqrt())"),
}

CRITIC_FREE: dict[str, Variant] = {
    "grpo": _GROUP,
    "dr-grpo": {**_GROUP, "group_eps": (1e-9, f"{_ADV} (dr_grpo: no std, eps unused)")},
    "rloo": _GROUP,
    "reinforce++": {
        "whiten_advantages": ("masked", f"{_ADV} (reinforce: batch whitening)"),
        **_WHITENED,
        "score_clip": (10.0, "openrlhf/models/utils.py::compute_reward (raw score, reward.clip_range ±10)"),
    },
    "reinforce++-baseline": {
        **_GROUP,
        "whiten_advantages": ("masked", f"{_ADV} (reinforce_baseline: batch whitening)"),
        **_WHITENED,
    },
    # checked against OpenRLHF's own code by tools/peers group_estimators
    "flash-reinforce": {
        **_GROUP,
        "whiten_advantages": ("none", f"{_ADV} (flash_reinforce: rewards − rewards.mean(), not whitened)"),
    },
}
"""``advantage -> {key: (value, source)}``."""

__all__ = ["CONVENTIONS", "CRITIC_FREE", "HPARAMS", "PRESET"]
