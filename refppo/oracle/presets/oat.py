"""``--preset oat``: oat-llm 0.2.4's PPO step with a critic (``critic_type=ppo``), its truncated
importance sampling ``tis_c`` against the vLLM sampler's log-probs, and its critic-free
``critic_type`` values ``grpo`` and ``drgrpo`` (oat is the Dr. GRPO authors' code base).

Files under ``oat/``: ``algorithms/ppo.py`` (``PPOArgs`` defaults; ``PPOLearner._init``: the loss
aggregator; ``learning_step``: KL, score placement, the surrogate, ``tis_c``, the KL loss, the
critic loss; ``compute_ppo_advantages``: GAE and ``whiten_adv``; ``compute_monte_carlo_advantages``:
GRPO / Dr. GRPO), ``utils/ops.py`` (``masked_mean``, ``masked_sum``, ``masked_whiten``),
``args.py`` (``OATArgs`` defaults: ``beta``, ``critic_type``, ``generate_max_length``).
The KL clamps are stated as none (k3's log-ratio clamp to [−40, 40] acts only beyond 40).
Validated against the installed code by ``tests/peers/test_peer_oat.py``
(``tools/peers/makers/oat.py``); spelled out in spec/conventions.md.
"""

from __future__ import annotations

from refppo.oracle.presets.base import Preset, Sourced, Variant, make_preset
from refppo.oracle.presets.kl_clamps import no_kl_clamps

_PPO = "oat/algorithms/ppo.py"
_STEP = f"{_PPO}::PPOLearner.learning_step"
_GAE = f"{_PPO}::PPOLearner.compute_ppo_advantages"
_MC = f"{_PPO}::PPOLearner.compute_monte_carlo_advantages"
_AGG = f"{_PPO}::PPOLearner._init (masked_aggregator = masked_mean unless critic_type=drgrpo)"
_ARGS = "oat/algorithms/ppo.py::PPOArgs"

CONVENTIONS: dict[str, Sourced] = {
    # beta (oat/args.py::OATArgs, 0.1) weighs a k3 KL loss on the current log-probs; kl_penalty_coef
    # (PPOArgs, 0) a k1 reward KL on the learner's recomputed old log-probs
    "kl_estimator": ("k3", f"{_STEP} (kl3 = expm1(log_ratio) − log_ratio, log_ratio = ref − new)"),
    "kl_in": (
        "loss",
        "oat/args.py::OATArgs (beta: 0.1); oat/algorithms/ppo.py::PPOArgs (kl_penalty_coef: 0)",
    ),
    "score_at": ("last_valid", f"{_STEP} (rewards[arange(B), eos_indices] += final_rewards)"),
    "whiten_advantages": ("none", f"{_ARGS} (whiten_adv: False; masked_whiten in compute_ppo_advantages)"),
    "whiten_variance": (
        "unbiased",
        "oat/utils/ops.py::masked_var (unbiased=True, Bessel mask_sum/(mask_sum−1))",
    ),
    "whiten_eps_at": ("variance", "oat/utils/ops.py::masked_whiten (rsqrt(var + 1e-8))"),
    "whiten_rewards": ("none", f"{_ARGS} (whiten_rewards is declared but never read by learning_step)"),
    "gae_padding": ("masked", f"{_GAE} (loop over where(response_masks); nextvalues 0 after the last)"),
    "loss_agg": (
        "seq-mean-token-mean",
        f"{_AGG}; {_STEP} ((masked_mean(L, mask, axis=1) · loss_mask).mean())",
    ),
    "value_loss_agg": (
        "seq-mean-token-mean",
        f"{_STEP} (0.5 · masked_aggregator(vf_loss_max, mask, axis=1))",
    ),
    "value_loss": ("clipped", f"{_STEP} (max(vf_losses1, vf_losses2); PPOArgs.cliprange_value 0.2)"),
    "value_clip_form": ("around_old", f"{_STEP} (torch.clamp(value_pred, mb_values − ε_v, mb_values + ε_v))"),
    "dual_clip": (None, f"{_STEP} (pg_loss_max = max(pg_losses, pg_losses2): no dual clip)"),
    "log_ratio_clamp": (None, f"{_STEP} (ratio = exp(new_logps − mb_logps), unclamped)"),
    "score_clip": (None, f"{_STEP} (final_rewards · reward_scale, not clipped)"),
    "approx_kl": ("k1", f"{_STEP} (logs no approx_kl of π vs π_old: refppo's default)"),
    "vf_mask": ("value", f"{_STEP} (the critic loss over mb_response_masks)"),
    "clipfrac_agg": (
        "row-mean",
        f"{_STEP} (masked_mean((pg_losses2 > pg_losses).float(), mask, axis=1).mean() per micro-batch; "
        "infos['pg_clipfrac'] the mean over micro-batches)",
    ),
    "kl_loss_agg": (
        "seq-mean-token-mean",
        f"{_STEP} (beta · (masked_aggregator(kl3, mask, axis=1) · loss_mask).mean())",
    ),
    "entropy_agg": (
        "token-mean",
        f"{_STEP} (infos['entropy'] = masked_mean(entropy, mask); logged, not in the loss)",
    ),
    # tis_c (PPOArgs default 2.0): clamp(exp(mb_logps − mb_actor_logps), max=tis_c) multiplies
    # pg_loss_max per token; mb_logps is the learner's old (no_grad) pass, mb_actor_logps vLLM's
    "rollout_is": ("token", f"{_STEP} (pg_loss_max *= tis, one weight per token)"),
    "rollout_is_mode": ("truncate", f"{_STEP} (tis = exp(mb_logps − mb_actor_logps).clamp(max=tis_c))"),
    "rollout_is_high": (2.0, f"{_ARGS} (tis_c: 2.0, 'Truncated importance sampling for vllm/deepspeed')"),
}

