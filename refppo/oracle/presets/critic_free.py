"""The peers' critic-free estimators as preset variants: ``--preset PEER --set advantage=EST``.

A peer preset (:mod:`refppo.oracle.presets.registry`) states the peer's PPO-with-a-critic step. When the
run's ``advantage`` (``--set``, else the sidecar) names a critic-free estimator, the preset's
conventions are adjusted by that peer's variant below — the way the KL clamps follow the KL
estimator. Each field carries the peer's source (file and function, the versions of
``tools/build_peer_venvs.sh``); ``tools/peers presets`` checks each variant against the
peer's own code. A peer without the estimator is refused with a one-line error.

The peers' own names: verl 0.9.1 ``algorithm.adv_estimator`` ``grpo`` (``dr-grpo`` here is
``grpo`` with ``norm_adv_by_std_in_grpo=False``), ``rloo``, ``reinforce_plus_plus``,
``reinforce_plus_plus_baseline``; OpenRLHF 0.11.2 ``--algo.advantage.estimator`` ``group_norm``,
``dr_grpo``, ``rloo``, ``reinforce``, ``reinforce_baseline``; SkyRL-train 0.3.1
``algorithm.advantage_estimator`` ``grpo`` (``dr-grpo``: ``grpo_norm_by_std=false``), ``rloo``,
``reinforce++``.
"""

from __future__ import annotations

from typing import Any

from refppo.errors import ConventionError

_VERL = "verl/trainer/ppo/core_algos.py"
_ORLHF = (
    "openrlhf/trainer/ppo_utils/experience_maker.py::RemoteExperienceMaker.compute_advantages_and_returns"
)
_SKYRL = "skyrl_train/utils/ppo_utils.py"
_TRL = "trl/trainer/grpo_trainer.py::GRPOTrainer"
_TRL_ADV = f"{_TRL}._generate_and_score_completions"

Variant = dict[str, tuple[Any, str]]
"""``{convention key: (value, source)}``."""

_VERL_GROUP: Variant = {
    "whiten_advantages": ("none", f"{_VERL}::compute_grpo_outcome_advantage returns scores unwhitened"),
    "group_std": ("unbiased", f"{_VERL}::compute_grpo_outcome_advantage (torch.std)"),
    "group_eps": (1e-6, f"{_VERL}::compute_grpo_outcome_advantage (epsilon=1e-6)"),
    "group_singleton": ("score", f"{_VERL}::compute_grpo_outcome_advantage (one response: mean 0, std 1)"),
    "group_kl": ("fold", f"{_VERL}::compute_grpo_outcome_advantage (scores = token_level_rewards.sum(-1))"),
}
_OPENRLHF_GROUP: Variant = {
    "whiten_advantages": ("none", f"{_ORLHF} (only gae, reinforce, reinforce_baseline are whitened)"),
    "group_std": ("unbiased", f"{_ORLHF} (rewards.std(-1))"),
    "group_eps": (1e-9, f"{_ORLHF} (group_norm: / (std + 1e-9))"),
    "group_singleton": ("error", "openrlhf/cli/train_ppo_ray.py (asserts n_samples_per_prompt > 1)"),
    "group_kl": ("to_go", f"{_ORLHF} (compute_reward(shaped reward, kl) then get_cumulative_returns)"),
    # compute_reward clamps the SHAPED reward by reward.clip_range: not the raw score (see spec).
    "score_clip": (None, "openrlhf/models/utils.py::compute_reward (clamps the shaped group reward)"),
}
_SKYRL_GROUP: Variant = {
    "whiten_advantages": ("none", f"{_SKYRL}::compute_grpo_outcome_advantage (no whitening)"),
    "group_std": ("unbiased", f"{_SKYRL}::compute_grpo_outcome_advantage (torch.std)"),
    "group_eps": (1e-6, f"{_SKYRL}::compute_grpo_outcome_advantage (epsilon=1e-6)"),
    "group_singleton": ("score", f"{_SKYRL}::compute_grpo_outcome_advantage (one response: mean 0, std 1)"),
    "group_kl": ("fold", f"{_SKYRL}::compute_grpo_outcome_advantage (scores = token_level_rewards.sum(-1))"),
}

