"""``--preset areal``: AReaL 1.0.4's PPO step with a critic, and its critic-free (GRPO-family)
estimators.

AReaL works on prompt + response with the log-probs shifted by one (``torch.roll``); in that
rolled frame its response positions are the dump's. Files under ``areal/``:
``trainer/ppo/actor.py`` (PPOActor._compute_advantages, grpo_loss_fn), ``trainer/ppo/critic.py``
(ppo_loss_fn), ``utils/functional/functional.py`` (ppo_actor_loss_fn, ppo_critic_loss_fn),
``utils/data.py`` (KLEstimator, Normalization), the defaults in ``api/cli_args.py``. Validated
against the installed code by ``tools/peers presets``; spelled out in spec/conventions.md.
"""

from __future__ import annotations

from refppo.oracle.presets.base import Preset, Sourced, Variant, make_preset
from refppo.oracle.presets.kl_clamps import areal_kl_clamps

_ACTOR = "areal/trainer/ppo/actor.py::PPOActor._compute_advantages"
_F = "areal/utils/functional/functional.py"
_ARGS = "areal/api/cli_args.py"
_NORM = "areal/utils/data.py::Normalization"

CONVENTIONS: dict[str, Sourced] = {
    "kl_estimator": ("k1", f"{_ARGS}::PPOActorConfig.kl_estimator (k1)"),
    "kl_in": ("reward", f"{_ACTOR} (−kl_ctl·KL of old vs ref in the rewards)"),
    "score_at": ("last_valid", f"{_ACTOR} (rewards[seqlens − 2] += score: the last valid token, rolled)"),
    # adv_norm {mean_level: batch, std_level: batch}: --set whiten_advantages=masked; std_level
    # null: center; mean_level null: scale
    "whiten_advantages": ("none", f"{_ARGS}::PPOActorConfig.adv_norm (default None)"),
    "whiten_variance": ("unbiased", f"{_ARGS}::NormConfig.std_unbiased (default True)"),
    "whiten_eps_at": ("std", f"{_NORM}.__call__ ((x − μ)/(σ + eps))"),
    "whiten_rewards": ("none", f"{_ACTOR} (rewards not normalised)"),
    "gae_padding": ("masked", f"{_ACTOR} (masked tokens skipped)"),
    # multi-turn (loss_mask zero on tool outputs): nextvalues and lastgaelam carried across masked
    # positions, adv_norm over loss_mask (run: tools/peers/makers/holes.py::areal_cases)
    "gae_holes": ("skip", f"{_ACTOR} (nextvalues, lastgaelam carried over masked positions)"),
    "whiten_holes": ("exclude", f"{_NORM}.__call__ (moments over loss_mask)"),
    "loss_agg": ("token-mean", f"{_F}::ppo_actor_loss_fn (sum over valid tokens / their count)"),
    "value_loss_agg": (None, f"{_F}::ppo_critic_loss_fn (token-mean, as the policy loss)"),
    "value_loss": ("clipped", f"{_F}::ppo_critic_loss_fn (½·max of the clipped and unclipped squares)"),
    "value_clip_form": ("delta", f"{_F}::ppo_critic_loss_fn (V_old + clamp(V − V_old, ±ε_v))"),
    "dual_clip": (None, f"{_ARGS}::PPOActorConfig.c_clip (default None)"),
    "log_ratio_clamp": (None, f"{_F}::ppo_actor_loss_fn (exp(logprobs − proximal_logprobs), no clamp)"),
    "score_clip": (20.0, f"{_ARGS}::PPOActorConfig.reward_clip (20, after (score + bias)·scaling)"),
    "score_bias": (0.0, f"{_ARGS}::PPOActorConfig.reward_bias (0)"),
    "score_scale": (1.0, f"{_ARGS}::PPOActorConfig.reward_scaling (1)"),
    # the logged approx_kl is logprobs − proximal_logprobs (the opposite of verl's ppo_kl)
    "approx_kl": ("neg_k1", f"{_F}::ppo_actor_loss_fn (stat['approx_kl'] = logprobs − proximal_logprobs)"),
    "vf_mask": ("value", f"{_F}::ppo_critic_loss_fn (loss_mask)"),
    # the logged clip_ratio counts the clipped tokens rejection sampling keeps, over every valid token
    # (run: tools/peers/makers/areal_decoupled.py, areal_gates.py); without a correction: all
    "clipfrac_counts": (
        "kept",
        f"{_F}::ppo_actor_loss_fn (clip_mask.logical_and_(loss_mask) after apply_rejection_sampling; "
        "actor.py: clip_ratio over n_valid_tokens)",
    ),
    "kl_loss_agg": (None, "areal/trainer/ppo/actor.py::grpo_loss_fn (no KL loss)"),
    "entropy_agg": (None, "areal/trainer/ppo/actor.py::grpo_loss_fn (no entropy loss)"),
}

