"""The presets of refppo, verl and OpenRLHF (the table of :data:`refppo.oracle.presets.registry.PRESETS`).

Every value comes from the survey in ``shared/conventions.md`` (sections 1 and 2) and is spelled
out, with the peer's source file and function, in ``spec/conventions.md``. No peer code is copied.
"""

from __future__ import annotations

from refppo.oracle.presets.base import Preset, _no_kl_clamps, _openrlhf_kl_clamps, _verl_kl_clamps

PRESETS_A: dict[str, Preset] = {
    "refppo": Preset(
        name="refppo",
        conventions={
            "kl_estimator": "k1",
            "kl_in": "reward",
            "score_at": "last_valid",
            "whiten_advantages": "masked",
            "whiten_variance": "unbiased",
            "loss_agg": "token-mean",
            "value_loss_agg": None,
            "value_loss": "clipped",
            "value_clip_form": "around_old",
            "dual_clip": None,
            "log_ratio_clamp": None,
            "score_clip": None,
            "approx_kl": "k1",
            "vf_mask": "value",
            "whiten_eps_at": "variance",
            "whiten_rewards": "none",
            "gae_padding": "masked",
            "gae_holes": "skip",
            "whiten_holes": "exclude",
            "kl_loss_agg": None,
            "entropy_agg": None,
        },
        hparams={},
        kl_clamps=_no_kl_clamps,
        sources=("refppo/pipeline.py::Convention (the defaults)",),
    ),
    # verl 0.9.1: verl/trainer/ppo/core_algos.py (kl_penalty, compute_gae_advantage_return,
    # compute_policy_loss_vanilla, compute_value_loss, agg_loss), verl/utils/torch_functional.py
    # (masked_whiten), verl/trainer/ppo/ray_trainer.py (apply_kl_penalty).
    "verl": Preset(
        name="verl",
        conventions={
            "kl_estimator": "k1",
            "kl_in": "reward",
            "score_at": "last_valid",
            "whiten_advantages": "masked",
            "whiten_variance": "unbiased",
            "loss_agg": "token-mean",
            # The critic's ``critic.loss_agg_mode`` defaults to the actor's: verl 0.9.1
            # verl/trainer/config/critic/critic.yaml sets it to
            # ``${oc.select:actor_rollout_ref.actor.loss_agg_mode,token-mean}``, so None (= loss_agg).
            "value_loss_agg": None,
            "value_loss": "clipped",
            # verl/trainer/ppo/core_algos.py::compute_value_loss: verl_F.clip_by_value(vpreds, values ± ε_v)
            "value_clip_form": "around_old",
            "dual_clip": 3.0,
            "log_ratio_clamp": 20.0,
            "score_clip": None,
            "approx_kl": "k1",
            "vf_mask": "value",
            # masked_whiten: rsqrt(var + 1e-8); KL loss and entropy use actor.loss_agg_mode
            # (verl/workers/utils/losses.py::ppo_loss calls agg_loss with config.loss_agg_mode).
            "whiten_eps_at": "variance",
            "whiten_rewards": "none",
            "gae_padding": "masked",
            # Multi-turn (response_mask zero on tool-output tokens): compute_gae_advantage_return
            # carries nextvalues/lastgaelam across masked positions ("skip observation tokens") and
            # masked_whiten's moments use response_mask (run: tools/peers/makers/holes.py::verl_cases).
            "gae_holes": "skip",
            "whiten_holes": "exclude",
            "kl_loss_agg": None,
            "entropy_agg": None,
        },
        hparams={
            "gamma": 1.0,
            "lam": 1.0,
            "kl_coef": 0.001,
            "cliprange": 0.2,
            "cliprange_value": 0.5,
            "vf_coef": 0.0,
            "ent_coef": 0.0,
        },
        kl_clamps=_verl_kl_clamps,
        sources=(
            "verl/trainer/ppo/core_algos.py::kl_penalty / kl_penalty_forward",
            "verl/trainer/ppo/ray_trainer.py::apply_kl_penalty",
            "verl/trainer/ppo/core_algos.py::compute_gae_advantage_return",
            "verl/utils/torch_functional.py::masked_whiten",
            "verl/trainer/ppo/core_algos.py::compute_policy_loss_vanilla",
            "verl/trainer/ppo/core_algos.py::compute_value_loss",
            "verl/trainer/ppo/core_algos.py::agg_loss",
            "verl/trainer/config/critic/critic.yaml (critic.loss_agg_mode = the actor's)",
        ),
    ),
    # OpenRLHF 0.11.2: openrlhf/models/utils.py (compute_approx_kl, compute_reward),
    # openrlhf/trainer/ppo_utils/experience_maker.py (get_advantages_and_returns,
    # compute_advantages_and_returns), openrlhf/models/loss.py (PolicyLoss, ValueLoss).
    "openrlhf": Preset(
        name="openrlhf",
        conventions={
            "kl_estimator": "k1",
            "kl_in": "reward",
            "score_at": "last_valid",
            "whiten_advantages": "masked",
            "whiten_variance": "population",
            "loss_agg": "token-mean",
            # openrlhf/models/loss.py::ValueLoss aggregates with token_level_loss=True unless told
            # otherwise, and openrlhf/trainer/ray/ppo_critic.py builds ``ValueLoss(value_clip)``: the
            # value loss stays token-mean when actor.loss_agg_mode is seq-mean-token-mean.
            "value_loss_agg": "token-mean",
            "value_loss": "clipped",
            # openrlhf/models/loss.py::ValueLoss: old_values + (values − old_values).clamp(±ε_v)
            "value_clip_form": "delta",
            "dual_clip": None,
            "log_ratio_clamp": 20.0,
            "score_clip": 10.0,
            "approx_kl": "k1",
            "vf_mask": "value",
            # compute_advantages_and_returns: (A − μ)·clamp(var, min=1e-8).rsqrt().
            "whiten_eps_at": "clamp",
            "whiten_rewards": "none",
            "gae_padding": "masked",
            # Agent mode (action_mask zero on environment feedback): get_advantages_and_returns
            # multiplies values and rewards by action_mask, then recurses over every position; the
            # batch whitening uses action_mask (run: tools/peers/makers/holes.py::openrlhf_cases).
            "gae_holes": "zero",
            "whiten_holes": "exclude",
            # trainer/ray/ppo_actor.py::training_step calls models/loss.py::aggregate_loss for the KL
            # loss and the entropy without token_level_loss (default True): token-mean whatever the
            # actor's loss_agg_mode.
            "kl_loss_agg": "token-mean",
            "entropy_agg": "token-mean",
        },
        hparams={
            "gamma": 1.0,
            "lam": 1.0,
            "kl_coef": 0.01,
            "cliprange": 0.2,
            "cliprange_value": 0.5,
            "vf_coef": 0.0,
            "ent_coef": 0.0,
        },
        kl_clamps=_openrlhf_kl_clamps,
        sources=(
            "openrlhf/models/utils.py::compute_approx_kl",
            "openrlhf/models/utils.py::compute_reward",
            "openrlhf/trainer/ppo_utils/experience_maker.py::get_advantages_and_returns",
            "openrlhf/trainer/ppo_utils/experience_maker.py::compute_advantages_and_returns",
            "openrlhf/models/loss.py::PolicyLoss",
            "openrlhf/models/loss.py::ValueLoss (token-mean: value_loss_agg)",
            "openrlhf/trainer/ray/ppo_critic.py (ValueLoss(value_clip), no token_level_loss)",
            "openrlhf/models/loss.py::aggregate_loss (aggregation)",
        ),
    ),
    # TRL PPOTrainer (ppov2 lineage, 0.12-1.12): trl/trainer/ppo_trainer.py::PPOTrainer.train,
    # trl/core.py::masked_whiten (later trl/trainer/utils.py).
}
"""refppo, verl, openrlhf (in this order)."""

__all__ = ["PRESETS_A"]
