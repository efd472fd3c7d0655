"""``--preset skyrl04``: SkyRL 0.4.0's PPO step (the ``skyrl`` package, successor of skyrl-train
0.3.1, :mod:`refppo.oracle.presets.skyrl`), with a critic (``advantage_estimator: gae``), and its
critic-free estimators.

Files under ``skyrl/``: ``backends/skyrl_train/utils/ppo_utils.py`` (compute_approx_kl,
compute_gae_advantage_return, masked_whiten, ppo_policy_loss, reduce_loss,
apply_loss_reduction_to_advantages_minibatch, ppo_critic_loss, the group estimators),
``train/trainer.py`` (apply_reward_kl_penalty, postprocess_generator_output,
RayPPOTrainer._normalize_advantages), ``backends/skyrl_train/workers/worker.py``
(``_forward_backward_micro``: the KL loss, the entropy, the loss sum), the defaults in
``train/config/config.py::AlgorithmConfig`` (a dataclass: 0.4.0 ships no yaml).

What changed since 0.3.1 (read in the installed source): the loss reduction moved out of the
policy loss. ``_normalize_advantages`` scales each mini-batch's advantages
(``apply_loss_reduction_to_advantages_minibatch``: ``token_mean`` by ``1/Σ mask`` of the whole
mini-batch, ``sequence_mean`` by ``1/(B·n_b)``, ``seq_mean_token_sum_norm`` by ``1/(B·max_seq_len)``,
new ``prompt_mean`` by ``1/(P·N_p)``) and ``ppo_policy_loss`` sums ``loss·mask``; the worker
multiplies the policy loss by the data-parallel size (undoing DDP's mean) and the KL and entropy
terms by ``len(micro-batch)/len(mini-batch)``. So ``token_mean`` is now the token mean of the whole
mini-batch across micro-batches and ranks (0.3.1: the mean of per-micro-batch token means, kept as
``token_mean_legacy``, a per-micro-batch normaliser here). The estimators, KL, whitening, clips and
the critic loss are unchanged; the KL mask is applied by ``torch.where`` (no NaN leak from padding;
equal on finite inputs). Validated against the installed code by ``tools/peers/makers/skyrl04.py``
(``tests/peers/test_peer_skyrl04.py``); spelled out in spec/conventions.md.
"""

from __future__ import annotations

from refppo.oracle.presets.base import Preset, Sourced, Variant, make_preset
from refppo.oracle.presets.kl_clamps import verl_kl_clamps

_U = "skyrl/backends/skyrl_train/utils/ppo_utils.py"
_CFG = "skyrl/train/config/config.py::AlgorithmConfig"
_TR = "skyrl/train/trainer.py"
_WORKER = "skyrl/backends/skyrl_train/workers/worker.py::PolicyWorkerBase._forward_backward_micro"
_RED = f"{_U}::apply_loss_reduction_to_advantages_minibatch"

