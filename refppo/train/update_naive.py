"""Naive twin of :func:`refppo.train.update.ppo_update`: token by token, a real π_old snapshot network.

π_old is a deep copy of the actor taken before the update; its log-probs are recomputed at every
minibatch instead of being cached. Each row's log-probs, entropies and values come from one
unpadded prefix forward per token (:func:`_rows`); the step's scalars are the update stages of the
stage table walked through their naive twins (:func:`refppo.pipeline.step.update_quantities_naive`:
Python floats on the core's ``*_naive`` twins), and its gradient is the naive twins' closed form
(:func:`refppo.pipeline.grad_naive.objective_grads_naive` for the log-probs and values, the
aggregation weights for the entropy), carried back through the networks::

    J = pg + c_vf·vf − c_ent·H + β·kl              (the total stage; kl with kl_in = loss)
    backward(l, ∂J/∂l) + backward(V, ∂J/∂V) + backward(H, −c_ent·∂agg_ent(H)/∂H)

No micro-batching, no normalisers: the whole minibatch at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from refppo.core.aggregate import agg_weights_naive
from refppo.errors import ConventionError
from refppo.models.batch import SequenceBatch
from refppo.models.naive import prefix_logits, prefix_value
from refppo.models.roles import eval_mode, make_reference
from refppo.models.rollout import ScoredRollout
from refppo.pipeline.blocks import Evaluation
from refppo.pipeline.grad_naive import objective_grads_naive
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.stages import BY_NAME
from refppo.pipeline.step import RolloutQuantities, update_inputs, update_quantities_naive
from refppo.train.update_config import PPOUpdateConfig


@dataclass(frozen=True)
class NaiveStep:
    """One minibatch step of the naive update."""

    epoch: int
    index: int
    rows: list[int]
    snapshot_logprobs: Tensor
    """``[b, T]`` π_old log-probs recomputed from the snapshot network at this step."""
    stats: dict[str, float]


@dataclass(frozen=True)
class _Setup:
    """What every minibatch of one naive update reads (taken once, before the first step)."""

    actor: nn.Module
    critic: nn.Module | None
    snapshot: nn.Module
    batch: SequenceBatch
    device: torch.device
    tau: float
    scored: ScoredRollout
    quantities: RolloutQuantities
    hp: Hyperparams
    conv: Convention
    rollout_logprobs: Tensor | None = None
    """``[B, T]`` the behaviour log-probs (the seam mode's engine), or None."""


def _check_supported(conv: Convention, cfg: PPOUpdateConfig, perms: list[Tensor]) -> None:
    """The naive update's subset: no dropout in the update (the prefix forwards run one row at a
    time); one permutation per epoch."""
    if cfg.dropout_in_update:
        raise ConventionError("ppo_update_naive: dropout_in_update is not supported")
    if len(perms) != cfg.ppo_epochs:
        raise ValueError(f"perms: expected {cfg.ppo_epochs} permutations, got {len(perms)}")


def ppo_update_naive(
    actor: nn.Module,
    critic: nn.Module | None,
    actor_optimizer: torch.optim.Optimizer,
    critic_optimizer: torch.optim.Optimizer | None,
    scored: ScoredRollout,
    quantities: RolloutQuantities,
    *,
    hp: Hyperparams,
    conv: Convention,
    cfg: PPOUpdateConfig,
    perms: list[Tensor],
    rollout_logprobs: Tensor | None = None,
) -> list[NaiveStep]:
    """Naive twin of :func:`refppo.train.update.ppo_update` with the row permutation of each epoch given.

    A deep-copied snapshot of the actor is taken first and is the ONLY source of π_old.
    ``critic=None``: no value term (``vf_loss``, ``vf_clipfrac``, ``critic_grad_norm`` are 0).
    ``rollout_logprobs`` ``[B, T]``: the behaviour log-probs that ``conv.rollout`` (the rollout
    correction) weighs against the snapshot's, ``w' = f(π_snapshot / π^beh)``, by the
    ``rollout_correction`` stage's naive twin; the gradient of the policy term is scaled by ``w'``.
    """
    _check_supported(conv, cfg, perms)
    batch = scored.batch
    su = _Setup(
        actor=actor,
        critic=critic,
        snapshot=make_reference(actor),
        batch=batch,
        device=batch.prompt_ids.device,
        tau=scored.temperature,
        scored=scored,
        quantities=quantities,
        hp=hp,
        conv=conv,
        rollout_logprobs=rollout_logprobs,
    )
    mb_size = batch.batch_size // cfg.num_minibatches
    optimizers = [actor_optimizer] + ([critic_optimizer] if critic_optimizer is not None else [])
    steps: list[NaiveStep] = []
    with eval_mode(actor, *([critic] if critic is not None else [])):
        for epoch, perm in enumerate(perms):
            for mb in range(cfg.num_minibatches):
                rows = [int(r) for r in perm[mb * mb_size : (mb + 1) * mb_size]]
                snap, stats = _minibatch(su, rows, optimizers, cfg.max_grad_norm)
                steps.append(NaiveStep(epoch, mb, rows, snap, stats))
    return steps


def _minibatch(
    su: _Setup, rows: list[int], optimizers: list[torch.optim.Optimizer], max_grad_norm: float | None
) -> tuple[Tensor, dict[str, float]]:
    """One optimizer step on ``rows``: ``(snapshot log-probs [b, T], the step's stats)``."""
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    lp, snap, ent, values = _rows(su, rows)
    q = _update_inputs(su, rows, lp, snap, ent, values)
    uq = update_quantities_naive(q, hp=su.hp, conv=su.conv)
    w = BY_NAME["rollout_correction"].naive(q, su.conv, su.hp, Evaluation())["is_weights"]
    g_lp, g_v = objective_grads_naive(**_grad_inputs(q), hp=su.hp, conv=su.conv, is_weights=w)
    agg = su.conv.agg.of("entropy")
    g_ent = -su.hp.ent_coef * torch.tensor(agg_weights_naive(q["mask"], agg, horizon=su.hp.horizon))
    outs, grads = [lp, ent], [g_lp.to(lp.dtype), g_ent.to(ent.dtype)]
    if values is not None:
        outs.append(values)
        grads.append(g_v.to(values.dtype))
    torch.autograd.backward(outs, grads)
    gn_a = _clip(su.actor, max_grad_norm)
    gn_c = _clip(su.critic, max_grad_norm) if su.critic is not None else 0.0
    for opt in optimizers:
        opt.step()
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    stats = {n: float(getattr(uq, n)) for n in ("loss", "pg_loss", "vf_loss")}
    assert uq.kl_loss is not None  # the trainer always holds ref_logprobs
    stats.update(entropy=float(uq.entropy_loss), kl_loss=float(uq.kl_loss))
    stats.update({n: float(getattr(uq, n)) for n in ("pg_clipfrac", "approx_kl", "vf_clipfrac")})
    stats.update(actor_grad_norm=gn_a, critic_grad_norm=gn_c)
    return snap, stats


def _rows(su: _Setup, rows: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``(l, l^old, H, V)`` ``[b, T]`` of ``rows``: one prefix forward per token (the snapshot's
    without a graph), 0 on padding; ``V`` over the value mask, None without a critic."""
    b, T = len(rows), su.batch.response_width
    vmask = su.quantities.value_mask
    lp_rows, ent_rows, v_rows = [], [], []
    snap = torch.zeros(b, T)
    zero = torch.zeros(())
    for i, r in enumerate(rows):
        x, y = su.batch.unpadded(r)
        lrow, erow, vrow = [zero] * T, [zero] * T, [zero] * T
        for t in range(len(y)):
            logz = torch.log_softmax(prefix_logits(su.actor, x + y[:t], su.device) / su.tau, dim=-1)
            lrow[t], erow[t] = logz[y[t]], -(torch.exp(logz) * logz).sum()
            with torch.no_grad():
                old = torch.log_softmax(prefix_logits(su.snapshot, x + y[:t], su.device) / su.tau, -1)
            snap[i, t] = float(old[y[t]])
        for t in range(T):
            if su.critic is not None and bool(vmask[r, t]):
                vrow[t] = prefix_value(su.critic, x + y[:t], su.device)
        lp_rows.append(torch.stack(lrow))
        ent_rows.append(torch.stack(erow))
        v_rows.append(torch.stack(vrow))
    values = torch.stack(v_rows) if su.critic is not None else None
    return torch.stack(lp_rows), snap, torch.stack(ent_rows), values


def _update_inputs(
    su: _Setup, rows: list[int], lp: Tensor, snap: Tensor, ent: Tensor, values: Tensor | None
) -> dict[str, Any]:
    """The update stages' quantities of ``rows`` in float64 (detached), as
    :func:`refppo.pipeline.step.update_inputs` makes them."""
    idx = torch.tensor(rows)
    sc, qr = su.scored, su.quantities

    def f64(x: Tensor) -> Tensor:
        return x.detach().to(torch.float64)

    return update_inputs(
        logprobs=f64(lp), values=None if values is None else f64(values), old_logprobs=f64(snap),
        old_values=None if values is None else f64(sc.old_values[idx]), advantages=f64(qr.advantages[idx]),
        returns=f64(qr.returns[idx]), mask=sc.batch.response_mask[idx], value_mask_=qr.value_mask[idx],
        ref_logprobs=f64(sc.ref_logprobs[idx]), entropy=f64(ent),
        rollout_logprobs=None if su.rollout_logprobs is None else f64(su.rollout_logprobs[idx]),
    )  # fmt: skip


def _grad_inputs(q: dict[str, Any]) -> dict[str, Any]:
    """:func:`objective_grads_naive`'s arguments from the update's quantities (zero values without a
    critic: the value term's gradient is then not used)."""
    zeros = torch.zeros_like(q["logprobs"])
    out: dict[str, Any] = {k: q[k] for k in ("logprobs", "old_logprobs", "advantages", "returns", "mask")}
    out.update(ref_logprobs=q["ref_logprobs"], entropy=q["entropy"], value_mask_=q["value_mask"])
    out.update(values=q["values"] if q["values"] is not None else zeros)
    out.update(old_values=q["old_values"] if q["old_values"] is not None else zeros)
    return out


def _clip(model: nn.Module, max_norm: float | None) -> float:
    """Global grad norm of ``model`` (before clipping), clipped in place to ``max_norm``."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    if max_norm is not None and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for g in grads:
            g.mul_(scale)
    return total


__all__ = ["NaiveStep", "ppo_update_naive"]
