"""Critic-free dumps (GRPO, Dr. GRPO, RLOO, REINFORCE++ and its baseline, OPO, GPG, GRPO pass@k,
flash-REINFORCE) from the peers' own code.

Run in the side venvs (nothing from refppo is imported). Each case draws a grouped batch (rows of
one prompt interleaved, ``group_index`` [B] integers; for verl and SkyRL a group of one), calls the
peer's advantage estimator and its policy loss, and writes a dump without ``old_values``/``values``
(no critic) that ``refppo diff --preset PEER --set advantage=EST`` must reproduce.

- verl 0.9.1 ``verl/trainer/ppo/core_algos.py``: ``kl_penalty``, ``compute_grpo_outcome_advantage``
  (``norm_adv_by_std_in_grpo`` True/False), ``compute_rloo_outcome_advantage``,
  ``compute_rloo_vectorized_outcome_advantage``,
  ``compute_reinforce_plus_plus_outcome_advantage``,
  ``compute_reinforce_plus_plus_baseline_outcome_advantage``, ``compute_opo_outcome_advantage``,
  ``compute_gpg_outcome_advantage`` (two groups scored 0, so ``α = B/#{s ≠ 0}`` binds: the KL is
  in the loss, the reward is the score alone), ``compute_grpo_passk_outcome_advantage``
  (``norm_adv_by_std_in_grpo`` from the config, as ``AlgoConfig.get``; no group of one: verl raises
  on it), ``compute_policy_loss_vanilla``, ``agg_loss``. Restated: ``ray_trainer.apply_kl_penalty``
  (``scores − β·KL·mask``) and the loss sum. verl's GPG recipe pairs the estimator with
  ``policy_loss.loss_mode: gpg`` (``−log π·A``, no ratio), which refppo has no policy loss for; the
  vanilla PPO loss (verl's default ``loss_mode``) is used with every estimator here.
- OpenRLHF 0.11.2: ``openrlhf/models/utils.py::compute_approx_kl``;
  ``RemoteExperienceMaker.compute_advantages_and_returns`` itself (called unbound on a stand-in
  ``self``, as ``tools/peers/group_estimators.py``; two experiences with permuted ``index``;
  ``flash_reinforce``'s batch mean spans both); ``models/loss.py::PolicyLoss``, ``aggregate_loss``.
  Its ``token_rewards`` (the shaped group reward at the last token) are not the format's and are
  left out; scores are ``randn`` so that ``reward.clip_range`` (±10, clamping the SHAPED reward)
  never binds (spec/conventions.md).
- SkyRL-train 0.3.1: :mod:`peers.makers.critic_free_skyrl` (its batches are :func:`_grouped`'s).

The verl ``opo``/``gpg``/``grpo_passk`` and OpenRLHF ``flash_reinforce`` cases (issue #13 follow-up)
draw their batches from their own seeds (:data:`SEEDS`).

``*_no_reference`` (issue #23 item 4): the same cases as the peer runs them with no KL anywhere
(β = 0, no reference model): verl with ``use_kl_in_reward`` and ``use_kl_loss`` off
(``RayPPOTrainer.fit``: ``token_level_rewards = token_level_scores``), OpenRLHF with no initial model
(``make_experience``: ``kl`` zeros, ``base_action_log_probs`` None, ``kl_ctl`` 0). The dumps hold
no ``ref_logprobs`` and no ``kl``; their sidecars no ``lam``, ``cliprange_value``, ``vf_coef``.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

from peers.makers.common import HP, inputs, install_stubs, mount, save
from peers.makers.verl_step import VerlActorConfig, kl_loss, policy_terms, reward_kl, score_at

GROUP_IDS = [7, 3, 7, 11, 3, 7, 3, 11, 7, 3, 11, 5]
"""Prompt of each row (B = 12): groups of 4 (7), 4 (3), 3 (11), 1 (5), interleaved."""
NO_SINGLETON = [7, 3, 7, 11, 3, 7, 3, 11, 7, 3, 11, 11]
"""Groups of 4 (7), 4 (3), 4 (11): ``grpo_passk`` raises on a group of one."""
CASE_GROUP_IDS = {"grpo_passk": NO_SINGLETON}
"""The cases whose rows are not :data:`GROUP_IDS` (verl)."""
SEEDS = {"opo": 800, "gpg": 801, "grpo_passk": 802, "flash_reinforce": 900}
"""Batch seeds of the issue #13 follow-up cases; the others draw ``500 + i`` (verl) and ``600 + i``
(OpenRLHF) by their index ``i`` in the case list."""


KL_KEYS = ("group_kl", "kl_in", "kl_estimator")
"""Convention keys that act only through the KL: a control flipping one proves nothing at β = 0."""
NOREF_HP: dict[str, float] = {"kl_coef": 0.0, "cliprange": 0.2, "cliprange_high": 0.28, "ent_coef": 0.0}
"""The sidecar of a β = 0 critic-free dump: only what its stages read (no ``lam``, ``cliprange_value``,
``vf_coef``; ``gamma`` added where REINFORCE++ reads it)."""


def noref_control(conv: dict[str, Any], control: dict[str, Any]) -> dict[str, Any]:
    """The case's control, unless it acts only through the KL (then the estimator flipped)."""
    if not set(control) & set(KL_KEYS):
        return control
    return {"advantage": "dr-grpo" if conv.get("advantage") == "grpo" else "grpo"}


