"""AReaL 1.0.4's own advantage and loss functions on a response-only batch (``skyrl-areal`` venv).

Shared by :func:`peers.makers.areal.make` (right-padded rows) and
:func:`peers.makers.holes.areal_cases` (multi-turn rows); nothing from refppo is imported.

- :func:`areal_fns`: the AReaL callables, imported from its own files behind the stand-ins.
- :func:`rolled_batch`: AReaL's prompt + response frame of a batch. One prompt token and width
  ``W = T + 2``: in the input frame response token ``j`` sits at ``j + 1`` (``logprobs``,
  ``loss_mask``, ``attention_mask``), in the rolled frame (``torch.roll`` by one: ``ref_logp``,
  ``values``) at ``j``; every row keeps at least one padded slot, junk 7.5 elsewhere.
- :func:`advantages`: ``areal/trainer/ppo/actor.py::PPOActor._compute_advantages`` (score
  bias/scale/clip, the KL reward, the score slot, GAE, ``adv_norm``) on a stand-in ``self``
  holding the attributes its ``__init__`` sets.
- :func:`step_dump`: ``areal/utils/functional/functional.py::ppo_actor_loss_fn`` and
  ``ppo_critic_loss_fn`` on the advantages, and the dump's tensors (``entropy`` left out:
  AReaL's losses have no entropy term here).
"""

from __future__ import annotations

import types
from typing import Any

from peers.makers.common import install_stubs, mount

Norm = tuple[str | None, str | None, bool] | None
"""``adv_norm`` as ``(mean_level, std_level, std_unbiased)`` of AReaL's ``NormConfig``; None: none."""


def areal_fns() -> dict[str, Any]:
    """``NormConfig``, ``PPOActor``, ``KLEstimator``, ``Normalization``, ``ppo_actor_loss_fn``,
    ``ppo_critic_loss_fn`` from AReaL's installed files (``areal.trainer`` mounted bare)."""
    install_stubs(extra=("areal.infra", "areal.experimental", "transformers"))
    mount("areal")
    mount("areal.trainer")
    from areal.api.cli_args import NormConfig  # type: ignore[import-not-found]  # side venv only
    from areal.trainer.ppo.actor import PPOActor  # type: ignore[import-not-found]  # side venv only
    from areal.utils.data import KLEstimator, Normalization  # type: ignore[import-not-found]  # side venv
    from areal.utils.functional import (  # type: ignore[import-not-found]  # side venv only
        ppo_actor_loss_fn,
        ppo_critic_loss_fn,
    )

    return {
        "NormConfig": NormConfig,
        "PPOActor": PPOActor,
        "KLEstimator": KLEstimator,
        "Normalization": Normalization,
        "ppo_actor_loss_fn": ppo_actor_loss_fn,
        "ppo_critic_loss_fn": ppo_critic_loss_fn,
    }


def rolled_batch(x: dict[str, Any], envelope: Any) -> dict[str, Any]:
    """AReaL's ``data`` [B, T + 2] for ``_compute_advantages`` (module docstring): attention over the
    prompt token and ``envelope`` [B, T] (the response's tokens), ``loss_mask`` = ``response_mask``."""
    import torch

    m = x["response_mask"]
    B, T = m.shape
    W = T + 2
    attn = torch.zeros(B, W, dtype=torch.long)
    attn[:, : 1 + T] = torch.cat([torch.ones(B, 1, dtype=torch.long), envelope.long()], dim=1)
    loss_mask_in = torch.zeros(B, W, dtype=torch.float32)
    loss_mask_in[:, 1 : 1 + T] = m
    junk = torch.full((B, W), 7.5, dtype=torch.float32)
    logprobs_in, ref_rolled, values_rolled = junk.clone(), junk.clone(), junk.clone()
    logprobs_in[:, 1 : 1 + T] = x["old_logprobs"]
    ref_rolled[:, :T] = x["ref_logprobs"]
    values_rolled[:, :T] = x["old_values"]
    return {
        "input_ids": torch.ones(B, W, dtype=torch.long),
        "attention_mask": attn,
        "loss_mask": loss_mask_in,
        "logprobs": logprobs_in,
        "ref_logp": ref_rolled,
        "values": values_rolled,
        "rewards": x["scores"].clone(),
    }


