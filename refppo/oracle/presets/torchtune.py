"""``--preset torchtune``: torchtune 0.6.1's PPO recipe (pytorch/torchtune
``recipes/ppo_full_finetune_single_device.py::PPOFullFinetuneRecipeSingleDevice``: ``generate_trajectory``,
``train``, ``ppo_step``; ``torchtune/rlhf/rewards.py``: ``get_rewards_ppo``, ``estimate_advantages``,
``whiten``, ``masked_var``; ``torchtune/rlhf/loss/ppo.py::PPOLoss``; the defaults of the wheel's one
PPO config ``recipes/configs/mistral/7B_full_ppo_low_memory.yaml``). Validated against torchtune
0.6.1's own recipe methods by ``tools/peers/makers/torchtune_ppo.py``
(``tests/peers/test_peer_torchtune.py``); spelled out in spec/conventions.md. No torchtune code is
copied.

torchtune's ``whiten(x, mask)`` (default ``shift_mean=True``) ADDS the mean back after scaling:
``(A − μ)·rsqrt(σ² + 1e-8) + μ`` (the inverse of TRL's flag), so its advantages are refppo's
``masked_no_shift``. A one-token response (first token a stop token) gets its score at position 0,
not one past it (``value_seq_idxs`` requires ``seq_lens > 0``): ``score_at =
after_last_valid_unless_first`` (spec/conventions.md, the torchtune section).
"""

from __future__ import annotations

from refppo.oracle.presets.base import Preset, Sourced, make_preset
from refppo.oracle.presets.kl_clamps import no_kl_clamps

_R = "recipes/ppo_full_finetune_single_device.py::PPOFullFinetuneRecipeSingleDevice"
_GEN = f"{_R}.generate_trajectory"
_REW = "torchtune/rlhf/rewards.py"
_LOSS = "torchtune/rlhf/loss/ppo.py::PPOLoss.forward"
_CFG = "recipes/configs/mistral/7B_full_ppo_low_memory.yaml"

CONVENTIONS: dict[str, Sourced] = {
    "kl_estimator": ("k1", f"{_REW}::get_rewards_ppo (kl = logprobs − ref_logprobs)"),
    "kl_in": ("reward", f"{_REW}::get_rewards_ppo (kl_reward = −kl_coeff·kl in total_reward)"),
    "score_at": (
        "after_last_valid_unless_first",
        f"{_GEN} (value_seq_idxs = seq_lens + 1 when 0 < seq_lens < T − 1, else seq_lens: step 6.1)",
    ),
    "whiten_advantages": (
        "masked_no_shift",
        f"{_REW}::estimate_advantages, whiten (shift_mean=True adds the mean back)",
    ),
    "whiten_variance": ("unbiased", f"{_REW}::masked_var (unbiased=True: Bessel over the mask)"),
    "whiten_eps_at": ("variance", f"{_REW}::whiten (rsqrt(var + 1e-8))"),
    "whiten_rewards": ("none", f"{_R}.train (cfg.whiten_rewards is read but never applied)"),
    "loss_agg": ("token-mean", f"{_LOSS} (masked_mean over padding_masks per backward batch)"),
    "value_loss_agg": (None, f"{_LOSS} (masked_mean as the policy loss, over value_padding_masks)"),
    "value_loss": ("clipped", f"{_LOSS} (0.5·max of the clipped and unclipped squares)"),
    "value_clip_form": ("around_old", f"{_LOSS} (torch.clamp(phi_values, phi_old_values ± clip))"),
    "vf_mask": ("value", f"{_GEN} (value_padding_masks: the response mask plus value_seq_idxs)"),
    "dual_clip": (None, f"{_LOSS} (no dual clip)"),
    "log_ratio_clamp": (None, f"{_LOSS} (torch.exp(pi_logprobs − pi_old_logprobs), no clamp)"),
    "score_clip": (None, f"{_GEN} (the reward model's score as is; penalties replace it)"),
    "approx_kl": ("k2_all_positions", f"{_R}.ppo_step (0.5·(pi − old)².mean() over every position)"),
    "gae_padding": ("masked", f"{_REW}::estimate_advantages (values zeroed past value_seq_idxs)"),
    # no multi-turn path: refppo's defaults (not validated with holes)
    "gae_holes": ("skip", f"{_REW}::estimate_advantages (no multi-turn path: refppo's default)"),
    "whiten_holes": ("exclude", f"{_REW}::estimate_advantages (no multi-turn path: refppo's default)"),
    "kl_loss_agg": (None, f"{_LOSS} (no KL loss)"),
    "entropy_agg": (None, f"{_LOSS} (no entropy loss)"),
}  # fmt: skip

HPARAMS: dict[str, Sourced] = {
    "gamma": (1.0, f"{_CFG} (gamma)"),
    "lam": (0.95, f"{_CFG} (lmbda)"),
    "kl_coef": (0.01, f"{_CFG} (kl_coeff)"),
    "cliprange": (0.2, f"{_CFG} (loss.epsilon; PPOLoss default 0.1)"),
    "cliprange_value": (0.2, f"{_CFG} (loss.value_clip_range)"),
    "vf_coef": (0.1, f"{_CFG} (loss.value_coeff; one optimizer over policy and value)"),
    "ent_coef": (0.0, f"{_LOSS} (no entropy term in the loss)"),
}

PRESET: Preset = make_preset(
    "torchtune",
    CONVENTIONS,
    HPARAMS,
    no_kl_clamps,
    (
        f"{_R} (generate_trajectory, train, ppo_step)",
        f"{_REW}::get_rewards_ppo, estimate_advantages, whiten",
        _LOSS,
    ),
)

__all__ = ["CONVENTIONS", "HPARAMS", "PRESET"]
