"""``--preset trinity``: trinity-rft 0.6.0's PPO (``algorithm_type: ppo``; agentscope-ai/Trinity-RFT).

Files under ``trinity/``: ``algorithm/algorithm.py::PPOAlgorithm.default_config`` (policy_loss_fn
``ppo``, advantage_fn ``ppo``, kl_penalty_fn ``none``, kl_loss_fn ``k2``, entropy_loss_fn
``default``), ``algorithm/kl_fn/kl_fn.py`` (``K2Fn``, ``KLFn.calculate_kl_loss``,
``apply_kl_penalty_to_reward``), ``algorithm/advantage_fn/ppo_advantage.py::PPOAdvantageFn``,
``algorithm/utils.py`` (``masked_whiten``, ``aggregate_loss``),
``algorithm/policy_loss_fn/ppo_policy_loss.py::PPOPolicyLossFn``,
``trainer/verl/utils.py::to_data_proto`` (the score slot), ``trainer/verl/losses.py::TrinityPolicyLoss``;
the critic is verl's worker (verl 0.9.1 ``compute_value_loss``). Validated against trinity-rft
0.6.0's own functions by ``tools/peers/makers/trinity_ppo.py`` (``tests/peers/test_peer_trinity.py``);
spelled out in spec/conventions.md. No trinity code is copied.

trinity's ``k3`` (``K3Fn``) is unclamped; its ``low_var_kl`` (``LowVarKLFn``) is verl's clamped k3:
``--set kl_estimator=k3 --set kl_log_ratio_clamp=-20,20 --set kl_value_clamp=10``.
"""

from __future__ import annotations

from refppo.oracle.presets.base import Preset, Sourced, make_preset
from refppo.oracle.presets.kl_clamps import no_kl_clamps

_ALG = "trinity/algorithm/algorithm.py::PPOAlgorithm.default_config"
_KL = "trinity/algorithm/kl_fn/kl_fn.py"
_ADV = "trinity/algorithm/advantage_fn/ppo_advantage.py::PPOAdvantageFn"
_PG = "trinity/algorithm/policy_loss_fn/ppo_policy_loss.py::PPOPolicyLossFn"
_UT = "trinity/algorithm/utils.py"
_VC = "verl/trainer/ppo/core_algos.py::compute_value_loss (trinity's critic is verl's worker)"

CONVENTIONS: dict[str, Sourced] = {
    "kl_estimator": ("k2", f"{_ALG} (kl_loss_fn: k2; {_KL}::K2Fn ½·(l − l_ref)²)"),
    "kl_in": ("loss", f"{_ALG} (kl_penalty_fn: none, kl_loss_fn: k2)"),
    "kl_loss_agg": (None, f"{_KL}::KLFn.calculate_kl_loss (aggregate_loss with loss_agg_mode)"),
    "score_at": (
        "last_valid",
        "trinity/trainer/verl/utils.py::to_data_proto (cumsum(attention_mask).argmax)",
    ),
    "score_clip": (None, "trinity/trainer/verl/utils.py::to_data_proto (exp.reward as is)"),
    "gae_padding": ("through", f"{_ADV} (every position, values as given: values·eos_mask is a TODO)"),
    "gae_holes": ("through", f"{_ADV} (the mask is not read by the recursion)"),
    "whiten_advantages": ("masked", f"{_ADV} (masked_whiten(advantages, response_mask))"),
    "whiten_holes": ("exclude", f"{_UT}::masked_whiten (moments over response_mask)"),
    "whiten_variance": ("unbiased", f"{_UT}::masked_var (unbiased=True)"),
    "whiten_eps_at": ("variance", f"{_UT}::masked_whiten (rsqrt(var + 1e-8))"),
    "whiten_rewards": ("none", f"{_ADV} (token_level_rewards as given)"),
    "log_ratio_clamp": (20.0, f"{_PG} (clamp(logprob − old_logprob, −20, 20))"),
    "dual_clip": (3.0, f"{_PG} (clip_ratio_c = 3, for A < 0)"),
    "loss_agg": ("token-mean", f"{_PG}.default_args (loss_agg_mode: token-mean)"),
    "approx_kl": ("k1", f"{_PG} (ppo_kl = masked_mean(old − new))"),
    "entropy_agg": (None, "trinity/algorithm/entropy_loss_fn/entropy_loss_fn.py (loss_agg_mode)"),
    "value_loss": ("clipped", _VC),
    "value_clip_form": ("around_old", _VC),
    "value_loss_agg": (None, _VC),
    "vf_mask": ("value", _VC),
}

HPARAMS: dict[str, Sourced] = {
    "gamma": (1.0, f"{_ADV}.default_args (gamma)"),
    "lam": (1.0, f"{_ADV}.default_args (lam)"),
    "kl_coef": (0.001, f"{_KL}::KLFn.default_args (kl_coef)"),
    "cliprange": (0.2, f"{_PG}.default_args (clip_range)"),
    "cliprange_value": (0.5, "verl/trainer/config/_generated_ppo_trainer.yaml (critic.cliprange_value)"),
    "vf_coef": (0.0, "trinity/trainer/verl/losses.py::TrinityPolicyLoss (the critic has its own loss)"),
    "ent_coef": (0.0, "trinity/algorithm/entropy_loss_fn/entropy_loss_fn.py (entropy_coef: 0.0)"),
}

PRESET: Preset = make_preset(
    "trinity",
    CONVENTIONS,
    HPARAMS,
    no_kl_clamps,
    (
        _ALG,
        f"{_KL}::KLFn",
        _ADV,
        f"{_UT}::masked_whiten",
        _PG,
        "trinity/trainer/verl/losses.py::TrinityPolicyLoss",
    ),
)

__all__ = ["CONVENTIONS", "HPARAMS", "PRESET"]