_TRL_GROUP: Variant = {
    # The GRPO trainer, not the PPOTrainer the ``trl`` preset states: β·k3 KL of the current policy
    # in the loss (TRL 1.12.0 and 1.16.0 alike; run: tools/peers/makers/trl_grpo.py).
    "kl_in": ("loss", f"{_TRL}._compute_loss (per_token_loss + beta·per_token_kl)"),
    "kl_estimator": ("k3", f"{_TRL}._compute_loss (exp(ref − logp) − (ref − logp) − 1)"),
    "whiten_advantages": ("none", f"{_TRL_ADV} (no batch whitening after the group scaling)"),
    "group_std": ("unbiased", "trl/trainer/utils.py::nanstd (Bessel: count/(count − 1))"),
    "group_eps": (1e-4, f"{_TRL_ADV} (advantages / (std_rewards + 1e-4))"),
    # scale_rewards="group" (default); "batch": --set group_std_level=batch (nanstd(rewards) over the
    # whole batch around its mean, the mean still per group).
    "group_std_level": ("group", f"{_TRL_ADV} (scale_rewards='group': nanstd(rewards.view(-1, n), dim=1))"),
    # num_generations = 1 (eval only): std_rewards = 0 and r − mean = 0, so 0/(0 + 1e-4) = 0.
    "group_singleton": ("zero", f"{_TRL_ADV} (num_generations = 1: std 0, advantage 0)"),
    # The score enters as is (one reward function, weight 1); β acts in the loss, not the reward.
    "group_kl": ("to_go", f"{_TRL_ADV} (rewards = Σ_k w_k·reward_k; no KL in the reward)"),
    # GRPOConfig.loss_type default "dapo": Σ loss·mask / num_items_in_batch (one process: token-mean).
    "loss_agg": ("token-mean", "trl/trainer/grpo_config.py::GRPOConfig.loss_type (default dapo)"),
    "log_ratio_clamp": (None, f"{_TRL}._compute_loss (exp(log_ratio), no clamp)"),
    "dual_clip": (None, "trl/trainer/grpo_config.py::GRPOConfig.delta (default None)"),
}

_AREAL_NORM = "areal/utils/data.py::Normalization"
_AREAL_ADV = "areal/trainer/ppo/actor.py::PPOActor._compute_advantages"
_AREAL_GROUP: Variant = {
    # reward_norm {mean_level: group, std_level: group, group_size: n} on the scalar scores, then
    # GAE over zero values with γ = λ = 1 (run: tools/peers/makers/areal_grpo.py).
    "whiten_advantages": ("none", "areal/api/cli_args.py::PPOActorConfig.adv_norm (default None)"),
    "group_std": ("unbiased", "areal/api/cli_args.py::NormConfig.std_unbiased (default True)"),
    "group_eps": (1e-5, f"{_AREAL_NORM}.__call__ ((x − mean)/(std + eps), NormConfig.eps 1e-5)"),
    # std_level: group; std_level: batch under mean_level: group is --set group_std_level=batch-centred
    # (_compute_std over the whole batch of x − the per-row group mean).
    "group_std_level": ("group", f"{_AREAL_NORM}.__call__ (std_level: group)"),
    # group_size = 1: mean = the score (leave-one-out: 0), std := 1 (unbiased) → 0.
    "group_singleton": ("zero", f"{_AREAL_NORM}.__call__ (group_size = 1: x − x = 0)"),
    # −kl_ctl·KL_t stays in the token rewards and reaches a_t as its return-to-go (γ = 1).
    "group_kl": ("to_go", f"{_AREAL_ADV} (GAE over zero values, discount = gae_lambda = 1)"),
}

