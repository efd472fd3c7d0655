"""``--preset verl``: verl 0.9.1's PPO step with a critic, and its critic-free estimators.

Files under ``verl/``: ``trainer/ppo/core_algos.py`` (kl_penalty, compute_gae_advantage_return,
compute_policy_loss_vanilla, compute_value_loss, agg_loss, the group estimators),
``utils/torch_functional.py`` (masked_whiten), ``trainer/ppo/ray_trainer.py`` (apply_kl_penalty),
the defaults in ``trainer/config/_generated_ppo_trainer.yaml``. Validated against the installed
code by ``tools/peers presets``; spelled out in spec/conventions.md.
"""

from __future__ import annotations

from refppo.oracle.presets.base import Preset, Sourced, Variant, make_preset
from refppo.oracle.presets.kl_clamps import verl_kl_clamps

_CORE = "verl/trainer/ppo/core_algos.py"
_WHITEN = "verl/utils/torch_functional.py::masked_whiten"
_YAML = "verl/trainer/config/_generated_ppo_trainer.yaml"

CONVENTIONS: dict[str, Sourced] = {
    "kl_estimator": ("k1", f"{_CORE}::kl_penalty (algorithm.kl_penalty: kl)"),
    "kl_in": ("reward", "verl/trainer/ppo/ray_trainer.py::apply_kl_penalty (KL of old vs ref in the reward)"),
    "score_at": (
        "last_valid",
        "verl/workers/reward_manager/naive.py (the score at valid_response_length − 1)",
    ),
    "whiten_advantages": ("masked", f"{_CORE}::compute_gae_advantage_return (masked_whiten of A)"),
    "whiten_variance": ("unbiased", f"{_WHITEN} (masked_var unbiased)"),
    "loss_agg": ("token-mean", f"{_CORE}::agg_loss (actor.loss_agg_mode: token-mean)"),
    # critic.loss_agg_mode is ${oc.select:actor_rollout_ref.actor.loss_agg_mode,token-mean}
    "value_loss_agg": (None, "verl/trainer/config/critic/critic.yaml (critic.loss_agg_mode = the actor's)"),
    "value_loss": ("clipped", f"{_CORE}::compute_value_loss (½·max of the clipped and unclipped squares)"),
    "value_clip_form": ("around_old", f"{_CORE}::compute_value_loss (clip_by_value(vpreds, values ± ε_v))"),
    "dual_clip": (3.0, f"{_CORE}::compute_policy_loss_vanilla (clip_ratio_c = 3, for A < 0)"),
    "log_ratio_clamp": (20.0, f"{_CORE}::compute_policy_loss_vanilla (clamp(log_ratio, −20, 20))"),
    "score_clip": (
        None,
        "verl/workers/reward_manager/naive.py (the score as the reward function returns it)",
    ),
    "approx_kl": ("k1", f"{_CORE}::compute_policy_loss_vanilla (ppo_kl: masked mean of old − new)"),
    "vf_mask": ("value", f"{_CORE}::compute_value_loss (response_mask)"),
    "whiten_eps_at": ("variance", f"{_WHITEN} (rsqrt(var + 1e-8))"),
    "whiten_rewards": ("none", f"{_CORE}::compute_gae_advantage_return (rewards as given)"),
    "gae_padding": ("masked", f"{_CORE}::compute_gae_advantage_return (masked positions skipped)"),
    # multi-turn: response_mask zero on tool-output tokens (run: tools/peers/makers/holes.py::verl_cases)
    "gae_holes": ("skip", f"{_CORE}::compute_gae_advantage_return (nextvalues, lastgaelam carried)"),
    "whiten_holes": ("exclude", f"{_WHITEN} (moments over response_mask)"),
    "kl_loss_agg": (None, "verl/workers/utils/losses.py::ppo_loss (agg_loss with actor.loss_agg_mode)"),
    "entropy_agg": (None, "verl/workers/utils/losses.py::ppo_loss (agg_loss with actor.loss_agg_mode)"),
}

