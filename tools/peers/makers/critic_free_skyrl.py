"""SkyRL-train 0.3.1's critic-free dumps (see :mod:`peers.makers.critic_free`; nothing from refppo).

``skyrl_train/utils/ppo_utils.py``: ``compute_approx_kl``, ``compute_grpo_outcome_advantage``
(``grpo_norm_by_std``), ``compute_rloo_outcome_advantage``,
``compute_reinforce_plus_plus_outcome_advantage``, ``ppo_policy_loss``, ``masked_mean``; restated:
``apply_reward_kl_penalty`` (``r − β·KL``) and the KL-in-loss sum. :func:`make_skyrl_no_reference`:
the same cases with no KL anywhere (β = 0: ``use_kl_in_reward`` and ``use_kl_loss`` off, no reference
model), dumps without ``ref_logprobs``/``kl`` (see :mod:`peers.makers.critic_free`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peers.makers.common import HP, install_stubs, mount, save
from peers.makers.critic_free import NOREF_HP, _grouped, _last_token, noref_control, without_reference

SKYRL_CASES: list[tuple[str, str, str, str, str, dict[str, Any], dict[str, Any]]] = [
    ("grpo", "grpo", "k3", "loss", "token_mean", {"advantage": "grpo"}, {"group_singleton": "zero"}),
    (
        "grpo_nostd",
        "grpo_nostd",
        "k3",
        "loss",
        "sequence_mean",
        {"advantage": "dr-grpo"},
        {"advantage": "grpo"},
    ),
    ("rloo", "rloo", "k1", "reward", "sequence_mean", {"advantage": "rloo"}, {"group_singleton": "score"}),
    (
        "reinforce_pp",
        "rpp",
        "k1",
        "reward",
        "token_mean",
        {"advantage": "reinforce++"},
        {"whiten_variance": "population"},
    ),
]
SKYRL_AGG = {"token_mean": "token-mean", "sequence_mean": "seq-mean-token-mean"}


def _skyrl_advantages(pu: Any, call: str, rewards: Any, m: Any, idx: Any) -> Any:
    """SkyRL's estimator ``call`` of a :data:`SKYRL_CASES` row: its ``(advantages, returns)``."""
    if call == "grpo":
        return pu.compute_grpo_outcome_advantage(rewards, m, idx, epsilon=1e-6)
    if call == "grpo_nostd":
        return pu.compute_grpo_outcome_advantage(rewards, m, idx, grpo_norm_by_std=False)
    if call == "rloo":
        return pu.compute_rloo_outcome_advantage(rewards, m, idx)
    return pu.compute_reinforce_plus_plus_outcome_advantage(rewards, m, HP["gamma"])


def make_skyrl_no_reference(out: Path) -> list[str]:
    """:func:`make_skyrl` at β = 0 without a reference."""
    return make_skyrl(out, no_reference=True)


def make_skyrl(out: Path, no_reference: bool = False) -> list[str]:
    import torch
    from omegaconf import OmegaConf  # type: ignore[import-not-found]  # side venv only

    install_stubs()
    mount("skyrl_train")
    mount("skyrl_train.utils")
    from skyrl_train.utils import ppo_utils as pu  # type: ignore[import-not-found]  # side venv only

    made = []
    for i, (name, call, est, kl_in, red, conv, control) in enumerate(SKYRL_CASES):
        x = _grouped(700 + i, torch.float32)  # _safe_exp_delta computes the ratio in float32
        m = x["response_mask"]
        idx = x["group_index"].numpy()
        x, kl_in = (without_reference(x), "none") if no_reference else (x, kl_in)
        kl: Any = None if no_reference else pu.compute_approx_kl(x["old_logprobs"], x["ref_logprobs"], m, est)
        rewards = _last_token(m, x["scores"])
        if kl_in == "reward":
            rewards = rewards - kl * HP["kl_coef"]  # apply_reward_kl_penalty, restated
        adv, ret = _skyrl_advantages(pu, call, rewards, m, idx)
        cfg = OmegaConf.create(
            {
                "policy_loss_type": "regular",
                "loss_reduction": red,
                "eps_clip_low": 0.2,
                "eps_clip_high": 0.28,
                "clip_ratio_c": 3.0,
                "use_tis": False,
                "max_seq_len": 10,
            }
        )
        pg, clip_ratio = pu.ppo_policy_loss(x["logprobs"], x["old_logprobs"], adv, cfg, loss_mask=m)
        loss = pg
        dump: dict[str, Any] = dict(x)
        if kl_in == "loss":
            kll = pu.compute_approx_kl(x["logprobs"], x["ref_logprobs"], loss_mask=m, kl_estimator_type=est)
            kl_loss = pu.masked_mean(kll, m, dim=-1).mean()
            loss = loss + kl_loss * HP["kl_coef"]
            dump["kl_loss"] = kl_loss.detach()
        if not no_reference:
            dump["kl"] = kl
        dump.update(
            token_rewards=rewards,
            advantages=adv,
            returns=ret,
            pg_loss=pg.detach(),
            pg_clipfrac=torch.tensor(clip_ratio, dtype=m.dtype),
            loss=loss.detach(),
        )
        if no_reference:
            hp = dict(NOREF_HP, **({"gamma": HP["gamma"]} if call == "rpp" else {}))
            keys = {"loss_agg": SKYRL_AGG[red], **conv}
            made.append(save(out, f"skyrl_{name}_noref", dump, hp, keys, noref_control(conv, control)))
            continue
        hp = dict(HP, cliprange_high=0.28)
        keys = {"kl_estimator": est, "kl_in": kl_in, "loss_agg": SKYRL_AGG[red], **conv}
        made.append(save(out, f"skyrl_{name}", dump, hp, keys, control))
    return made
