"""``--preset trl``: TRL's PPOTrainer (the ppov2 lineage, 0.9.6–1.12), and the critic-free variants
of its GRPOTrainer (TRL 1.12.0 and 1.16.0).

PPO: ``trl/trainer/ppo_trainer.py::PPOTrainer.train`` (``ppov2_trainer.py`` in 0.9–0.11;
``trl/experimental/ppo/ppo_trainer.py`` from 0.26), ``trl/core.py::masked_whiten`` (later
``trl/trainer/utils.py``), the defaults in ``PPOConfig``. Validated against TRL 1.12.0's own
``PPOTrainer.train`` by ``tools/peers presets --venv trl``, the GRPO variants by
``tools/peers grpo_peers``; spelled out in spec/conventions.md.
"""

from __future__ import annotations

from refppo.oracle.presets.base import Preset, Sourced, Variant, make_preset
from refppo.oracle.presets.kl_clamps import no_kl_clamps

_TRAIN = "trl/trainer/ppo_trainer.py::PPOTrainer.train"
_CONFIG = "trl/trainer/ppo_config.py::PPOConfig (trl/experimental/ppo/ppo_config.py in 1.12)"

CONVENTIONS: dict[str, Sourced] = {
    "kl_estimator": ("k1", f"{_TRAIN} (kl_estimator: k1; k3 since 0.17)"),
    "kl_in": ("reward", f"{_TRAIN} (non_score_reward = −β·KL in the rewards)"),
    "score_at": ("after_last_valid", f"{_TRAIN} (the score at seq_len + 1 when it exists)"),
    "whiten_advantages": ("masked", "trl/core.py::masked_whiten (advantages over ~padding_mask)"),
    "whiten_variance": ("unbiased", "trl/core.py::masked_var (unbiased)"),
    "loss_agg": ("token-mean", f"{_TRAIN} (masked_mean per micro-batch)"),
    "value_loss_agg": (None, f"{_TRAIN} (masked_mean as the policy loss)"),
    "value_loss": ("clipped", f"{_TRAIN} (½·max of the clipped and unclipped squares)"),
    "value_clip_form": ("around_old", f"{_TRAIN} (torch.clamp(vpred, mb_values − ε_v, mb_values + ε_v))"),
    "dual_clip": (None, f"{_TRAIN} (no dual clip)"),
    "log_ratio_clamp": (None, f"{_TRAIN} (exp(logprobs − mb_logprobs), no clamp)"),
    "score_clip": (None, f"{_TRAIN} (the reward model's score as is)"),
    "approx_kl": ("k2_all_positions", f"{_TRAIN} (approxkl = 0.5·mean((l − l_old)²) over all positions)"),
    "vf_mask": ("value", f"{_TRAIN} (masked over ~padding_mask_p1)"),
    "whiten_eps_at": ("variance", "trl/core.py::masked_whiten (rsqrt(var + 1e-8))"),
    # whiten_rewards=True is --set whiten_rewards=masked_no_shift
    "whiten_rewards": ("none", f"{_CONFIG} (whiten_rewards=False)"),
    "gae_padding": ("masked", f"{_TRAIN} (values zeroed after seq_len + 1)"),
    # no multi-turn PPO path: refppo's defaults (not validated with holes)
    "gae_holes": ("skip", f"{_TRAIN} (no multi-turn path: refppo's default)"),
    "whiten_holes": ("exclude", f"{_TRAIN} (no multi-turn path: refppo's default)"),
    "kl_loss_agg": (None, f"{_TRAIN} (no KL loss)"),
    "entropy_agg": (None, f"{_TRAIN} (no entropy loss)"),
}

HPARAMS: dict[str, Sourced] = {
    "gamma": (1.0, f"{_CONFIG} (gamma)"),
    "lam": (0.95, f"{_CONFIG} (lam)"),
    "kl_coef": (0.05, f"{_CONFIG} (kl_coef)"),
    "cliprange": (0.2, f"{_CONFIG} (cliprange)"),
    "cliprange_value": (0.2, f"{_CONFIG} (cliprange_value)"),
    "vf_coef": (0.1, f"{_CONFIG} (vf_coef)"),
    "ent_coef": (0.0, f"{_TRAIN} (no entropy term in the loss)"),
}

