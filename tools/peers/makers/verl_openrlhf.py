"""verl 0.9.1 and OpenRLHF 0.11.2 dumps from their own functions (``verl-openrlhf`` venv).

verl (``verl/trainer/ppo/core_algos.py``): ``kl_penalty``, ``compute_gae_advantage_return`` (GAE +
``masked_whiten``), ``compute_policy_loss_vanilla`` (asymmetric ``clip_ratio_low/high``, dual clip
``clip_ratio_c``), ``compute_value_loss``, ``agg_loss`` (every ``loss_agg_mode``; the KL loss and
the entropy as ``verl/workers/utils/losses.py::ppo_loss`` aggregates them). Restated:
``ray_trainer.apply_kl_penalty`` (``scores − β·KL·mask``: the real function wants a ``DataProto``)
and the loss sum of ``ppo_loss`` (``pg − entropy_coeff·entropy + kl_loss_coef·kl_loss``).

OpenRLHF: ``openrlhf/models/utils.py::compute_approx_kl``, ``compute_reward``;
``trainer/ppo_utils/experience_maker.py::get_advantages_and_returns`` (a method that does not use
``self``); ``models/loss.py::PolicyLoss`` (``eps_clip_low_high``, ``dual_clip``, ``token_level_loss``),
``ValueLoss`` (built as ``trainer/ray/ppo_critic.py`` builds it: always token-level) and
``aggregate_loss`` (KL loss and entropy as ``trainer/ray/ppo_actor.py::training_step`` calls it,
without ``token_level_loss``). Restated: the batch whitening of ``compute_advantages_and_returns``
(masked mean, population variance, ``clamp(var, 1e-8).rsqrt()``; the real method wants a list of
``Experience``) and the loss sum of ``training_step``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from peers.makers import holes
from peers.makers.common import HP, inputs, install_stubs, mount, save
from peers.makers.openrlhf_step import openrlhf_fns, shaped_gae
from peers.makers.verl_step import VerlActorConfig, critic, entropy, kl_loss, policy_terms, reward_kl

# (estimator, kl_in, loss_agg_mode, clip_low, clip_high, clip_ratio_c, entropy_coeff)
VERL_CASES: list[tuple[str, str, str, float, float | None, float, float]] = [
    ("k1", "reward", "token-mean", 0.2, None, 3.0, 0.0),
    ("k3", "reward", "seq-mean-token-mean", 0.2, None, 3.0, 0.0),
    ("k2", "reward", "seq-mean-token-sum", 0.2, None, 3.0, 0.0),
    ("abs", "reward", "seq-mean-token-sum-norm", 0.2, None, 3.0, 0.0),
    ("k1", "reward", "token-sum", 0.2, None, 3.0, 0.0),
    ("k3", "loss", "token-mean", 0.2, 0.28, 2.0, 0.01),
    ("k2", "loss", "seq-mean-token-mean", 0.1, 0.3, 3.0, 0.02),
]


def make_verl(out: Path) -> list[str]:

    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
    install_stubs()
    mount("verl")
    from verl.trainer.ppo import core_algos as ca  # type: ignore[import-not-found]  # side venv only

    made = []
    for i, (est, kl_in, agg, lo, hi, c, ent) in enumerate(VERL_CASES):
        x = inputs(100 + i)
        kl, rewards = reward_kl(ca, x, est, kl_in)
        adv, ret = ca.compute_gae_advantage_return(
            rewards, x["old_values"], x["response_mask"], HP["gamma"], HP["lam"]
        )
        pg, metrics = ca.compute_policy_loss_vanilla(
            x["old_logprobs"],
            x["logprobs"],
            adv,
            x["response_mask"],
            loss_agg_mode=agg,
            config=VerlActorConfig(lo, lo, hi, c),
        )
        ent_term = entropy(ca, x, agg)
        dump: dict[str, Any] = dict(x)
        loss = kl_loss(ca, x, est, kl_in, agg, dump, pg - ent * ent_term)
        dump.update(kl=kl, token_rewards=rewards, advantages=adv, returns=ret, **policy_terms(pg, metrics))
        dump.update(critic(ca, x, ret, agg), entropy_loss=ent_term.detach(), loss=loss.detach())
        hp = dict(HP, cliprange=lo, ent_coef=ent)
        if hi is not None:
            hp["cliprange_high"] = hi
        conv = {"kl_estimator": est, "kl_in": kl_in, "loss_agg": agg, "dual_clip": c}
        name = f"verl_{est}_{kl_in}_{agg}_c{c}" + (f"_hi{hi}" if hi else "")
        other = "token-mean" if agg != "token-mean" else "seq-mean-token-mean"
        made.append(save(out, name, dump, hp, conv, {"loss_agg": other}))
    return made + holes.verl_cases(ca, out, VerlActorConfig(0.2, 0.2, None, 3.0))


# (estimator, kl_in, token_level, eps_low, eps_high, dual_clip, entropy_coef)
OPENRLHF_CASES: list[tuple[str, str, bool, float, float, float | None, float]] = [
    ("k1", "reward", True, 0.2, 0.2, None, 0.0),
    ("k3", "reward", False, 0.2, 0.2, None, 0.0),
    ("k2", "reward", True, 0.2, 0.2, None, 0.0),
    ("k3", "loss", False, 0.2, 0.28, 3.0, 0.01),
    ("k1", "loss", True, 0.1, 0.3, 2.0, 0.02),
]


def make_openrlhf(out: Path) -> list[str]:
    """One dump per case of :data:`OPENRLHF_CASES`, then the multi-turn cases of
    :func:`peers.makers.holes.openrlhf_cases`."""
    fns = openrlhf_fns()
    made = []
    for i, (est, kl_in, token_level, lo, hi, dual, ent) in enumerate(OPENRLHF_CASES):
        x = inputs(200 + i)
        dump = _openrlhf_step(fns, x, est, kl_in, token_level, (lo, hi), dual, ent)
        agg = "token-mean" if token_level else "seq-mean-token-mean"
        hp = dict(HP, cliprange=lo, ent_coef=ent)
        if hi != lo:
            hp["cliprange_high"] = hi
        conv: dict[str, Any] = {"kl_estimator": est, "kl_in": kl_in, "loss_agg": agg}
        if dual is not None:
            conv["dual_clip"] = dual
        name = f"openrlhf_{est}_{kl_in}_{agg}" + (f"_dual{dual}" if dual else "")
        # the flip: the KL loss's own aggregation (sequence-level actor), else dual clip, else the variance
        control: dict[str, Any] = {"kl_loss_agg": "none"} if kl_in == "loss" and not token_level else {}
        control = control or ({"dual_clip": "none"} if dual else {"whiten_variance": "unbiased"})
        made.append(save(out, name, dump, hp, conv, control))
    return made + holes.openrlhf_cases(fns, out)


def _openrlhf_step(
    fns: dict[str, Any],
    x: dict[str, Any],
    est: str,
    kl_in: str,
    token_level: bool,
    eps: tuple[float, float],
    dual: float | None,
    ent: float,
) -> dict[str, Any]:
    """OpenRLHF's KL, shaped reward, GAE, the batch whitening (restated), its policy/value losses and
    the loss sum of ``training_step`` on ``x``; returns the dump's tensors."""
    m = x["response_mask"]
    kl, rewards, adv, ret = shaped_gae(fns, x, est, HP["kl_coef"] if kl_in == "reward" else 0.0)
    pg, clip_ratio, ppo_kl, _, _ = fns["PolicyLoss"](*eps, dual_clip=dual, token_level_loss=token_level)(
        x["logprobs"], x["old_logprobs"], adv, action_mask=m
    )
    vl = fns["ValueLoss"](HP["cliprange_value"])  # as trainer/ray/ppo_critic.py builds it: always token-level
    vf = vl(x["values"], x["old_values"], ret, action_mask=m)
    entropy = fns["aggregate_loss"](x["entropy"], m)  # training_step: no token_level_loss passed
    loss = pg - ent * entropy
    dump: dict[str, Any] = dict(x)
    if kl_in == "loss":
        kll = fns["compute_approx_kl"](x["logprobs"], x["ref_logprobs"], kl_estimator=est)
        kl_loss = fns["aggregate_loss"](kll, m)
        loss = loss + kl_loss * HP["kl_coef"]
        dump["kl_loss"] = kl_loss.detach()
    dump.update(
        kl=kl,
        token_rewards=rewards,
        advantages=adv,
        returns=ret,
        pg_loss=pg.detach(),
        pg_clipfrac=clip_ratio.detach(),
        approx_kl=ppo_kl.detach(),
        vf_loss=(vf[0] if isinstance(vf, tuple) else vf).detach(),
        entropy_loss=entropy.detach(),
        loss=loss.detach(),
    )
    return dump