def without_reference(x: dict[str, Any]) -> dict[str, Any]:
    """The batch without the reference's log-probs (a β = 0 trainer loads no reference model)."""
    return {k: v for k, v in x.items() if k != "ref_logprobs"}


def _grouped(seed: int, dtype: Any, group_ids: list[int] | None = None) -> dict[str, Any]:
    import torch

    ids = group_ids or GROUP_IDS
    x = inputs(seed, B=len(ids), T=10, dtype=dtype)
    for k in ("old_values", "values"):
        x.pop(k)
    x["scores"] = x["scores"] / 4.0  # randn
    x["group_index"] = torch.tensor(ids, dtype=torch.int64)
    return x


def _last_token(m: Any, scores: Any) -> Any:
    import torch

    r = torch.zeros_like(m)
    r[torch.arange(m.shape[0]), (m.sum(dim=1) - 1).long()] = scores
    return r


# (name, estimator call, kl_estimator, kl_in, loss_agg_mode, --set keys, control)
VERL_CASES: list[tuple[str, str, str, str, str, dict[str, Any], dict[str, Any]]] = [
    ("grpo", "grpo", "k1", "reward", "token-mean", {"advantage": "grpo"}, {"group_singleton": "zero"}),
    (
        "grpo_nostd",
        "grpo_nostd",
        "k3",
        "loss",
        "seq-mean-token-mean",
        {"advantage": "dr-grpo"},
        {"advantage": "grpo"},
    ),
    (
        "rloo",
        "rloo",
        "k2",
        "reward",
        "seq-mean-token-sum",
        {"advantage": "rloo"},
        {"group_singleton": "zero"},
    ),
    (
        "rloo_vectorized",
        "rloo_vectorized",
        "k1",
        "reward",
        "token-mean",
        {"advantage": "rloo", "group_singleton": "zero"},
        {"group_singleton": "score"},
    ),
    (
        "reinforce_plus_plus",
        "rpp",
        "k1",
        "reward",
        "token-mean",
        {"advantage": "reinforce++"},
        {"whiten_variance": "population"},
    ),
    (
        "reinforce_plus_plus_baseline",
        "rpp_baseline",
        "k1",
        "reward",
        "token-mean",
        {"advantage": "reinforce++-baseline"},
        {"group_singleton": "zero"},
    ),
    ("opo", "opo", "k1", "reward", "token-mean", {"advantage": "opo"}, {"advantage": "dr-grpo"}),
    ("gpg", "gpg", "k3", "loss", "seq-mean-token-mean", {"advantage": "gpg"}, {"advantage": "dr-grpo"}),
    (
        "grpo_passk",
        "grpo_passk",
        "k2",
        "reward",
        "seq-mean-token-sum",
        {"advantage": "grpo-passk"},
        {"advantage": "grpo"},
    ),
]


def _verl_advantages(ca: Any, call: str, rewards: Any, m: Any, idx: Any) -> Any:
    """verl's estimator ``call`` of a :data:`VERL_CASES` row on the token ``rewards`` ``[B, T]``:
    its ``(advantages, returns)`` (verl is untyped: Any)."""
    if call == "grpo":
        return ca.compute_grpo_outcome_advantage(rewards, m, idx, epsilon=1e-6)
    if call == "grpo_nostd":
        return ca.compute_grpo_outcome_advantage(rewards, m, idx, norm_adv_by_std_in_grpo=False)
    if call == "rloo":
        return ca.compute_rloo_outcome_advantage(rewards, m, idx)
    if call == "rloo_vectorized":
        return ca.compute_rloo_vectorized_outcome_advantage(rewards, m, idx)
    if call == "rpp":
        cfg = types.SimpleNamespace(gamma=HP["gamma"])
        return ca.compute_reinforce_plus_plus_outcome_advantage(rewards, m, config=cfg)
    if call == "opo":
        return ca.compute_opo_outcome_advantage(rewards, m, idx)
    if call == "gpg":
        return ca.compute_gpg_outcome_advantage(rewards, m, idx)
    if call == "grpo_passk":
        passk = {"norm_adv_by_std_in_grpo": True}
        return ca.compute_grpo_passk_outcome_advantage(rewards, m, idx, config=passk)
    return ca.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, m, idx)