PRESET: Preset = make_preset(
    "trl",
    CONVENTIONS,
    HPARAMS,
    no_kl_clamps,
    (
        "trl/trainer/ppo_trainer.py::PPOTrainer.train (ppov2_trainer.py in 0.9-0.11; "
        "trl/experimental/ppo/ppo_trainer.py from 0.26)",
        "trl/core.py::masked_whiten",
    ),
)

# ---- critic-free: the GRPO trainer, not the PPOTrainer above: β·k3 KL of the current policy in
# the loss (TRL 1.12.0 and 1.16.0 alike; run: tools/peers/makers/trl_grpo.py)
_GRPO = "trl/trainer/grpo_trainer.py::GRPOTrainer"
_GRPO_ADV = f"{_GRPO}._generate_and_score_completions"
_GROUP: Variant = {
    "kl_in": ("loss", f"{_GRPO}._compute_loss (per_token_loss + beta·per_token_kl)"),
    "kl_estimator": ("k3", f"{_GRPO}._compute_loss (exp(ref − logp) − (ref − logp) − 1)"),
    "whiten_advantages": ("none", f"{_GRPO_ADV} (no batch whitening after the group scaling)"),
    "group_std": ("unbiased", "trl/trainer/utils.py::nanstd (Bessel: count/(count − 1))"),
    "group_eps": (1e-4, f"{_GRPO_ADV} (advantages / (std_rewards + 1e-4))"),
    # scale_rewards="group" (default); "batch": --set group_std_level=batch (nanstd(rewards) over the
    # whole batch around its mean, the mean still per group).
    "group_std_level": ("group", f"{_GRPO_ADV} (scale_rewards='group': nanstd(rewards.view(-1, n), dim=1))"),
    # num_generations = 1 (eval only): std_rewards = 0 and r − mean = 0, so 0/(0 + 1e-4) = 0.
    "group_singleton": ("zero", f"{_GRPO_ADV} (num_generations = 1: std 0, advantage 0)"),
    # The score enters as is (one reward function, weight 1); β acts in the loss, not the reward.
    "group_kl": ("to_go", f"{_GRPO_ADV} (rewards = Σ_k w_k·reward_k; no KL in the reward)"),
    # GRPOConfig.loss_type default "dapo": Σ loss·mask / num_items_in_batch (one process: token-mean).
    "loss_agg": ("token-mean", "trl/trainer/grpo_config.py::GRPOConfig.loss_type (default dapo)"),
    "log_ratio_clamp": (None, f"{_GRPO}._compute_loss (exp(log_ratio), no clamp)"),
    "dual_clip": (None, "trl/trainer/grpo_config.py::GRPOConfig.delta (default None)"),
    # the logged kl is a token mean whatever loss_type aggregates the β·k3 term with
    # (run: tools/peers/makers/trl_grpo_kl_metric.py, TRL 1.16.0)
    "kl_metric_agg": (
        "token-mean",
        f"{_GRPO}._compute_loss (_metrics['kl'] = global_masked_mean(per_token_kl))",
    ),
    # loss_type="cispo" logs cispo_clip_ratio: ρ > epsilon_high on A > 0 only (the clipped
    # surrogate's clip_ratio/region_mean is L2 > L1, the same as all; run: tools/peers/makers/trl_cispo.py)
    "clipfrac_counts": (
        "by_advantage",
        f"{_GRPO}._compute_loss (cispo_clip_ratio: (coef_1 > epsilon_high) & (advantages > 0), masked mean)",
    ),
}

CRITIC_FREE: dict[str, Variant] = {
    "grpo": _GROUP,
    "dr-grpo": {
        **_GROUP,
        "whiten_advantages": ("none", f"{_GRPO_ADV} (scale_rewards='none' / False: r − mean only)"),
    },
}
"""``advantage -> {key: (value, source)}``."""

__all__ = ["CONVENTIONS", "CRITIC_FREE", "HPARAMS", "PRESET"]