HPARAMS: dict[str, Sourced] = {
    "gamma": (1.0, f"{_ARGS}::PPOActorConfig.discount (1.0)"),
    "lam": (1.0, f"{_ARGS}::PPOActorConfig.gae_lambda (1.0)"),
    "kl_coef": (0.1, f"{_ARGS}::PPOActorConfig.kl_ctl (0.1)"),
    "cliprange": (0.2, f"{_ARGS}::PPOActorConfig.eps_clip (0.2)"),
    "cliprange_value": (0.5, f"{_ARGS}::PPOCriticConfig.eps_clip (0.5)"),
    "vf_coef": (0.0, "areal/trainer/ppo/critic.py::ppo_loss_fn (the critic has its own engine and loss)"),
    "ent_coef": (0.0, "areal/trainer/ppo/actor.py::grpo_loss_fn (no entropy term)"),
    "whiten_eps": (1e-5, f"{_ARGS}::NormConfig.eps (1e-5)"),
}

PRESET: Preset = make_preset(
    "areal",
    CONVENTIONS,
    HPARAMS,
    areal_kl_clamps,
    (
        "areal/utils/data.py::KLEstimator._compute_approx_kl (k1, k2, k3; clamp ±10)",
        "areal/trainer/ppo/actor.py::PPOActor._compute_advantages (score bias/scale/clip, KL, GAE)",
        "areal/utils/data.py::Normalization (adv_norm: (A − μ)/(σ + eps))",
        "areal/utils/functional/functional.py::ppo_actor_loss_fn (asymmetric clip, c_clip)",
        "areal/utils/functional/functional.py::ppo_critic_loss_fn (delta clip form, ½·mse, token-mean)",
        "areal/api/cli_args.py::PPOActorConfig, PPOCriticConfig, NormConfig (defaults)",
    ),
)

# ---- critic-free: reward_norm {mean_level: group, std_level: group, group_size: n} on the scalar
# scores, then GAE over zero values with γ = λ = 1 (run: tools/peers/makers/areal_grpo.py)
_GROUP: Variant = {
    "whiten_advantages": ("none", "areal/api/cli_args.py::PPOActorConfig.adv_norm (default None)"),
    "group_std": ("unbiased", "areal/api/cli_args.py::NormConfig.std_unbiased (default True)"),
    "group_eps": (1e-5, f"{_NORM}.__call__ ((x − mean)/(std + eps), NormConfig.eps 1e-5)"),
    # std_level: batch under mean_level: group is --set group_std_level=batch-centred
    "group_std_level": ("group", f"{_NORM}.__call__ (std_level: group)"),
    # group_size = 1: mean = the score (leave-one-out: 0), std := 1 (unbiased) → 0.
    "group_singleton": ("zero", f"{_NORM}.__call__ (group_size = 1: x − x = 0)"),
    # −kl_ctl·KL_t stays in the token rewards and reaches a_t as its return-to-go (γ = 1).
    "group_kl": ("to_go", f"{_ACTOR} (GAE over zero values, discount = gae_lambda = 1)"),
}

CRITIC_FREE: dict[str, Variant] = {
    "grpo": _GROUP,
    "dr-grpo": {
        **_GROUP,
        "whiten_advantages": ("none", f"{_NORM}.__call__ (std_level None: std 1, eps 0)"),
    },
    "rloo": {
        **_GROUP,
        "group_singleton": (
            "score",
            f"{_NORM}.__call__ (group_size = 1 with mean_leave1out: mean 0, a = score)",
        ),
    },
}
"""``advantage -> {key: (value, source)}``."""

__all__ = ["CONVENTIONS", "CRITIC_FREE", "HPARAMS", "PRESET"]