def make_verl_no_reference(out: Path) -> list[str]:
    """:func:`make_verl` at β = 0 without a reference (module doc)."""
    return make_verl(out, no_reference=True)


def make_verl(out: Path, no_reference: bool = False) -> list[str]:
    """One dump per case of :data:`VERL_CASES` (batches of :func:`_grouped`)."""
    import os

    import torch

    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
    install_stubs()
    mount("verl")
    from verl.trainer.ppo import core_algos as ca  # type: ignore[import-not-found]  # side venv only

    made = []
    for i, (name, call, est, kl_in, agg, conv, control) in enumerate(VERL_CASES):
        x = _grouped(SEEDS.get(name, 500 + i), torch.float64, CASE_GROUP_IDS.get(name))
        if call == "gpg":  # two whole groups scored 0 (5 rows): α = B/#{s ≠ 0} = 12/7
            x["scores"] = torch.where(torch.isin(x["group_index"], torch.tensor([7, 5])), 0.0, x["scores"])
        if no_reference:
            dump = _verl_noref_step(ca, without_reference(x), call, agg)
            hp = dict(NOREF_HP, **({"gamma": HP["gamma"]} if call == "rpp" else {}))
            keys = {"loss_agg": agg, **conv}
            made.append(save(out, f"verl_{name}_noref", dump, hp, keys, noref_control(conv, control)))
            continue
        dump = _verl_step(ca, x, call, est, kl_in, agg)
        hp = dict(HP, cliprange_high=0.28)
        set_keys = {"kl_estimator": est, "kl_in": kl_in, "loss_agg": agg, **conv}
        made.append(save(out, f"verl_{name}", dump, hp, set_keys, control))
    return made


def _verl_noref_step(ca: Any, x: dict[str, Any], call: str, agg: str) -> dict[str, Any]:
    """verl with no KL anywhere: the score at the last token is the reward (``RayPPOTrainer.fit``),
    the estimator, the vanilla policy loss; the loss is the policy loss (no KL loss)."""
    m = x["response_mask"]
    rewards = score_at(m, x["scores"], (m.sum(dim=1) - 1).long())
    adv, ret = _verl_advantages(ca, call, rewards, m, x["group_index"].numpy())
    cfg = VerlActorConfig(0.2, 0.2, 0.28, 3.0)
    pg, metrics = ca.compute_policy_loss_vanilla(
        x["old_logprobs"], x["logprobs"], adv, m, loss_agg_mode=agg, config=cfg
    )
    dump: dict[str, Any] = dict(x)
    dump.update(
        token_rewards=rewards, advantages=adv, returns=ret, **policy_terms(pg, metrics), loss=pg.detach()
    )
    if call == "rpp_baseline":  # as in _verl_step: verl's "returns" are the whitened advantages
        dump.pop("returns")
    return dump


def _verl_step(ca: Any, x: dict[str, Any], call: str, est: str, kl_in: str, agg: str) -> dict[str, Any]:
    """verl's KL, critic-free advantages (:func:`_verl_advantages`), vanilla policy loss (clip 0.2 /
    0.28, c = 3) and KL loss on the grouped batch ``x``; returns the dump's tensors (``ca``: core_algos)."""
    m = x["response_mask"]
    idx = x["group_index"].numpy()
    kl, rewards = reward_kl(ca, x, est, kl_in)
    adv, ret = _verl_advantages(ca, call, rewards, m, idx)
    pg, metrics = ca.compute_policy_loss_vanilla(
        x["old_logprobs"],
        x["logprobs"],
        adv,
        m,
        loss_agg_mode=agg,
        config=VerlActorConfig(0.2, 0.2, 0.28, 3.0),
    )
    dump: dict[str, Any] = dict(x)
    loss = kl_loss(ca, x, est, kl_in, agg, dump, pg)
    dump.update(kl=kl, token_rewards=rewards, advantages=adv, returns=ret, **policy_terms(pg, metrics))
    dump.update(loss=loss.detach())
    if call == "rpp_baseline":
        # verl returns (whitened, whitened): its "returns" are the whitened advantages, which feed
        # nothing without a critic; the format's critic-free returns are the raw ones (spec).
        dump.pop("returns")
    return dump