def advantages(
    fns: dict[str, Any],
    data: dict[str, Any],
    hp: dict[str, float],
    kl_estimator: str,
    norm: Norm,
    eps: float,
    reward: tuple[float, float, float],
) -> dict[str, Any]:
    """``PPOActor._compute_advantages(self, data)`` with ``self`` a stand-in: ``reward`` = (bias,
    scale, clip) of the score, KL coefficient, γ, λ from ``hp``, ``adv_norm`` from ``norm`` with
    ``NormConfig.eps = eps``. Returns AReaL's dict (rolled frame, [B, T + 2])."""
    cfg = types.SimpleNamespace(
        overlong_reward_penalty=False, use_decoupled_loss=False, recompute_logprob=False
    )
    adv_norm = None
    if norm is not None:
        nc = fns["NormConfig"](mean_level=norm[0], std_level=norm[1], std_unbiased=norm[2], eps=eps)
        adv_norm = fns["Normalization"](nc)
    bias, scale, clip = reward
    actor = types.SimpleNamespace(
        config=cfg,
        reward_bias=bias,
        reward_scaling=scale,
        reward_clip=clip,
        reward_norm=None,
        kl_ctl=hp["kl_coef"],
        kl_estimator=fns["KLEstimator"](kl_estimator),
        adv_norm=adv_norm,
        discount=hp["gamma"],
        gae_lambda=hp["lam"],
        mask_no_eos_with_zero=False,
    )
    res: dict[str, Any] = fns["PPOActor"]._compute_advantages(actor, data)
    return res


def step_dump(
    fns: dict[str, Any],
    x: dict[str, Any],
    res: dict[str, Any],
    hp: dict[str, float],
    kl_estimator: str,
    eps_hi: float | None = None,
    c_clip: float | None = None,
) -> dict[str, Any]:
    """The dump's tensors [B, T]: ``x`` (but ``entropy``), the KL, token rewards, advantages and
    returns of ``res`` (:func:`advantages`, back to the response frame) and AReaL's losses on them
    (clip fractions and ``approx_kl`` as token means over ``response_mask``)."""
    import torch

    m = x["response_mask"]
    mb = m.bool()
    T = m.shape[1]
    adv, ret = res["advantages"][:, :T], res["returns"][:, :T]
    pg, st = fns["ppo_actor_loss_fn"](
        logprobs=x["logprobs"],
        proximal_logprobs=x["old_logprobs"],
        old_logprobs=x["old_logprobs"],
        advantages=adv,
        eps_clip=hp["cliprange"],
        loss_mask=mb,
        eps_clip_higher=eps_hi,
        c_clip=c_clip,
    )
    vf, vst = fns["ppo_critic_loss_fn"](
        x["values"], x["old_values"], ret, hp["cliprange_value"], loss_mask=mb
    )
    n = mb.sum().to(torch.float32)
    dump: dict[str, Any] = {k: v for k, v in x.items() if k != "entropy"}
    dump.update(
        kl=fns["KLEstimator"](kl_estimator)(x["old_logprobs"] * m, x["ref_logprobs"] * m),
        token_rewards=res["tot_rewards"][:, :T],
        advantages=adv,
        returns=ret,
        pg_loss=pg.detach(),
        pg_clipfrac=st["clip_mask"].sum().to(torch.float32) / n,
        approx_kl=torch.where(mb, st["approx_kl"], 0.0).sum() / n,
        vf_loss=vf.detach(),
        vf_clipfrac=vst["clip_mask"].sum().to(torch.float32) / n,
        loss=pg.detach(),
    )
    return dump
