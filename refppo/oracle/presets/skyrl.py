"""``--preset skyrl``: SkyRL-train 0.3.1's PPO step with a critic (``advantage_estimator: gae``),
and its critic-free estimators.

Files under ``skyrl_train/``: ``utils/ppo_utils.py`` (compute_approx_kl,
compute_gae_advantage_return, masked_whiten, ppo_policy_loss, reduce_loss, ppo_critic_loss, the
group estimators), ``trainer.py`` (apply_reward_kl_penalty, postprocess_generator_output),
``workers/worker.py`` (PolicyWorkerBase._forward_backward_micro: KL loss, entropy), the defaults in
``config/ppo_base_config.yaml``. Validated against the installed code by
``tools/peers presets``; spelled out in spec/conventions.md.
"""

from __future__ import annotations

from refppo.oracle.presets.base import Preset, Sourced, Variant, make_preset
from refppo.oracle.presets.kl_clamps import verl_kl_clamps

_U = "skyrl_train/utils/ppo_utils.py"
_YAML = "skyrl_train/config/ppo_base_config.yaml"
_WORKER = "skyrl_train/workers/worker.py::PolicyWorkerBase._forward_backward_micro"

CONVENTIONS: dict[str, Sourced] = {
    "kl_estimator": ("k3", f"{_YAML} (algorithm.kl_estimator_type: k3)"),
    "kl_in": ("loss", f"{_YAML} (algorithm.use_kl_loss: true, use_kl_in_reward: false)"),
    "score_at": (
        "last_valid",
        "skyrl_train/trainer.py::postprocess_generator_output (per_token_reward[-1] = reward)",
    ),
    # compute_gae_advantage_return always ends with masked_whiten (unbiased, rsqrt(var + 1e-8))
    "whiten_advantages": ("masked", f"{_U}::compute_gae_advantage_return (masked_whiten of A)"),
    "whiten_variance": ("unbiased", f"{_U}::masked_whiten (unbiased variance)"),
    "whiten_eps_at": ("variance", f"{_U}::masked_whiten (rsqrt(var + 1e-8))"),
    "whiten_rewards": ("none", f"{_U}::compute_gae_advantage_return (rewards as given)"),
    "gae_padding": (
        "through",
        f"{_U}::compute_gae_advantage_return (every position, the critic's values as given)",
    ),
    # multi-turn (loss_mask zero on observation tokens): GAE and masked_whiten get the right-padded
    # response_mask, the losses loss_mask (run: tools/peers/makers/holes.py::skyrl_cases)
    "gae_holes": (
        "through",
        "skyrl_train/trainer.py::compute_advantages_and_returns (response_mask, not loss_mask)",
    ),
    "whiten_holes": ("include", f"{_U}::masked_whiten (moments over response_mask)"),
    # sequence_mean = seq-mean-token-mean, seq_mean_token_sum_norm = seq-mean-token-sum-norm (H = max_seq_len)
    "loss_agg": ("token-mean", f"{_U}::reduce_loss (algorithm.loss_reduction: token_mean)"),
    "value_loss_agg": (
        "seq-mean-token-mean",
        f"{_U}::ppo_critic_loss (masked_mean(loss, mask, dim=-1).mean())",
    ),
    "value_loss": ("clipped", f"{_U}::ppo_critic_loss (algorithm.value_clip: 0.2)"),
    "value_clip_form": ("delta", f"{_U}::ppo_critic_loss (V_old + clamp(V − V_old, ±ε_v))"),
    "dual_clip": (None, f"{_YAML} (algorithm.policy_loss_type: regular; dual_clip uses clip_ratio_c = 3)"),
    "log_ratio_clamp": (20.0, f"{_U}::_safe_exp_delta (log_probs − old_log_probs, clip=20.0)"),
    "score_clip": (None, "skyrl_train/trainer.py::postprocess_generator_output (the reward as given)"),
    "approx_kl": ("k1", f"{_U}::ppo_policy_loss (logs no approx_kl: refppo's default)"),
    "vf_mask": ("value", f"{_U}::ppo_critic_loss (loss_mask)"),
    "kl_loss_agg": ("seq-mean-token-mean", f"{_WORKER} (masked_mean(kl, mask, dim=-1).mean())"),
    "entropy_agg": ("token-mean", f"{_WORKER} (masked_mean(entropy, mask))"),
}