HPARAMS: dict[str, Sourced] = {
    "gamma": (1.0, f"{_YAML} (algorithm.gamma)"),
    "lam": (1.0, f"{_YAML} (algorithm.lam)"),
    "kl_coef": (0.001, f"{_YAML} (algorithm.kl_ctrl.kl_coef)"),
    "cliprange": (0.2, f"{_YAML} (actor_rollout_ref.actor.clip_ratio)"),
    "cliprange_value": (0.5, f"{_YAML} (critic.cliprange_value)"),
    "vf_coef": (0.0, "verl/trainer/ppo/ray_trainer.py (the critic has its own optimizer and loss)"),
    "ent_coef": (0.0, f"{_YAML} (actor_rollout_ref.actor.entropy_coeff)"),
}

PRESET: Preset = make_preset(
    "verl",
    CONVENTIONS,
    HPARAMS,
    verl_kl_clamps,
    (
        "verl/trainer/ppo/core_algos.py::kl_penalty / kl_penalty_forward",
        "verl/trainer/ppo/ray_trainer.py::apply_kl_penalty",
        "verl/trainer/ppo/core_algos.py::compute_gae_advantage_return",
        "verl/utils/torch_functional.py::masked_whiten",
        "verl/trainer/ppo/core_algos.py::compute_policy_loss_vanilla",
        "verl/trainer/ppo/core_algos.py::compute_value_loss",
        "verl/trainer/ppo/core_algos.py::agg_loss",
        "verl/trainer/config/critic/critic.yaml (critic.loss_agg_mode = the actor's)",
    ),
)

# ---- critic-free: algorithm.adv_estimator (dr-grpo: grpo with norm_adv_by_std_in_grpo=False)
_GROUP: Variant = {
    "whiten_advantages": ("none", f"{_CORE}::compute_grpo_outcome_advantage returns scores unwhitened"),
    "group_std": ("unbiased", f"{_CORE}::compute_grpo_outcome_advantage (torch.std)"),
    "group_eps": (1e-6, f"{_CORE}::compute_grpo_outcome_advantage (epsilon=1e-6)"),
    "group_singleton": ("score", f"{_CORE}::compute_grpo_outcome_advantage (one response: mean 0, std 1)"),
    "group_kl": ("fold", f"{_CORE}::compute_grpo_outcome_advantage (scores = token_level_rewards.sum(-1))"),
}

CRITIC_FREE: dict[str, Variant] = {
    "grpo": _GROUP,
    "dr-grpo": {
        **_GROUP,
        "whiten_advantages": (
            "none",
            f"{_CORE}::compute_grpo_outcome_advantage(norm_adv_by_std_in_grpo=False)",
        ),
    },
    "rloo": {
        **_GROUP,
        "group_singleton": ("score", f"{_CORE}::compute_rloo_outcome_advantage (one response: its score)"),
    },
    "reinforce++": {
        "whiten_advantages": (
            "masked",
            f"{_CORE}::compute_reinforce_plus_plus_outcome_advantage (masked_whiten)",
        ),
        "whiten_variance": (
            "unbiased",
            "verl/utils/torch_functional.py::masked_whiten (masked_var unbiased)",
        ),
        "whiten_eps_at": ("variance", "verl/utils/torch_functional.py::masked_whiten (rsqrt(var + 1e-8))"),
    },
    "reinforce++-baseline": {
        **_GROUP,
        "whiten_advantages": (
            "masked",
            f"{_CORE}::compute_reinforce_plus_plus_baseline_outcome_advantage (masked_whiten)",
        ),
        "whiten_variance": ("unbiased", "verl/utils/torch_functional.py::masked_whiten"),
        "whiten_eps_at": ("variance", "verl/utils/torch_functional.py::masked_whiten"),
    },
    # checked against verl's own functions by tools/peers group_estimators
    "opo": {
        **_GROUP,
        "group_singleton": ("score", f"{_CORE}::compute_opo_outcome_advantage (one response: baseline 0)"),
    },
    "gpg": {
        **_GROUP,
        "group_singleton": ("score", f"{_CORE}::compute_gpg_outcome_advantage (one response: mean 0)"),
    },
    "grpo-passk": {
        **_GROUP,
        "group_singleton": ("error", f"{_CORE}::compute_grpo_passk_outcome_advantage (raises ValueError)"),
    },
}
"""``advantage -> {key: (value, source)}``."""

__all__ = ["CONVENTIONS", "CRITIC_FREE", "HPARAMS", "PRESET"]
