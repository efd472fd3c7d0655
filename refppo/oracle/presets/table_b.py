"""The presets of TRL, DeepSpeed-Chat, SkyRL and AReaL (the table of
:data:`refppo.oracle.presets.registry.PRESETS`).

Every value comes from the survey in ``shared/conventions.md`` (sections 1 and 2) and is spelled
out, with the peer's source file and function, in ``spec/conventions.md``. No peer code is copied.
"""

from __future__ import annotations

from refppo.oracle.presets.base import Preset, _areal_kl_clamps, _no_kl_clamps, _verl_kl_clamps

PRESETS_B: dict[str, Preset] = {
    "trl": Preset(
        name="trl",
        conventions={
            "kl_estimator": "k1",
            "kl_in": "reward",
            "score_at": "after_last_valid",
            "whiten_advantages": "masked",
            "whiten_variance": "unbiased",
            "loss_agg": "token-mean",
            "value_loss_agg": None,
            "value_loss": "clipped",
            # PPOTrainer.train: torch.clamp(vpred, mb_values − ε_v, mb_values + ε_v)
            "value_clip_form": "around_old",
            "dual_clip": None,
            "log_ratio_clamp": None,
            "score_clip": None,
            "approx_kl": "k2_all_positions",
            "vf_mask": "value",
            # whiten_rewards=False by default (PPOConfig); True is ``--set whiten_rewards=masked_no_shift``
            # (masked_whiten(rewards, ~padding_mask_p1, shift_mean=False)).
            "whiten_eps_at": "variance",
            "whiten_rewards": "none",
            "gae_padding": "masked",
            # No multi-turn PPO path: refppo's defaults (not validated with holes).
            "gae_holes": "skip",
            "whiten_holes": "exclude",
            "kl_loss_agg": None,
            "entropy_agg": None,
        },
        hparams={
            "gamma": 1.0,
            "lam": 0.95,
            "kl_coef": 0.05,
            "cliprange": 0.2,
            "cliprange_value": 0.2,
            "vf_coef": 0.1,
            "ent_coef": 0.0,
        },
        kl_clamps=_no_kl_clamps,
        sources=(
            "trl/trainer/ppo_trainer.py::PPOTrainer.train (ppov2_trainer.py in 0.9-0.11; "
            "trl/experimental/ppo/ppo_trainer.py from 0.26)",
            "trl/core.py::masked_whiten",
        ),
    ),
    # DeepSpeed-Chat: microsoft/DeepSpeedExamples applications/DeepSpeed-Chat/dschat/rlhf/ppo_trainer.py
    # (DeepSpeedPPOTrainer.compute_rewards, get_advantages_and_returns, actor_loss_fn, critic_loss_fn).
    "deepspeed-chat": Preset(
        name="deepspeed-chat",
        conventions={
            "kl_estimator": "k1",
            "kl_in": "reward",
            "score_at": "after_last_valid",
            "whiten_advantages": "none",
            "whiten_variance": "unbiased",
            "loss_agg": "token-mean",
            "value_loss_agg": None,
            "value_loss": "clipped",
            # DeepSpeedPPOTrainer.critic_loss_fn: torch.clamp(values, old_values ± ε_v)
            "value_clip_form": "around_old",
            "dual_clip": None,
            "log_ratio_clamp": None,
            "score_clip": 5.0,
            "approx_kl": "k1",
            "vf_mask": "response",
            "whiten_eps_at": "variance",
            "whiten_rewards": "none",
            "gae_padding": "masked",
            # No multi-turn path: refppo's defaults (not validated with holes).
            "gae_holes": "skip",
            "whiten_holes": "exclude",
            "kl_loss_agg": None,
            "entropy_agg": None,
        },
        hparams={
            "gamma": 1.0,
            "lam": 0.95,
            "kl_coef": 0.1,
            "cliprange": 0.2,
            "cliprange_value": 0.2,
            "vf_coef": 0.0,
            "ent_coef": 0.0,
        },
        kl_clamps=_no_kl_clamps,
        sources=(
            "dschat/rlhf/ppo_trainer.py::DeepSpeedPPOTrainer.compute_rewards",
            "dschat/rlhf/ppo_trainer.py::DeepSpeedPPOTrainer.get_advantages_and_returns",
            "dschat/rlhf/ppo_trainer.py::DeepSpeedPPOTrainer.actor_loss_fn",
            "dschat/rlhf/ppo_trainer.py::DeepSpeedPPOTrainer.critic_loss_fn",
        ),
    ),
    # SkyRL-train 0.3.1 (PPO with a critic: advantage_estimator=gae): skyrl_train/utils/ppo_utils.py
    # (compute_approx_kl, compute_gae_advantage_return, masked_whiten, ppo_policy_loss, reduce_loss,
    # ppo_critic_loss), skyrl_train/trainer.py (apply_reward_kl_penalty, postprocess_generator_output),
    # skyrl_train/workers/worker.py (PolicyWorkerBase._forward_backward_micro: KL loss, entropy).
    "skyrl": Preset(
        name="skyrl",
        conventions={
            # algorithm.kl_estimator_type: "k3" (config/ppo_base_config.yaml).
            "kl_estimator": "k3",
            # algorithm.use_kl_loss: true, use_kl_in_reward: false (the defaults).
            "kl_in": "loss",
            # trainer.py::postprocess_generator_output: per_token_reward[-1] = reward.
            "score_at": "last_valid",
            # compute_gae_advantage_return always ends with masked_whiten (unbiased, rsqrt(var+1e-8)).
            "whiten_advantages": "masked",
            "whiten_variance": "unbiased",
            "whiten_eps_at": "variance",
            "whiten_rewards": "none",
            # compute_gae_advantage_return runs over every position with the critic's values as given.
            "gae_padding": "through",
            # Multi-turn (loss_mask zero on observation tokens): GAE gets the right-padded
            # response_mask, so it runs through the holes with the critic's values there, and
            # masked_whiten's moments include them; losses use loss_mask (holes.py::skyrl_cases).
            "gae_holes": "through",
            "whiten_holes": "include",
            # algorithm.loss_reduction: token_mean (reduce_loss); sequence_mean = seq-mean-token-mean,
            # seq_mean_token_sum_norm = seq-mean-token-sum-norm with horizon = max_seq_len.
            "loss_agg": "token-mean",
            # ppo_critic_loss: masked_mean(loss, mask, dim=-1).mean() whatever loss_reduction.
            "value_loss_agg": "seq-mean-token-mean",
            "value_loss": "clipped",
            # V_old + clamp(V − V_old, ±ε_v) (ppo_critic_loss / ppo_critic_loss_fn).
            "value_clip_form": "delta",
            # policy_loss_type: regular; dual_clip uses clip_ratio_c (3.0).
            "dual_clip": None,
            # _safe_exp_delta(log_probs − old_log_probs, clip=20.0).
            "log_ratio_clamp": 20.0,
            "score_clip": None,
            "approx_kl": "k1",
            "vf_mask": "value",
            # worker.py: kl_loss = masked_mean(kl, mask, dim=-1).mean(); entropy = masked_mean(entropy, mask).
            "kl_loss_agg": "seq-mean-token-mean",
            "entropy_agg": "token-mean",
        },
        hparams={
            "gamma": 1.0,
            "lam": 1.0,
            "kl_coef": 0.001,
            "cliprange": 0.2,
            "cliprange_value": 0.2,
            "vf_coef": 0.0,
            "ent_coef": 0.0,
        },
        kl_clamps=_verl_kl_clamps,
        sources=(
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
    ),
    # AReaL 1.0.4: areal/trainer/ppo/actor.py (PPOActor._compute_advantages, grpo_loss_fn),
    # areal/trainer/ppo/critic.py (ppo_loss_fn), areal/utils/functional/functional.py
    # (ppo_actor_loss_fn, ppo_critic_loss_fn), areal/utils/data.py (KLEstimator, Normalization).
    "areal": Preset(
        name="areal",
        conventions={
            # PPOActorConfig.kl_estimator: "k1"; KLEstimator clamps every estimate to [−10, 10].
            "kl_estimator": "k1",
            "kl_in": "reward",
            # _compute_advantages: rewards[seqlens − 2] += score (rolled frame: the last valid token).
            "score_at": "last_valid",
            # PPOActorConfig.adv_norm: None. With adv_norm {mean_level: batch, std_level: batch}:
            # --set whiten_advantages=masked; std_level null: center; mean_level null: scale.
            "whiten_advantages": "none",
            "whiten_variance": "unbiased",
            # Normalization: (x − μ)/(σ + eps), NormConfig.eps 1e-5 (hparam whiten_eps below).
            "whiten_eps_at": "std",
            "whiten_rewards": "none",
            "gae_padding": "masked",
            # Multi-turn (loss_mask zero on tool outputs): _compute_advantages carries nextvalues and
            # lastgaelam across masked positions (as verl) and adv_norm uses loss_mask
            # (run: tools/peers/makers/holes.py::areal_cases).
            "gae_holes": "skip",
            "whiten_holes": "exclude",
            # ppo_actor_loss_fn / ppo_critic_loss_fn: sum over valid tokens / their count.
            "loss_agg": "token-mean",
            "value_loss_agg": None,
            "value_loss": "clipped",
            # V_old + clamp(V − V_old, ±ε_v) (ppo_critic_loss / ppo_critic_loss_fn).
            "value_clip_form": "delta",
            # PPOActorConfig.c_clip: None (dual clip off).
            "dual_clip": None,
            # ppo_actor_loss_fn: exp(logprobs − proximal_logprobs), no clamp.
            "log_ratio_clamp": None,
            # PPOActorConfig.reward_clip: 20, after (score + reward_bias)·reward_scaling.
            "score_clip": 20.0,
            "score_bias": 0.0,
            "score_scale": 1.0,
            # the logged approx_kl is logprobs − proximal_logprobs (the opposite of verl's ppo_kl).
            "approx_kl": "neg_k1",
            "vf_mask": "value",
            "kl_loss_agg": None,
            "entropy_agg": None,
        },
        hparams={
            "gamma": 1.0,
            "lam": 1.0,
            "kl_coef": 0.1,
            "cliprange": 0.2,
            "cliprange_value": 0.5,
            "vf_coef": 0.0,
            "ent_coef": 0.0,
            "whiten_eps": 1e-5,
        },
        kl_clamps=_areal_kl_clamps,
        sources=(
            "areal/utils/data.py::KLEstimator._compute_approx_kl (k1, k2, k3; clamp ±10)",
            "areal/trainer/ppo/actor.py::PPOActor._compute_advantages (score bias/scale/clip, KL, GAE)",
            "areal/utils/data.py::Normalization (adv_norm: (A − μ)/(σ + eps))",
            "areal/utils/functional/functional.py::ppo_actor_loss_fn (asymmetric clip, c_clip)",
            "areal/utils/functional/functional.py::ppo_critic_loss_fn (delta clip form, ½·mse, token-mean)",
            "areal/api/cli_args.py::PPOActorConfig, PPOCriticConfig, NormConfig (defaults)",
        ),
    ),
}
"""trl, deepspeed-chat, skyrl, areal (in this order)."""

__all__ = ["PRESETS_B"]