CONVENTIONS: dict[str, Sourced] = {
    "kl_estimator": ("k3", f"{_CFG} (kl_estimator_type: k3)"),
    "kl_in": ("loss", f"{_CFG} (use_kl_loss: True, use_kl_in_reward: False)"),
    "score_at": (
        "last_valid",
        f"{_TR}::RayPPOTrainer.postprocess_generator_output (per_token_reward[-1] = reward)",
    ),
    "whiten_advantages": ("masked", f"{_U}::compute_gae_advantage_return (masked_whiten of A)"),
    "whiten_variance": ("unbiased", f"{_U}::masked_var (unbiased=True: Bessel)"),
    "whiten_eps_at": ("variance", f"{_U}::masked_whiten (rsqrt(var + 1e-8))"),
    "whiten_rewards": ("none", f"{_U}::compute_gae_advantage_return (rewards as given)"),
    "gae_padding": (
        "through",
        f"{_U}::compute_gae_advantage_return (every position, the critic's values as given)",
    ),
    "gae_holes": (
        "through",
        f"{_TR}::RayPPOTrainer.compute_advantages_and_returns (response_mask, not loss_mask)",
    ),
    "whiten_holes": ("include", f"{_U}::masked_whiten (moments over response_mask)"),
    "loss_agg": (
        "token-mean",
        f"{_RED} (token_mean: A / Σ mask of the mini-batch) + reduce_loss (Σ loss·mask)",
    ),
    "value_loss_agg": (
        "seq-mean-token-mean",
        f"{_U}::ppo_critic_loss (masked_mean(loss, mask, dim=-1).mean())",
    ),
    "value_loss": ("clipped", f"{_CFG} (value_clip: 0.2) and {_U}::ppo_critic_loss"),
    "value_clip_form": (
        "delta",
        f"{_U}::ppo_critic_loss (old_values + clamp(values − old_values, ±value_clip))",
    ),
    "dual_clip": (None, f"{_CFG} (policy_loss_type: regular; dual_clip uses clip_ratio_c = 3.0)"),
    "log_ratio_clamp": (
        20.0,
        f"{_U}::ppo_policy_loss (safe_exp_delta(log_probs − old_log_probs, clip=20.0))",
    ),
    "score_clip": (None, f"{_TR}::RayPPOTrainer.postprocess_generator_output (the reward as given)"),
    "approx_kl": ("k1", f"{_U}::ppo_policy_loss (logs no approx_kl: refppo's default)"),
    "vf_mask": ("value", f"{_U}::ppo_critic_loss (loss_mask)"),
    "kl_loss_agg": (
        "seq-mean-token-mean",
        f"{_WORKER} (masked_mean(kl, loss_mask, dim=-1).mean() × microbatch_weight)",
    ),
    "entropy_agg": ("token-mean", f"{_WORKER} (masked_mean(entropy, loss_mask) × microbatch_weight)"),
}

HPARAMS: dict[str, Sourced] = {
    "gamma": (1.0, f"{_CFG} (gamma)"),
    "lam": (1.0, f"{_CFG} (lambd)"),
    "kl_coef": (0.001, f"{_CFG} (kl_loss_coef)"),
    "cliprange": (0.2, f"{_CFG} (eps_clip_low = eps_clip_high = 0.2)"),
    "cliprange_value": (0.2, f"{_CFG} (value_clip)"),
    "vf_coef": (
        0.0,
        "skyrl/backends/skyrl_train/workers/worker.py (the critic worker has its own optimizer and loss)",
    ),
    "ent_coef": (0.0, f"{_CFG} (use_entropy_loss: False)"),
}

PRESET: Preset = make_preset(
    "skyrl04",
    CONVENTIONS,
    HPARAMS,
    verl_kl_clamps,
    (
        f"{_U}::compute_approx_kl (k3: log-ratio and value clamps as verl)",
        f"{_TR}::RayPPOTrainer.apply_reward_kl_penalty",
        f"{_TR}::RayPPOTrainer.postprocess_generator_output (score at the last token)",
        f"{_TR}::RayPPOTrainer._normalize_advantages (the loss reduction per mini-batch)",
        f"{_U}::compute_gae_advantage_return (through padding; masked_whiten)",
        f"{_U}::masked_whiten",
        f"{_U}::ppo_policy_loss",
        _RED,
        f"{_U}::reduce_loss (a sum)",
        f"{_U}::ppo_critic_loss (delta clip form, per-row mean)",
        f"{_WORKER} (policy loss × dp_size; KL loss per row and entropy token-mean × microbatch_weight)",
        f"{_CFG} (defaults)",
    ),
)

# ---- critic-free: algorithm.advantage_estimator grpo (the default; dr-grpo: grpo_norm_by_std=False),
# rloo, reinforce++
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
"""``advantage -> {key: (value, source)}``. Not here: ``maxrl`` (new in 0.4.0) and the optional
``advantage_batch_normalize`` (off by default; spec/conventions.md)."""

__all__ = ["CONVENTIONS", "CRITIC_FREE", "HPARAMS", "PRESET"]