# (OpenRLHF estimator, kl_estimator, token_level_loss, --set keys, control)
OPENRLHF_CASES: list[tuple[str, str, bool, dict[str, Any], dict[str, Any]]] = [
    ("group_norm", "k1", True, {"advantage": "grpo"}, {"group_kl": "fold"}),
    ("dr_grpo", "k3", False, {"advantage": "dr-grpo"}, {"group_kl": "fold"}),
    ("rloo", "k2", True, {"advantage": "rloo"}, {"advantage": "dr-grpo"}),
    (
        "reinforce_baseline",
        "k1",
        True,
        {"advantage": "reinforce++-baseline"},
        {"whiten_variance": "unbiased"},
    ),
    ("reinforce", "k1", False, {"advantage": "reinforce++"}, {"whiten_variance": "unbiased"}),
    ("flash_reinforce", "k1", True, {"advantage": "flash-reinforce"}, {"advantage": "dr-grpo"}),
]


def _openrlhf_advantages(
    est: str, x: dict[str, Any], kl: Any, perm: list[int], beta: float = HP["kl_coef"]
) -> tuple[Any, Any]:
    """``compute_advantages_and_returns`` on two experiences (rows ``perm[:5]`` and ``perm[5:]``)."""
    import torch
    from openrlhf.trainer.ppo_utils.experience_maker import (  # type: ignore[import-not-found]  # side venv
        RemoteExperienceMaker,
    )

    adv_cfg = types.SimpleNamespace(
        estimator=est, gamma=HP["gamma"] if est == "reinforce" else 1.0, lambd=1.0, no_std_norm=False
    )
    args = types.SimpleNamespace(
        reward=types.SimpleNamespace(clip_range=(-10.0, 10.0)),  # the cli default
        rollout=types.SimpleNamespace(n_samples_per_prompt=4),
        algo=types.SimpleNamespace(advantage=adv_cfg),
    )
    me = types.SimpleNamespace(
        strategy=types.SimpleNamespace(args=args),
        kl_ctl=types.SimpleNamespace(value=beta),
        advantage_estimator=est,
    )
    me.get_cumulative_returns = types.MethodType(RemoteExperienceMaker.get_cumulative_returns, me)
    parts = (perm[:5], perm[5:])
    exps = [
        types.SimpleNamespace(
            rewards=x["scores"][torch.tensor(p)].clone(),
            index=p,
            kl=kl[torch.tensor(p)].clone(),
            action_mask=x["response_mask"][torch.tensor(p)].clone(),
            info={},
            values=None,
        )
        for p in parts
    ]
    RemoteExperienceMaker.compute_advantages_and_returns(me, exps)
    B, T = x["response_mask"].shape
    adv = torch.empty(B, T, dtype=x["response_mask"].dtype)
    ret = torch.empty(B, T, dtype=x["response_mask"].dtype)
    for p, e in zip(parts, exps, strict=True):
        adv[torch.tensor(p)] = e.advantages.to(adv.dtype)
        ret[torch.tensor(p)] = e.returns.to(ret.dtype)
    return adv, ret


def make_openrlhf_no_reference(out: Path) -> list[str]:
    """:func:`make_openrlhf` at β = 0 without a reference (module doc)."""
    return make_openrlhf(out, no_reference=True)


def make_openrlhf(out: Path, no_reference: bool = False) -> list[str]:
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

    made = []
    ids = [k // 4 for k in range(12)]  # OpenRLHF: n_samples_per_prompt rows per prompt, in prompt order
    for i, (est, kl_est, token_level, conv, control) in enumerate(OPENRLHF_CASES):
        seed = SEEDS.get(est, 600 + i)
        x = _grouped(seed, torch.float32, ids)
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(12, generator=g).tolist()
        if no_reference:  # make_experience without an initial model: kl zeros, kl_ctl 0
            x = without_reference(x)
            kl = torch.zeros_like(x["old_logprobs"])
        else:
            kl = compute_approx_kl(x["old_logprobs"], x["ref_logprobs"], kl_estimator=kl_est)
        adv, ret = _openrlhf_advantages(est, x, kl, perm, 0.0 if no_reference else HP["kl_coef"])
        m = x["response_mask"]
        pg, clip_ratio, ppo_kl, _, _ = PolicyLoss(0.2, 0.28, token_level_loss=token_level)(
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
        agg = "token-mean" if token_level else "seq-mean-token-mean"
        if no_reference:
            dump.pop("kl")
            hp = dict(NOREF_HP, **({"gamma": HP["gamma"]} if est == "reinforce" else {}))
            keys = {"loss_agg": agg, **conv}
            made.append(save(out, f"openrlhf_{est}_noref", dump, hp, keys, noref_control(conv, control)))
            continue
        hp = dict(HP, cliprange_high=0.28, gamma=HP["gamma"] if est == "reinforce" else 1.0)
        made.append(
            save(out, f"openrlhf_{est}", dump, hp, {"kl_estimator": kl_est, "loss_agg": agg, **conv}, control)
        )
    return made


# (name, estimator call, kl_estimator, kl_in, loss_reduction, --set keys, control)
