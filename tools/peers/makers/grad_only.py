"""Gradient-only v2 step dumps from the peers' OWN micro-batch code: two data-parallel ranks × two
micro-batches, the gradient of each micro-batch's loss accumulated on the ``[B, T]`` leaves, no
scalar loss in the dump (what such a trainer holds per micro-batch). Run in the side venvs; nothing
from refppo. For ``tools/peers detect-grads`` (:mod:`peers.detect_grads`).

Each rank ``r`` runs its micro-batches with the peer's normalisation, its local gradient ``g_r`` is
accumulated, and DDP's mean over the ``W`` ranks gives ``grad[rows of r] = g_r / W``
(spec/dump-format.md, "The exact DDP statement"). Called per micro-batch:

- verl 0.9.1 (``verl/trainer/ppo/core_algos.py``): ``compute_policy_loss_vanilla`` with the global
  batch info the FSDP engine assigns (``config.global_batch_info``: ``dp_size``,
  ``batch_num_tokens``, ``global_batch_size``), ``compute_value_loss`` and ``agg_loss`` (the KL loss)
  with the same; the micro-batch losses summed (``forward_backward_batch``). Control: without the
  global batch info (``agg_loss``'s fallback, each micro-batch by its own counts).
- OpenRLHF 0.11.2 (``openrlhf/models/loss.py``): ``PolicyLoss`` / ``ValueLoss`` / ``aggregate_loss``
  with ``loss_batch_info`` as ``utils/loss_utils.py::_optimizer_step_loss_norm`` makes it (the step's
  token and sequence counts ``/ gas``, ``dp_size``), each micro-batch loss ``/ gas`` (DeepSpeed's
  gradient accumulation, restated). Control: ``loss_batch_info`` None (``masked_mean`` per
  micro-batch).
- SkyRL-train 0.3.1 (``skyrl_train/utils/ppo_utils.py``): ``ppo_policy_loss``, ``ppo_critic_loss``,
  each micro-batch loss ``/ accumulation_steps`` (``workers/worker.py::forward_backward``,
  restated); equal rows per micro-batch, as SkyRL's micro-batches have. Control: ``token_mean``,
  whose per-micro-batch token mean is no global convention when the micro-batches hold unequal
  token counts.

The rollout (advantages, returns) is each peer's own, as in the peer's preset makers. A case's
``NAME.set.json`` holds the ``--set`` keys over the peer's preset; a control's name ends with
:data:`CONTROL` and its generating convention must NOT be listed by ``--detect``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from peers.makers.common import HP, inputs, install_stubs, mount, save

CONTROL = "__control"
RANK = [0, 0, 0, 0, 1, 1, 1, 1]
MICRO = [0, 0, 1, 1, 0, 0, 1, 1]
"""Row → rank and micro-batch: two rows per micro-batch (unequal token counts)."""
W, K = 2, 2
GRAD_HP = {**HP, "vf_coef": 1.0, "separate_critic": True, "world_size": W, "micro_batches": K}
"""The critic has its own optimizer in all three (``grad_values = ∂vf_loss/∂V``)."""

LossFn = Callable[[Any, Any, Any], tuple[Any, Any]]
"""``(rows, logprobs leaf, values leaf) -> (policy objective, value objective)`` of one micro-batch,
as the trainer passes them to ``backward``."""


def _step(x: dict[str, Any], loss_fn: LossFn) -> dict[str, Any]:
    """The gradient of the step as the optimizer sees it: per rank, per micro-batch, ``backward`` of
    ``loss_fn``'s objectives on leaves of that micro-batch's rows; rank ``r`` carries ``1/W``."""
    import torch

    g_lp = torch.zeros_like(x["logprobs"])
    g_v = torch.zeros_like(x["values"])
    for r in range(W):
        for k in range(K):
            rows = torch.tensor([b for b in range(len(RANK)) if RANK[b] == r and MICRO[b] == k])
            lp = x["logprobs"][rows].clone().requires_grad_(True)
            v = x["values"][rows].clone().requires_grad_(True)
            pol, val = loss_fn(rows, lp, v)
            gl, gv = torch.autograd.grad(pol, lp), torch.autograd.grad(val, v)
            g_lp[rows] += gl[0] / W
            g_v[rows] += gv[0] / W
    return {
        "grad_logprobs": g_lp,
        "grad_values": g_v,
        "rank": torch.tensor(RANK),
        "micro_batch": torch.tensor(MICRO),
    }


def _write(out: Path, name: str, dump: dict[str, Any], hp: dict[str, Any], conv: dict[str, Any]) -> str:
    """The dump without any scalar (``pg_loss``, ``vf_loss``, ``loss``, …): gradients only."""
    kept = {k: v for k, v in dump.items() if v.dim() > 0}
    return save(out, name, kept, hp, conv)


# (estimator, kl_in, loss_agg_mode, clip_low, clip_high, clip_ratio_c)
VERL_CASES: list[tuple[str, str, str, float, float | None, float]] = [
    ("k1", "reward", "token-mean", 0.2, None, 3.0),
    ("k3", "reward", "seq-mean-token-mean", 0.2, 0.28, 3.0),
    ("k2", "loss", "seq-mean-token-sum", 0.2, None, 1.5),
    ("k3", "loss", "token-sum", 0.1, 0.3, 3.0),
]


def make_verl(out: Path) -> list[str]:
    from peers.makers.verl_step import VerlActorConfig, reward_kl

    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
    install_stubs()
    mount("verl")
    from verl.trainer.ppo import core_algos as ca  # type: ignore[import-not-found]  # side venv only

    made = []
    for i, (est, kl_in, agg, lo, hi, c) in enumerate(VERL_CASES):
        x = inputs(700 + i)
        m = x["response_mask"]
        kl, rewards = reward_kl(ca, x, est, kl_in)
        adv, ret = ca.compute_gae_advantage_return(rewards, x["old_values"], m, HP["gamma"], HP["lam"])
        dump: dict[str, Any] = dict(x, kl=kl, token_rewards=rewards, advantages=adv, returns=ret)
        hp = dict(GRAD_HP, cliprange=lo)
        if hi is not None:
            hp["cliprange_high"] = hi
        conv = {"kl_estimator": est, "kl_in": kl_in, "loss_agg": agg, "dual_clip": c}
        full = {"dp_size": W, "batch_num_tokens": int(m.sum()), "global_batch_size": m.shape[0]}
        for suffix, info in (("", full), (CONTROL, {})):  # the control: agg_loss's local fallback
            cfg = VerlActorConfig(lo, lo, hi, c)
            cfg.global_batch_info = info
            loss_fn = _verl_loss(ca, x, (adv, ret), (est, kl_in, agg), cfg)
            name = f"verl_grads_{est}_{kl_in}_{agg}{suffix}"
            made.append(_write(out, name, {**dump, **_step(x, loss_fn)}, hp, conv))
    return made


def _verl_loss(
    ca: Any, x: dict[str, Any], adv_ret: tuple[Any, Any], case: tuple[str, str, str], cfg: Any
) -> LossFn:
    """verl's ``compute_policy_loss_vanilla`` (+ ``agg_loss`` of its KL loss) and
    ``compute_value_loss`` with ``cfg.global_batch_info``; the micro-batch losses summed (FSDP)."""
    from peers.makers.verl_step import VERL_KL

    (adv, ret), (est, kl_in, agg) = adv_ret, case
    m, info = x["response_mask"], cfg.global_batch_info

    def loss_fn(rows: Any, lp: Any, v: Any) -> tuple[Any, Any]:
        mr = m[rows]
        pg, _ = ca.compute_policy_loss_vanilla(
            x["old_logprobs"][rows], lp, adv[rows], mr, loss_agg_mode=agg, config=cfg
        )
        if kl_in == "loss":
            kld = ca.kl_penalty(lp, x["ref_logprobs"][rows], kl_penalty=VERL_KL[est])
            pg = pg + HP["kl_coef"] * ca.agg_loss(loss_mat=kld, loss_mask=mr, loss_agg_mode=agg, **info)
        vf, _ = ca.compute_value_loss(
            v, ret[rows], x["old_values"][rows], mr, cliprange_value=HP["cliprange_value"],
            loss_agg_mode=agg, **info,
        )  # fmt: skip
        return pg, vf

    return loss_fn


# (estimator, kl_in, token_level, eps_low, eps_high, dual_clip)
OPENRLHF_CASES: list[tuple[str, str, bool, float, float, float | None]] = [
    ("k1", "reward", True, 0.2, 0.2, None),
    ("k3", "reward", False, 0.2, 0.28, 3.0),
    ("k2", "loss", True, 0.1, 0.3, 1.5),
]


def make_openrlhf(out: Path) -> list[str]:
    import torch

    from peers.makers.openrlhf_step import openrlhf_fns, shaped_gae

    fns = openrlhf_fns()
    made = []
    for i, (est, kl_in, token_level, lo, hi, dual) in enumerate(OPENRLHF_CASES):
        x = inputs(800 + i)
        m = x["response_mask"]
        kl, rewards, adv, ret = shaped_gae(fns, x, est, HP["kl_coef"] if kl_in == "reward" else 0.0)
        dump: dict[str, Any] = dict(x, kl=kl, token_rewards=rewards, advantages=adv, returns=ret)
        agg = "token-mean" if token_level else "seq-mean-token-mean"
        hp = dict(GRAD_HP, cliprange=lo)
        if hi != lo:
            hp["cliprange_high"] = hi
        conv: dict[str, Any] = {"kl_estimator": est, "kl_in": kl_in, "loss_agg": agg}
        if dual is not None:
            conv["dual_clip"] = dual
        # _optimizer_step_loss_norm: the step's totals (every rank's micro-batches) / gas
        step_info = {
            "dp_size": W,
            "batch_num_tokens": torch.as_tensor(float(m.sum()) / K),
            "global_batch_size": torch.as_tensor(float(m.shape[0]) / K),
        }
        for suffix, info in (("", step_info), (CONTROL, {})):  # the control: masked_mean per micro-batch
            policy = fns["PolicyLoss"](lo, hi, dual_clip=dual, token_level_loss=token_level)
            loss_fn = _openrlhf_loss(fns, x, (adv, ret), (est, kl_in), policy, info)
            name = f"openrlhf_grads_{est}_{kl_in}_{agg}{suffix}"
            made.append(_write(out, name, {**dump, **_step(x, loss_fn)}, hp, conv))
    return made


def _openrlhf_loss(
    fns: dict[str, Any],
    x: dict[str, Any],
    adv_ret: tuple[Any, Any],
    case: tuple[str, str],
    policy: Any,
    info: Any,
) -> LossFn:
    """OpenRLHF's ``PolicyLoss`` (+ ``aggregate_loss`` of its KL), ``ValueLoss`` (token level, as
    ``trainer/ray/ppo_critic.py`` builds it) with ``loss_batch_info`` ``info``, each ``/ gas``
    (DeepSpeed's gradient accumulation)."""
    (adv, ret), (est, kl_in) = adv_ret, case
    m = x["response_mask"]
    value = fns["ValueLoss"](HP["cliprange_value"])

    def loss_fn(rows: Any, lp: Any, v: Any) -> tuple[Any, Any]:
        mr = m[rows]
        pg = policy(lp, x["old_logprobs"][rows], adv[rows], action_mask=mr, **info)[0]
        if kl_in == "loss":
            kll = fns["compute_approx_kl"](lp, x["ref_logprobs"][rows], kl_estimator=est)
            pg = pg + HP["kl_coef"] * fns["aggregate_loss"](kll, mr, **info)
        vf = value(v, x["old_values"][rows], ret[rows], action_mask=mr, **info)
        vf = vf[0] if isinstance(vf, tuple) else vf
        return pg / K, vf / K

    return loss_fn


# (name, kl_estimator, kl_in, loss_reduction, policy_loss_type, eps_low, eps_high)
SKYRL_CASES: list[tuple[str, str, str, str, str, float, float]] = [
    ("k1_reward_sequence_mean", "k1", "reward", "sequence_mean", "regular", 0.2, 0.2),
    ("k3_loss_sum_norm", "k3", "loss", "seq_mean_token_sum_norm", "regular", 0.2, 0.28),
    ("k2_reward_dual_seqmean", "k2", "reward", "sequence_mean", "dual_clip", 0.2, 0.2),
    ("k1_reward_token_mean", "k1", "reward", "token_mean", "regular", 0.2, 0.2),
]
"""The last one is the control: SkyRL's token mean is per micro-batch."""


def make_skyrl(out: Path) -> list[str]:
    import torch

    from peers.makers.skyrl import DUAL_C, REDUCTION_TO_REFPPO, _loss_config

    install_stubs()
    mount("skyrl_train")
    mount("skyrl_train.utils")
    from skyrl_train.utils import ppo_utils as pu  # type: ignore[import-not-found]  # side venv only

    made = []
    for i, (name, est, kl_in, red, plt, lo, hi) in enumerate(SKYRL_CASES):
        x = inputs(900 + i, dtype=torch.float32)
        m = x["response_mask"]
        B = m.shape[0]
        kl = pu.compute_approx_kl(x["old_logprobs"], x["ref_logprobs"], loss_mask=m, kl_estimator_type=est)
        rewards = torch.zeros_like(m)
        rewards[torch.arange(B), (m.sum(dim=1) - 1).long()] = x["scores"]
        if kl_in == "reward":
            rewards = rewards - kl * HP["kl_coef"]  # apply_reward_kl_penalty, restated
        adv, ret = pu.compute_gae_advantage_return(
            token_level_rewards=rewards, values=x["old_values"], response_mask=m, gamma=HP["gamma"],
            lambd=HP["lam"],
        )  # fmt: skip
        cfg = _loss_config(red, m.shape[1], plt, lo, hi)
        loss_fn = _skyrl_loss(pu, x, (adv, ret), (est, kl_in), cfg)
        dump: dict[str, Any] = dict(x, kl=kl, token_rewards=rewards, advantages=adv, returns=ret)
        hp = dict(GRAD_HP, cliprange=lo)
        if hi != lo:
            hp["cliprange_high"] = hi
        conv: dict[str, Any] = {"kl_estimator": est, "kl_in": kl_in, "loss_agg": REDUCTION_TO_REFPPO[red]}
        if plt == "dual_clip":
            conv["dual_clip"] = DUAL_C
        suffix = CONTROL if red == "token_mean" else ""
        made.append(_write(out, f"skyrl_grads_{name}{suffix}", {**dump, **_step(x, loss_fn)}, hp, conv))
    return made


def _skyrl_loss(
    pu: Any, x: dict[str, Any], adv_ret: tuple[Any, Any], case: tuple[str, str], cfg: Any
) -> LossFn:
    """SkyRL's ``ppo_policy_loss`` (+ the KL loss of ``workers/worker.py``), ``ppo_critic_loss``,
    each ``/ accumulation_steps``."""
    (adv, ret), (est, kl_in) = adv_ret, case
    m = x["response_mask"]

    def loss_fn(rows: Any, lp: Any, v: Any) -> tuple[Any, Any]:
        mr = m[rows]
        pg, _ = pu.ppo_policy_loss(lp, x["old_logprobs"][rows], adv[rows], cfg, loss_mask=mr)
        if kl_in == "loss":  # compute_approx_kl is @torch.no_grad() in 0.3.1: a value, no gradient
            kll = pu.compute_approx_kl(lp, x["ref_logprobs"][rows], loss_mask=mr, kl_estimator_type=est)
            pg = pg + HP["kl_coef"] * pu.masked_mean(kll, mr, dim=-1).mean()
        vf, _ = pu.ppo_critic_loss(v, x["old_values"][rows], ret[rows], cfg, loss_mask=mr)
        return pg / K, vf / K

    return loss_fn