HPARAMS: dict[str, Sourced] = {
    "gamma": (1.0, f"{_ARGS} (gamma: 1.0)"),
    "lam": (1.0, f"{_ARGS} (lam: 1.0)"),
    "kl_coef": (0.1, "oat/args.py::OATArgs (beta: 0.1)"),
    "cliprange": (0.2, f"{_ARGS} (cliprange: 0.2)"),
    "cliprange_value": (0.2, f"{_ARGS} (cliprange_value: 0.2)"),
    "vf_coef": (1.0, f"{_ARGS} (vf_coef: 1.0, the critic's own loss: separate_critic)"),
    "ent_coef": (0.0, f"{_STEP} (the entropy is logged, not in the loss)"),
}


PRESET: Preset = make_preset(
    "oat",
    CONVENTIONS,
    HPARAMS,
    # learning_step clamps k3's log-ratio log π_ref − log π to [−40, 40] (the estimate is not clamped);
    # stated as "none": the clamp acts only where |log π_ref − log π| > 40, and a ±40 bundle would join
    # CLAMP_BUNDLES, which --detect searches in full. The k1 reward KL is not clamped.
    no_kl_clamps,
    (
        "oat/algorithms/ppo.py::PPOArgs (defaults: tis_c 2.0, cliprange, cliprange_value 0.2, gamma, lam 1)",
        "oat/algorithms/ppo.py::PPOLearner._init (masked_aggregator)",
        "oat/algorithms/ppo.py::PPOLearner.learning_step (KL, score, surrogate, tis_c, KL loss, critic loss)",
        "oat/algorithms/ppo.py::PPOLearner.compute_ppo_advantages (GAE over the response tokens; whiten_adv)",
        "oat/algorithms/ppo.py::PPOLearner.compute_monte_carlo_advantages (grpo, drgrpo)",
        "oat/utils/ops.py::masked_mean, masked_sum, masked_var, masked_whiten",
        "oat/args.py::OATArgs (beta 0.1, critic_type, generate_max_length 512)",
    ),
)

# ---- critic-free: critic_type grpo, drgrpo (OATArgs' default). The group is num_samples consecutive rows.
_GROUP: Variant = {
    "whiten_advantages": ("none", f"{_MC} (not whitened; whiten_adv is read by compute_ppo_advantages only)"),
    "group_std": ("unbiased", f"{_MC} (rewards.view(-1, num_samples).std(dim=1))"),
    "group_eps": (1e-8, f"{_MC} (advantages / (std_grouped_rewards + 1e-8))"),
    "group_kl": ("fold", f"{_MC} (rewards = rewards.sum(-1): the k1 reward KL folded into the score)"),
}

CRITIC_FREE: dict[str, Variant] = {
    "grpo": _GROUP,
    "dr-grpo": {
        **_GROUP,
        "loss_agg": (
            "seq-mean-token-sum-norm",
            f"{_PPO}::PPOLearner._init (critic_type=drgrpo: masked_sum / generate_max_length; "
            "refppo's horizon = OATArgs.generate_max_length, 512 by default)",
        ),
        "value_loss_agg": ("seq-mean-token-sum-norm", f"{_PPO}::PPOLearner._init (one masked_aggregator)"),
        "kl_loss_agg": ("seq-mean-token-sum-norm", f"{_PPO}::PPOLearner._init (one masked_aggregator)"),
    },
}
"""``advantage -> {key: (value, source)}``: ``critic_type`` ``grpo`` and ``drgrpo``."""

__all__ = ["CONVENTIONS", "CRITIC_FREE", "HPARAMS", "PRESET"]
