"""AReaL 1.0.4 decoupled-PPO step dumps from its own code (``skyrl-areal`` venv), with the gradient.

The decoupled objective (``use_decoupled_loss``; Fu et al. 2025): AReaL's trainer passes the
recomputed proximal log-probs as ``proximal_logprobs`` and the inference engine's as
``old_logprobs`` to ``areal/utils/functional/functional.py::ppo_actor_loss_fn``, whose
``rejection_sampling`` (``RejectionSamplingConfig``: level, action, metric ``ratio``, bounds; it
replaced ``behav_imp_weight_cap``) makes the behaviour weight ``π^prox/π^beh``, masked or clamped,
that multiplies the clipped surrogate against the proximal policy. In refppo's dump: the proximal
log-probs are ``old_logprobs``, the engine's ``rollout_logprobs`` (``l^prox − 0.8·N(0, 1)``).

The rest of the step (KL reward, GAE) as :mod:`peers.makers.areal` (``areal_frame``); the loss is
AReaL's policy loss (``vf_coef`` 0), its gradient ``grad_logprobs`` by autograd through AReaL's
function, ``grad_values`` 0 (v2 dump, one rank, one micro-batch). ``pg_clipfrac``: AReaL's logged
``clip_ratio`` (``areal/trainer/ppo/actor.py``: the loss function's ``clip_mask``, which it ANDs with
the loss mask rejection sampling narrowed, over ``n_valid_tokens``, the original mask): refppo's
``clipfrac_counts=kept`` (the areal preset's; the sidecar carries it too, :data:`COUNTS`); the
default count (``all``) also counts the rejected tokens' clips (0.273 vs 0.309 on the cap-5 case).
``approx_kl``: its ``approx_kl`` stat (``l − l^prox``) over the valid tokens. float32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peers.makers.areal import HP
from peers.makers.areal_frame import advantages, areal_fns, rolled_batch
from peers.makers.common import inputs, save

COUNTS = {"clipfrac_counts": "kept"}
"""The sidecar's logging convention (``--detect`` does not walk ``clipfrac_counts``: the producer
declares it, as the areal preset does)."""

# (name, RejectionSamplingConfig kwargs, refppo --set, control)
CASES: list[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]] = [
    (
        "token_mask_cap5",  # the old behav_imp_weight_cap = 5 with mode mask
        {"level": "token", "action": "mask", "upper": 5.0},
        {"rollout_is": "token", "rollout_is_mode": "mask", "rollout_is_high": 5.0},
        {"rollout_is_mode": "truncate"},
    ),
    (
        "token_clamp_2",
        {"level": "token", "action": "clamp", "upper": 2.0},
        {"rollout_is": "token", "rollout_is_mode": "truncate", "rollout_is_high": 2.0},
        {"rollout_is_mode": "mask"},
    ),
    (
        "token_mask_band",
        {"level": "token", "action": "mask", "lower": 0.5, "upper": 2.0},
        {"rollout_is": "token", "rollout_is_mode": "mask", "rollout_is_low": 0.5, "rollout_is_high": 2.0},
        {"rollout_is_mode": "truncate"},
    ),
    (
        "sequence_geometric_mask",
        {"level": "sequence", "action": "mask", "agg": "mean", "lower": 0.7, "upper": 1.4},
        {
            "rollout_is": "sequence", "rollout_is_agg": "geometric", "rollout_is_mode": "mask",
            "rollout_is_low": 0.7, "rollout_is_high": 1.4,
        },
        {"rollout_is_agg": "product"},
    ),
]  # fmt: skip


def behaviour(x: dict[str, Any], seed: int, scale: float = 0.8) -> dict[str, Any]:
    """``x`` plus ``rollout_logprobs = l^prox − scale·N(0, 1)`` on valid tokens (7.5 on padding)."""
    import torch

    m = x["response_mask"].bool()
    g = torch.Generator().manual_seed(seed)
    beh = x["old_logprobs"] - scale * torch.randn(m.shape, generator=g, dtype=x["old_logprobs"].dtype)
    return {**x, "rollout_logprobs": torch.where(m, beh, torch.full_like(beh, 7.5))}


def decoupled_step(
    fns: dict[str, Any], cfg: Any, x: dict[str, Any], seed_adv: dict[str, Any]
) -> dict[str, Any]:
    """One decoupled step: AReaL's ``ppo_actor_loss_fn(logprobs, proximal_logprobs=l^prox,
    old_logprobs=l^beh, rejection_sampling=cfg)`` on the GAE advantages ``seed_adv``, its gradient."""
    import torch

    m = x["response_mask"]
    mb = m.bool()
    T = m.shape[1]
    adv, ret = seed_adv["advantages"][:, :T], seed_adv["returns"][:, :T]
    lp = x["logprobs"].clone().requires_grad_(True)
    pg, st = fns["ppo_actor_loss_fn"](
        logprobs=lp, proximal_logprobs=x["old_logprobs"], old_logprobs=x["rollout_logprobs"],
        advantages=adv, eps_clip=HP["cliprange"], loss_mask=mb, rejection_sampling=cfg,
    )  # fmt: skip
    (g_lp,) = torch.autograd.grad(pg, (lp,))
    vf, vst = fns["ppo_critic_loss_fn"](
        x["values"], x["old_values"], ret, HP["cliprange_value"], loss_mask=mb
    )
    n = mb.sum().to(torch.float32)
    dump: dict[str, Any] = {k: v for k, v in x.items() if k != "entropy"}
    dump.update(
        kl=fns["KLEstimator"]("k1")(x["old_logprobs"] * m, x["ref_logprobs"] * m),
        token_rewards=seed_adv["tot_rewards"][:, :T], advantages=adv, returns=ret,
        pg_loss=pg.detach(),
        approx_kl=torch.where(mb, st["approx_kl"], 0.0).sum() / n,
        pg_clipfrac=(st["clip_mask"] & mb).sum().to(torch.float32) / n,  # actor.py's clip_ratio
        vf_loss=vf.detach(), vf_clipfrac=vst["clip_mask"].sum().to(torch.float32) / n, loss=pg.detach(),
        grad_logprobs=torch.where(mb, g_lp, 0.0), grad_values=torch.zeros_like(m),
    )  # fmt: skip
    return dump


def make(out: Path) -> list[str]:
    """One v2 dump per case of :data:`CASES`, ``--preset areal`` plus the case's ``--set``."""
    import torch

    fns = areal_fns()
    from areal.api.cli_args import RejectionSamplingConfig  # type: ignore[import-not-found]  # side venv

    made = []
    for i, (name, rs, conv, control) in enumerate(CASES):
        x = behaviour(inputs(700 + i, dtype=torch.float32, full_row=False), 800 + i)
        res = advantages(
            fns, rolled_batch(x, x["response_mask"]), HP, "k1", None, HP["whiten_eps"], (0.0, 1.0, 20.0)
        )
        cfg = RejectionSamplingConfig(metric="ratio", **rs)
        dump = decoupled_step(fns, cfg, x, res)
        hp = dict(HP, world_size=1, micro_batches=1, **COUNTS)
        made.append(save(out, f"areal_decoupled_{name}", dump, hp, {"kl_estimator": "k1", **conv}, control))
    return made
