"""``--preset rlinf``: RLinf 0.3.0's reasoning PPO step (``runner.task_type: reasoning``; RLinf/RLinf).

Files under ``rlinf/``: ``algorithms/registry.py`` (``calculate_adv_and_returns``, ``policy_loss``),
``algorithms/utils.py`` (``preprocess_reasoning_advantages_inputs``: the score slot and the value
bootstrap; ``kl_penalty``), ``algorithms/advantages.py`` (``compute_gae_advantages_and_returns``,
``compute_grpo_advantages``), ``algorithms/losses.py`` (``compute_ppo_actor_loss``,
``compute_ppo_critic_loss``), ``utils/utils.py`` (``masked_mean``, ``get_loss_agg_func``),
``utils/distributed.py::masked_normalization``, the Megatron workers that call them
(``workers/megatron_worker.py``, ``workers/actor/megatron_actor_worker.py``,
``workers/critic/megatron_critic_worker.py``). RLinf ships no default config in its wheel: the
hyperparameters below are the code's fallbacks (``cfg.algorithm.get(..., default)``) where it has
one; a key the worker requires has no default in the code (marked "required": the value here is a
placeholder, the run's sidecar supplies the real one). Validated
against RLinf 0.3.0's own functions by ``tools/peers/makers/rlinf_ppo.py``
(``tests/peers/test_peer_rlinf.py``); spelled out in spec/conventions.md. No RLinf code is copied.

RLinf's ``k3`` and ``low_var_kl`` are both verl's clamped k3 (``kl_penalty``: log ratio ±20, value
±10), so the KL clamps are verl's rule. The FSDP actor (``workers/actor/fsdp_actor_worker.py``)
calls ``kl_penalty(ref_logprobs, logprobs, ...)`` with the arguments swapped (a reversed k1/k3);
(run by ``tests/peers/test_peer_rlinf.py``: ``k2`` and ``abs`` are unchanged, being symmetric; ``k1``
becomes ``−k1`` and ``k3`` becomes ``exp(d) − d − 1``, the estimators of the reverse direction);
that is not this preset: spec/conventions.md names it out of scope, with the reason.
"""

from __future__ import annotations

from refppo.oracle.presets.base import Preset, Sourced, Variant, make_preset
from refppo.oracle.presets.kl_clamps import verl_kl_clamps

_REG = "rlinf/algorithms/registry.py::calculate_adv_and_returns"
_PRE = "rlinf/algorithms/utils.py::preprocess_reasoning_advantages_inputs"
_GAE = "rlinf/algorithms/advantages.py::compute_gae_advantages_and_returns"
_GRPO = "rlinf/algorithms/advantages.py::compute_grpo_advantages"
_PG = "rlinf/algorithms/losses.py::compute_ppo_actor_loss"
_VF = "rlinf/algorithms/losses.py::compute_ppo_critic_loss"
_NORM = "rlinf/utils/distributed.py::masked_normalization"
_MW = "rlinf/workers/megatron_worker.py::compute_advantages_and_returns"
_ACT = "rlinf/workers/actor/megatron_actor_worker.py (training loss_func)"
_CRIT = "rlinf/workers/critic/megatron_critic_worker.py"

CONVENTIONS: dict[str, Sourced] = {
    "kl_estimator": ("k3", "rlinf/algorithms/utils.py::kl_penalty (kl_penalty_type low_var_kl/k3: clamped)"),
    "kl_in": ("loss", f"{_ACT} (loss + kl_beta·loss_agg_func(kl_penalty(curr, ref)); no KL in the reward)"),
    "kl_loss_agg": (None, f"{_ACT} (the actor's loss_agg_func)"),
    "score_at": ("last_position", f"{_PRE} (expanded_rewards[-1] = rewards: the frame's last slot)"),
    "score_clip": (None, f"{_REG} (rewards as given)"),
    "gae_padding": ("through", f"{_GAE} (every position, values as given, a zero appended; dones at T only)"),
    "gae_holes": ("through", f"{_GAE} (the loss mask is not read by the recursion)"),
    "whiten_advantages": ("masked", f"{_MW} (algorithm.normalize_advantages: masked_normalization)"),
    "whiten_holes": ("exclude", f"{_NORM} (moments over the mask)"),
    "whiten_variance": ("unbiased", f"{_MW} (masked_normalization(..., unbiased=True))"),
    "whiten_eps_at": ("std", f"{_NORM} ((x − μ)/(sqrt(var) + eps))"),
    "whiten_rewards": ("none", f"{_REG} (rewards as given)"),
    "log_ratio_clamp": (None, f"{_PG} (clip_log_ratio_min / _max: None unless set)"),
    "dual_clip": (3.0, f"{_PG} (min(loss, sign(A)·c·A), c = clip_ratio_c; fsdp default 3.0)"),
    "loss_agg": ("token-mean", "rlinf/utils/utils.py::get_loss_agg_func (loss_agg_func: token-mean)"),
    "approx_kl": ("k1_clamped", f"{_PG} (approx_kl = −Σ m·clamp(l − l_old) / Σ m: the clamped log-ratio)"),
    "entropy_agg": (None, f"{_ACT} (loss_agg_func(entropy, mask))"),
    "value_loss": ("clipped", f"{_VF} (max of the Huber losses, huber_delta = 10000 in {_CRIT})"),
    "value_clip_form": ("around_old", f"{_VF} (prev_values + clamp(values − prev_values, ±value_clip))"),
    "value_loss_agg": ("token-mean", f"{_VF} (masked_mean, whatever loss_agg_func is passed)"),
    "vf_mask": ("response", f"{_CRIT} (loss_mask = response_mask: no score slot beyond it)"),
}

HPARAMS: dict[str, Sourced] = {
    "gamma": (1.0, f"{_MW} (cfg.algorithm.get('gamma', 1))"),
    "lam": (1.0, f"{_MW} (cfg.algorithm.get('gae_lambda', 1))"),
    "kl_coef": (0.0, f"{_ACT} (algorithm.kl_beta: required; 0 turns the KL loss off)"),
    "cliprange": (0.2, f"{_ACT} (algorithm.ratio_clip_eps: required)"),
    "cliprange_value": (0.2, f"{_CRIT} (algorithm.value_cliprange: required)"),
    "vf_coef": (0.0, f"{_CRIT} (the critic is its own worker with its own loss)"),
    "ent_coef": (0.0, f"{_ACT} (algorithm.entropy_bonus: required; 0 adds no entropy term)"),
    "whiten_eps": (1e-5, f"{_NORM} (eps=1e-5)"),
}

PRESET: Preset = make_preset(
    "rlinf",
    CONVENTIONS,
    HPARAMS,
    verl_kl_clamps,
    (_REG, _PRE, _GAE, _GRPO, _PG, _VF, _NORM, _MW, _ACT, _CRIT),
)

CRITIC_FREE: dict[str, Variant] = {
    "grpo": {
        "whiten_advantages": ("none", f"{_REG} (adv_type grpo; normalize_advantages off)"),
        "group_std": ("unbiased", f"{_GRPO} (grouped_rewards.std)"),
        "group_eps": (1e-6, f"{_GRPO} ((r − μ)/(σ + 1e-6))"),
        "group_singleton": ("error", f"{_GRPO} (one response: std NaN, advantage NaN)"),
        "group_kl": ("fold", f"{_REG} (no reward KL in the reasoning path)"),
    },
}
"""``advantage -> {key: (value, source)}`` (``algorithm.adv_type``)."""

__all__ = ["CONVENTIONS", "CRITIC_FREE", "HPARAMS", "PRESET"]
