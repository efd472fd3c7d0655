"""SkyRL-train 0.3.1 dumps from its own functions (run with the ``skyrl-areal`` venv's python).

Called (``skyrl_train/utils/ppo_utils.py``): ``compute_approx_kl`` (reward KL and KL loss),
``compute_gae_advantage_return`` (GAE over every position, then ``masked_whiten``),
``ppo_policy_loss`` (``regular`` / ``dual_clip``, every ``loss_reduction``), ``ppo_critic_loss``,
``masked_mean``. Restated (one line each, because the real methods want Ray workers and a
``TrainingInputBatch``): ``trainer.py::apply_reward_kl_penalty`` (``rewards − kl·coef``, KL already
masked), ``postprocess_generator_output`` (the score on the last response token), and the loss sum of
``workers/worker.py`` (``policy_loss + coef·masked_mean(kl, mask, dim=-1).mean() −
ent_coef·masked_mean(entropy, mask)``, with the peer's ``masked_mean``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peers.makers import holes
from peers.makers.common import HP, inputs, install_stubs, mount, save

# (name, kl_estimator, kl_in, loss_reduction, policy_loss_type, eps_low, eps_high, ent_coef)
CASES: list[tuple[str, str, str, str, str, float, float, float]] = [
    ("default_k3_loss_token_mean", "k3", "loss", "token_mean", "regular", 0.2, 0.2, 0.0),
    ("k1_reward_sequence_mean", "k1", "reward", "sequence_mean", "regular", 0.2, 0.2, 0.0),
    ("k2_loss_sum_norm", "k2", "loss", "seq_mean_token_sum_norm", "regular", 0.2, 0.2, 0.0),
    ("abs_reward_dual_clip_asym", "abs", "reward", "token_mean", "dual_clip", 0.2, 0.28, 0.0),  # c = 1.5
    ("k3_loss_seqmean_entropy", "k3", "loss", "sequence_mean", "regular", 0.1, 0.3, 0.01),
]
DUAL_C = 1.5
"""``clip_ratio_c`` (small enough that ratios above it with A < 0 occur in the random batch)."""
CONTROLS: dict[str, dict[str, Any]] = {
    # flipping the option each case exercises must break the match
    "default_k3_loss_token_mean": {"kl_loss_agg": "token-mean"},
    "k1_reward_sequence_mean": {"value_loss_agg": "token-mean"},
    "k2_loss_sum_norm": {"gae_padding": "masked"},
    "abs_reward_dual_clip_asym": {"dual_clip": "none"},
    "k3_loss_seqmean_entropy": {"entropy_agg": "none"},
}
REDUCTION_TO_REFPPO = {
    "token_mean": "token-mean",
    "sequence_mean": "seq-mean-token-mean",
    "seq_mean_token_sum_norm": "seq-mean-token-sum-norm",
}


def make(out: Path) -> list[str]:
    """One dump per case of :data:`CASES`, then the multi-turn cases of
    :func:`peers.makers.holes.skyrl_cases`."""
    import functools

    import torch

    install_stubs()
    mount("skyrl_train")
    mount("skyrl_train.utils")
    from skyrl_train.utils import ppo_utils as pu  # type: ignore[import-not-found]  # side venv only

    made = []
    for i, (name, est, kl_in, red, plt, lo, hi, ent) in enumerate(CASES):
        x = inputs(400 + i, dtype=torch.float32)  # _safe_exp_delta computes the ratio in float32
        hp = dict(HP, cliprange=lo, ent_coef=ent)
        if hi != lo:
            hp["cliprange_high"] = hi
        cfg = _loss_config(red, x["response_mask"].shape[1], plt, lo, hi)
        dump = _skyrl_step(pu, cfg, x, est, kl_in, ent)
        conv: dict[str, Any] = {"kl_estimator": est, "kl_in": kl_in, "loss_agg": REDUCTION_TO_REFPPO[red]}
        if plt == "dual_clip":
            conv["dual_clip"] = DUAL_C
        control = CONTROLS.get(name, {"gae_padding": "masked"})
        made.append(save(out, f"skyrl_{name}", dump, hp, conv, control))
    return made + holes.skyrl_cases(pu, out, functools.partial(_loss_config, plt="regular", lo=0.2, hi=0.2))


def _loss_config(reduction: str, T: int, plt: str, lo: float, hi: float) -> Any:
    """The ``trainer.algorithm`` config SkyRL's policy and critic losses read (an ``OmegaConf``):
    ``policy_loss_type`` ``plt``, ``loss_reduction``, clip ``lo``/``hi``, ``clip_ratio_c``
    (:data:`DUAL_C`), ``max_seq_len = T``, the value clip."""
    from omegaconf import OmegaConf  # type: ignore[import-not-found]  # side venv only

    return OmegaConf.create(
        {
            "policy_loss_type": plt,
            "loss_reduction": reduction,
            "eps_clip_low": lo,
            "eps_clip_high": hi,
            "clip_ratio_c": DUAL_C,
            "use_tis": False,
            "max_seq_len": T,
            "value_clip": HP["cliprange_value"],
        }
    )


def _skyrl_step(pu: Any, cfg: Any, x: dict[str, Any], est: str, kl_in: str, ent: float) -> dict[str, Any]:
    """SkyRL's KL (``kl_in``: in the reward or as a loss), GAE, policy/critic losses under ``cfg``
    and the loss sum of ``worker.py`` on ``x``; returns the dump's tensors (``pu``: ppo_utils)."""
    import torch

    m = x["response_mask"]
    B = m.shape[0]
    kl = pu.compute_approx_kl(x["old_logprobs"], x["ref_logprobs"], loss_mask=m, kl_estimator_type=est)
    last = (m.sum(dim=1) - 1).long()
    rewards = torch.zeros_like(m)
    rewards[torch.arange(B), last] = x["scores"]  # postprocess_generator_output: reward on the last token
    if kl_in == "reward":
        rewards = rewards - kl * max(0.0, HP["kl_coef"])  # apply_reward_kl_penalty, restated
    adv, ret = pu.compute_gae_advantage_return(
        token_level_rewards=rewards,
        values=x["old_values"],
        response_mask=m,
        gamma=HP["gamma"],
        lambd=HP["lam"],
    )
    pg, clip_ratio = pu.ppo_policy_loss(x["logprobs"], x["old_logprobs"], adv, cfg, loss_mask=m)
    vf, vf_clipfrac = pu.ppo_critic_loss(x["values"], x["old_values"], ret, cfg, loss_mask=m)
    entropy = pu.masked_mean(x["entropy"], m)
    loss = pg - ent * entropy
    dump: dict[str, Any] = dict(x)
    if kl_in == "loss":
        kll = pu.compute_approx_kl(x["logprobs"], x["ref_logprobs"], loss_mask=m, kl_estimator_type=est)
        kl_loss = pu.masked_mean(kll, m, dim=-1).mean()
        loss = loss + kl_loss * HP["kl_coef"]
        dump["kl_loss"] = kl_loss.detach()
    dump.update(
        kl=kl,
        token_rewards=rewards,
        advantages=adv,
        returns=ret,
        pg_loss=pg.detach(),
        pg_clipfrac=torch.tensor(clip_ratio, dtype=m.dtype),
        vf_loss=vf.detach(),
        vf_clipfrac=torch.tensor(vf_clipfrac, dtype=m.dtype),
        entropy_loss=entropy.detach(),
        loss=loss.detach(),
    )
    return dump