VARIANTS: dict[str, dict[str, Variant]] = {
    "verl": {
        "grpo": _VERL_GROUP,
        "dr-grpo": {
            **_VERL_GROUP,
            "whiten_advantages": (
                "none",
                f"{_VERL}::compute_grpo_outcome_advantage(norm_adv_by_std_in_grpo=False)",
            ),
        },
        "rloo": {
            **_VERL_GROUP,
            "group_singleton": (
                "score",
                f"{_VERL}::compute_rloo_outcome_advantage (one response: its score)",
            ),
        },
        "reinforce++": {
            "whiten_advantages": (
                "masked",
                f"{_VERL}::compute_reinforce_plus_plus_outcome_advantage (masked_whiten)",
            ),
            "whiten_variance": (
                "unbiased",
                "verl/utils/torch_functional.py::masked_whiten (masked_var unbiased)",
            ),
            "whiten_eps_at": (
                "variance",
                "verl/utils/torch_functional.py::masked_whiten (rsqrt(var + 1e-8))",
            ),
        },
        "reinforce++-baseline": {
            **_VERL_GROUP,
            "whiten_advantages": (
                "masked",
                f"{_VERL}::compute_reinforce_plus_plus_baseline_outcome_advantage (masked_whiten)",
            ),
            "whiten_variance": ("unbiased", "verl/utils/torch_functional.py::masked_whiten"),
            "whiten_eps_at": ("variance", "verl/utils/torch_functional.py::masked_whiten"),
        },
    },
    "openrlhf": {
        "grpo": _OPENRLHF_GROUP,
        "dr-grpo": {**_OPENRLHF_GROUP, "group_eps": (1e-9, f"{_ORLHF} (dr_grpo: no std, eps unused)")},
        "rloo": _OPENRLHF_GROUP,
        "reinforce++": {
            "whiten_advantages": ("masked", f"{_ORLHF} (reinforce: batch whitening)"),
            "whiten_variance": ("population", f"{_ORLHF} (var = Σ (A − μ)² m / Σ m)"),
            "whiten_eps_at": ("clamp", f"{_ORLHF} (var.clamp(min=1e-8).rsqrt())"),
            "score_clip": (
                10.0,
                "openrlhf/models/utils.py::compute_reward (raw score, reward.clip_range ±10)",
            ),
        },
        "reinforce++-baseline": {
            **_OPENRLHF_GROUP,
            "whiten_advantages": ("masked", f"{_ORLHF} (reinforce_baseline: batch whitening)"),
            "whiten_variance": ("population", f"{_ORLHF} (var = Σ (A − μ)² m / Σ m)"),
            "whiten_eps_at": ("clamp", f"{_ORLHF} (var.clamp(min=1e-8).rsqrt())"),
        },
    },
    "areal": {
        "grpo": _AREAL_GROUP,
        "dr-grpo": {
            **_AREAL_GROUP,
            "whiten_advantages": ("none", f"{_AREAL_NORM}.__call__ (std_level None: std 1, eps 0)"),
        },
        "rloo": {
            **_AREAL_GROUP,
            "group_singleton": (
                "score",
                f"{_AREAL_NORM}.__call__ (group_size = 1 with mean_leave1out: mean 0, a = score)",
            ),
        },
    },
    "trl": {
        "grpo": _TRL_GROUP,
        "dr-grpo": {
            **_TRL_GROUP,
            "whiten_advantages": ("none", f"{_TRL_ADV} (scale_rewards='none' / False: r − mean only)"),
        },
    },
    "skyrl": {
        "grpo": _SKYRL_GROUP,
        "dr-grpo": {
            **_SKYRL_GROUP,
            "whiten_advantages": (
                "none",
                f"{_SKYRL}::compute_grpo_outcome_advantage(grpo_norm_by_std=False)",
            ),
        },
        "rloo": {
            **_SKYRL_GROUP,
            "group_singleton": ("zero", f"{_SKYRL}::compute_rloo_outcome_advantage (one response: 0)"),
        },
        "reinforce++": {
            "whiten_advantages": ("masked", f"{_SKYRL}::compute_reinforce_plus_plus_outcome_advantage"),
            "whiten_variance": ("unbiased", f"{_SKYRL}::masked_whiten (unbiased variance)"),
            "whiten_eps_at": ("variance", f"{_SKYRL}::masked_whiten (rsqrt(var + 1e-8))"),
        },
    },
}
"""``peer → advantage → {key: (value, source)}``. ``refppo`` itself takes any estimator as set."""

# Issue #13 item 3 (helper `estimators`): verl's further group estimators and OpenRLHF's
# flash_reinforce, each checked against the peer's own function by tools/peers group_estimators.
VARIANTS["verl"].update(
    {
        "opo": {
            **_VERL_GROUP,
            "group_singleton": (
                "score",
                f"{_VERL}::compute_opo_outcome_advantage (one response: baseline 0)",
            ),
        },
        "gpg": {
            **_VERL_GROUP,
            "group_singleton": ("score", f"{_VERL}::compute_gpg_outcome_advantage (one response: mean 0)"),
        },
        "grpo-passk": {
            **_VERL_GROUP,
            "group_singleton": (
                "error",
                f"{_VERL}::compute_grpo_passk_outcome_advantage (raises ValueError)",
            ),
        },
    }
)
VARIANTS["openrlhf"]["flash-reinforce"] = {
    **_OPENRLHF_GROUP,
    "whiten_advantages": ("none", f"{_ORLHF} (flash_reinforce: rewards − rewards.mean(), not whitened)"),
}


def critic_free_variant(preset: str, advantage: str) -> dict[str, Any]:
    """The convention updates of ``preset`` under ``advantage`` (``{}`` for ``gae``).

    Raises ConventionError when the peer has no such estimator (one line, listing those it has).
    """
    if advantage == "gae" or preset == "refppo":
        return {"advantage": advantage}
    have = VARIANTS.get(preset, {})
    if advantage not in have:
        names = ", ".join(["gae", *have]) or "gae"
        raise ConventionError(
            f"--preset {preset}: no critic-free estimator advantage={advantage!r} in this preset "
            f"(it covers: {names}); use --preset refppo with --set keys to check another"
        )
    return {"advantage": advantage, **{k: v for k, (v, _) in have[advantage].items()}}


def variant_sources(preset: str, advantage: str) -> list[str]:
    """``key=value: source`` lines of one variant (for spec/conventions.md and the tests)."""
    return [f"{k}={v}: {src}" for k, (v, src) in VARIANTS.get(preset, {}).get(advantage, {}).items()]


__all__ = ["VARIANTS", "critic_free_variant", "variant_sources"]