HPARAMS: dict[str, Sourced] = {
    "gamma": (1.0, f"{_YAML} (algorithm.gamma)"),
    "lam": (1.0, f"{_YAML} (algorithm.lambd)"),
    "kl_coef": (0.001, f"{_YAML} (algorithm.kl_loss_coef)"),
    "cliprange": (0.2, f"{_YAML} (algorithm.eps_clip_low = eps_clip_high = 0.2)"),
    "cliprange_value": (0.2, f"{_YAML} (algorithm.value_clip)"),
    "vf_coef": (0.0, "skyrl_train/workers/worker.py (the critic worker has its own optimizer and loss)"),
    "ent_coef": (0.0, f"{_YAML} (algorithm.use_entropy_loss: false)"),
}

PRESET: Preset = make_preset(
    "skyrl",
    CONVENTIONS,
    HPARAMS,
    verl_kl_clamps,
    (
        "skyrl_train/utils/ppo_utils.py::compute_approx_kl (k3: log-ratio and value clamps as verl)",
        "skyrl_train/trainer.py::RayPPOTrainer.apply_reward_kl_penalty",
        "skyrl_train/trainer.py::RayPPOTrainer.postprocess_generator_output (score at the last token)",
        "skyrl_train/utils/ppo_utils.py::compute_gae_advantage_return (through padding; masked_whiten)",
        "skyrl_train/utils/ppo_utils.py::masked_whiten",
        "skyrl_train/utils/ppo_utils.py::ppo_policy_loss",
        "skyrl_train/utils/ppo_utils.py::reduce_loss",
        "skyrl_train/utils/ppo_utils.py::ppo_critic_loss (delta clip form, per-row mean)",
        "skyrl_train/workers/worker.py::PolicyWorkerBase (KL loss per row, entropy token-mean)",
        "skyrl_train/config/ppo_base_config.yaml (defaults)",
    ),
)

# ---- critic-free: algorithm.advantage_estimator grpo (dr-grpo: grpo_norm_by_std=false), rloo, reinforce++
_GROUP: Variant = {
    "whiten_advantages": ("none", f"{_U}::compute_grpo_outcome_advantage (no whitening)"),
    "group_std": ("unbiased", f"{_U}::compute_grpo_outcome_advantage (torch.std)"),
    "group_eps": (1e-6, f"{_U}::compute_grpo_outcome_advantage (epsilon=1e-6)"),
    "group_singleton": ("score", f"{_U}::compute_grpo_outcome_advantage (one response: mean 0, std 1)"),
    "group_kl": ("fold", f"{_U}::compute_grpo_outcome_advantage (scores = token_level_rewards.sum(-1))"),
}

CRITIC_FREE: dict[str, Variant] = {
    "grpo": _GROUP,
    "dr-grpo": {
        **_GROUP,
        "whiten_advantages": ("none", f"{_U}::compute_grpo_outcome_advantage(grpo_norm_by_std=False)"),
    },
    "rloo": {
        **_GROUP,
        "group_singleton": ("zero", f"{_U}::compute_rloo_outcome_advantage (one response: 0)"),
    },
    "reinforce++": {
        "whiten_advantages": ("masked", f"{_U}::compute_reinforce_plus_plus_outcome_advantage"),
        "whiten_variance": ("unbiased", f"{_U}::masked_whiten (unbiased variance)"),
        "whiten_eps_at": ("variance", f"{_U}::masked_whiten (rsqrt(var + 1e-8))"),
    },
}
"""``advantage -> {key: (value, source)}``."""

__all__ = ["CONVENTIONS", "CRITIC_FREE", "HPARAMS", "PRESET"]
