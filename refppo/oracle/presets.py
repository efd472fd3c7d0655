"""Peer presets: each open-source trainer's PPO-step conventions as oracle keys.

Every value comes from the survey in ``shared/conventions.md`` (sections 1 and 2) and is spelled out,
with the peer's source file and function, in ``spec/conventions.md``. No peer code is copied.

A preset fixes conventions and supplies the peer's *default* hyperparameters; the dump's sidecar
(the run's real hyperparameters) overrides the defaults, and ``--set`` overrides both.
KL clamps depend on the estimator in verl and OpenRLHF, so they are resolved by
:func:`resolve_preset` once the estimator is known.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from refppo.errors import ConventionError

KlClamps = dict[str, Any]


def _no_kl_clamps(estimator: str) -> KlClamps:
    return {"kl_log_ratio_clamp": None, "kl_value_clamp": None}


def _verl_kl_clamps(estimator: str) -> KlClamps:
    """verl 0.9.1 ``verl/trainer/ppo/core_algos.py::kl_penalty_forward``: only ``low_var_kl`` (k3)
    clamps — the log-ratio ``log π_ref − log π`` to [−20, 20] and the estimate to [−10, 10]."""
    if estimator == "k3":
        return {"kl_log_ratio_clamp": (-20.0, 20.0), "kl_value_clamp": 10.0}
    return _no_kl_clamps(estimator)


def _openrlhf_kl_clamps(estimator: str) -> KlClamps:
    """OpenRLHF 0.11.2 ``openrlhf/models/utils.py::compute_approx_kl``: every estimator's value is
    clamped to [−10, 10]; k3 first clamps ``log π − log π_ref`` from below at −10."""
    if estimator == "k3":
        return {"kl_log_ratio_clamp": (-10.0, None), "kl_value_clamp": 10.0}
    return {"kl_log_ratio_clamp": None, "kl_value_clamp": 10.0}


@dataclass(frozen=True)
class Preset:
    """One peer: fixed convention keys, a KL-clamp rule, default hyperparameters, sources."""

    name: str
    conventions: dict[str, Any]
    hparams: dict[str, Any]
    kl_clamps: Callable[[str], KlClamps]
    sources: tuple[str, ...] = field(default_factory=tuple)


PRESETS: dict[str, Preset] = {
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
}

PEER_PRESETS: tuple[str, ...] = ("verl", "openrlhf", "trl", "deepspeed-chat")


def get_preset(name: str) -> Preset:
    """The preset called ``name``; a ConventionError lists the valid names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConventionError(
            f"--preset: unknown preset {name!r}; valid presets are {sorted(PRESETS)}"
        ) from None


def resolve_preset(name: str, estimator: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(conventions, default hparams)`` of preset ``name`` with the KL clamps of ``estimator``.

    ``estimator`` None keeps the preset's own estimator.
    """
    p = get_preset(name)
    conv = dict(p.conventions)
    if estimator is not None:
        conv["kl_estimator"] = estimator
    conv.update(p.kl_clamps(str(conv["kl_estimator"])))
    return conv, dict(p.hparams)
