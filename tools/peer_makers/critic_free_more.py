"""Whole critic-free steps with the further estimators (issue #13 follow-up), from the peers' own code.

Run in the ``verl-openrlhf`` side venv (nothing from refppo is imported), as
:mod:`peer_makers.critic_free`: each case draws a grouped batch, calls the peer's advantage
estimator and its policy loss (and verl's KL loss where ``kl_in = loss``), and writes a dump without
``old_values``/``values`` that ``refppo diff --preset PEER --set advantage=EST`` must reproduce.

- verl 0.9.1 ``verl/trainer/ppo/core_algos.py``: ``compute_opo_outcome_advantage``,
  ``compute_gpg_outcome_advantage`` (two groups scored 0, so ``α = B/#{s ≠ 0}`` binds: the KL is
  in the loss, the reward is the score alone), ``compute_grpo_passk_outcome_advantage``
  (``norm_adv_by_std_in_grpo`` from the config, as ``AlgoConfig.get``; no group of one: verl raises
  on it), ``kl_penalty``, ``compute_policy_loss_vanilla``, ``agg_loss``. Restated:
  ``ray_trainer.apply_kl_penalty`` and the loss sum. verl's GPG recipe pairs the estimator with
  ``policy_loss.loss_mode: gpg`` (``−log π·A``, no ratio), which refppo has no policy loss for; the
  vanilla PPO loss (verl's default ``loss_mode``) is used with every estimator here.
- OpenRLHF 0.11.2: ``RemoteExperienceMaker.compute_advantages_and_returns`` with
  ``advantage.estimator = flash_reinforce`` (two experiences with permuted ``index``: the batch mean
  spans both), ``compute_approx_kl``, ``models/loss.py::PolicyLoss``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peer_makers.common import HP, install_stubs, mount, save
from peer_makers.critic_free import GROUP_IDS, VERL_KL, _grouped, _last_token, _openrlhf_advantages

NO_SINGLETON = [7, 3, 7, 11, 3, 7, 3, 11, 7, 3, 11, 11]
"""Groups of 4 (7), 4 (3), 4 (11): ``grpo_passk`` raises on a group of one."""

# (name, kl_estimator, kl_in, loss_agg_mode, group ids, --set keys, control)
VERL_MORE: list[tuple[str, str, str, str, list[int], dict[str, Any], dict[str, Any]]] = [
    ("opo", "k1", "reward", "token-mean", GROUP_IDS, {"advantage": "opo"}, {"advantage": "dr-grpo"}),
    ("gpg", "k3", "loss", "seq-mean-token-mean", GROUP_IDS, {"advantage": "gpg"}, {"advantage": "dr-grpo"}),
    (
        "grpo_passk",
        "k2",
        "reward",
        "seq-mean-token-sum",
        NO_SINGLETON,
        {"advantage": "grpo-passk"},
        {"advantage": "grpo"},
    ),
]


def _verl_advantages(ca: Any, name: str, rewards: Any, m: Any, idx: Any) -> tuple[Any, Any]:
    if name == "opo":
        return ca.compute_opo_outcome_advantage(rewards, m, idx)  # type: ignore[no-any-return]  # verl is untyped (side venv)
    if name == "gpg":
        return ca.compute_gpg_outcome_advantage(rewards, m, idx)  # type: ignore[no-any-return]  # verl is untyped (side venv)
    cfg = {"norm_adv_by_std_in_grpo": True}
    return ca.compute_grpo_passk_outcome_advantage(rewards, m, idx, config=cfg)  # type: ignore[no-any-return]  # verl is untyped (side venv)


def make_verl(out: Path) -> list[str]:
    import os

    import torch

    from peer_makers.verl_openrlhf import _VerlActorConfig

    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
    install_stubs()
    mount("verl")
    from verl.trainer.ppo import core_algos as ca  # type: ignore[import-not-found]  # side venv only

    made = []
    for i, (name, est, kl_in, agg, ids, conv, control) in enumerate(VERL_MORE):
        x = _grouped(800 + i, torch.float64, ids)
        m = x["response_mask"]
        idx = x["group_index"].numpy()
        if name == "gpg":  # two whole groups scored 0 (5 rows): α = B/#{s ≠ 0} = 12/7
            x["scores"] = torch.where(torch.isin(x["group_index"], torch.tensor([7, 5])), 0.0, x["scores"])
        kl = ca.kl_penalty(x["old_logprobs"], x["ref_logprobs"], kl_penalty=VERL_KL[est])
        rewards = _last_token(m, x["scores"])
        if kl_in == "reward":
            rewards = rewards - HP["kl_coef"] * kl * m  # ray_trainer.apply_kl_penalty, restated
        adv, ret = _verl_advantages(ca, name, rewards, m, idx)
        pg, metrics = ca.compute_policy_loss_vanilla(
            x["old_logprobs"],
            x["logprobs"],
            adv,
            m,
            loss_agg_mode=agg,
            config=_VerlActorConfig(0.2, 0.2, 0.28, 3.0),
        )
        loss = pg
        dump: dict[str, Any] = dict(x)
        if kl_in == "loss":
            kld = ca.kl_penalty(x["logprobs"], x["ref_logprobs"], kl_penalty=VERL_KL[est])
            kl_loss = ca.agg_loss(loss_mat=kld, loss_mask=m, loss_agg_mode=agg)
            loss = loss + kl_loss * HP["kl_coef"]
            dump["kl_loss"] = kl_loss.detach()
        dump.update(
            kl=kl,
            token_rewards=rewards,
            advantages=adv,
            returns=ret,
            pg_loss=pg.detach(),
            pg_clipfrac=torch.tensor(metrics["actor/pg_clipfrac"], dtype=torch.float64),
            approx_kl=torch.tensor(metrics["actor/ppo_kl"], dtype=torch.float64),
            loss=loss.detach(),
        )
        keys = {"kl_estimator": est, "kl_in": kl_in, "loss_agg": agg, **conv}
        made.append(save(out, f"verl_{name}", dump, dict(HP, cliprange_high=0.28), keys, control))
    return made


def make_openrlhf(out: Path) -> list[str]:
    import sys
    import types

    import torch

    install_stubs()
    for n in (
        "openrlhf",
        "openrlhf.models",
        "openrlhf.utils",
        "openrlhf.trainer",
        "openrlhf.trainer.ppo_utils",
    ):
        mount(n)
    launcher = types.ModuleType("openrlhf.trainer.ray.launcher")
    launcher.RayActorGroup = object  # type: ignore[attr-defined]  # stand-in; never used
    sys.modules["openrlhf.trainer.ray"] = types.ModuleType("openrlhf.trainer.ray")
    sys.modules[launcher.__name__] = launcher
    from openrlhf.models.loss import PolicyLoss  # type: ignore[import-not-found]  # side venv only
    from openrlhf.models.utils import compute_approx_kl  # type: ignore[import-not-found]  # side venv only

    ids = [k // 4 for k in range(12)]  # n_samples_per_prompt rows per prompt, in prompt order
    x = _grouped(900, torch.float32, ids)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(900)).tolist()
    kl = compute_approx_kl(x["old_logprobs"], x["ref_logprobs"], kl_estimator="k1")
    adv, ret = _openrlhf_advantages("flash_reinforce", x, kl, perm)
    m = x["response_mask"]
    pg, clip_ratio, ppo_kl, _, _ = PolicyLoss(0.2, 0.28, token_level_loss=True)(
        x["logprobs"], x["old_logprobs"], adv, action_mask=m
    )
    dump: dict[str, Any] = dict(x)
    dump.update(
        kl=kl,
        advantages=adv,
        returns=ret,
        pg_loss=pg.detach(),
        pg_clipfrac=clip_ratio.detach(),
        approx_kl=ppo_kl.detach(),
        loss=pg.detach().clone(),
    )
    hp = dict(HP, cliprange_high=0.28, gamma=1.0)
    keys = {"kl_estimator": "k1", "loss_agg": "token-mean", "advantage": "flash-reinforce"}
    return [save(out, "openrlhf_flash_reinforce", dump, hp, keys, {"advantage": "dr-grpo"})]
