"""v2 dumps of a whole optimizer step, with gradients from a small HAND-WRITTEN trainer.

The trainer below restates PPO's per-token losses from their definitions (spec/ppo.md) in a few
torch lines and takes the gradient of each micro-batch's loss by autograd; it never calls
``refppo.pipeline`` or the oracle, so a wrong reference or a wrong diagnosis shows. ``W`` ranks are
simulated in one process: rank r's rows carry ``1/W`` of its local gradient (DDP averaging). Each
injected bug is a change to this trainer, written from the bug's definition.

The rollout-side tensors (advantages, returns) come from the pipeline's dump: they are trainer
*outputs* checked elsewhere; here only the update step and its gradient are the trainer's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from oracle_helpers import HP, make_inputs, refppo_dump, setup_for
from torch import Tensor

from refppo.dump.write import write_dump

LENGTHS = [10, 3, 7, 2, 9, 5, 8, 4]
"""Unequal token counts: 8 rows, T = 10."""
LAYOUT_LENGTHS = LENGTHS
"""The row lengths :data:`TWO_RANKS_TWO_MB` splits (row 0 alone is micro-batch 0 of rank 0)."""
RANK = [0, 0, 0, 0, 1, 1, 1, 1]
MICRO = [0, 1, 1, 1, 0, 0, 1, 1]
"""Rank 0: micro-batch 0 holds 1 row (10 tokens), micro-batch 1 three (12); rank 1: 2 rows (14), 2 (12)."""


@dataclass
class Bugs:
    """What the hand-written trainer gets wrong (all off = a correct step)."""

    local_norm: bool = False
    """Each micro-batch normalised by its own count, the micro-batch losses averaged (1/K), DDP 1/W."""
    local_norm_summed: bool = False
    """Each micro-batch normalised by its own count, the micro-batch losses summed (no 1/K), DDP 1/W."""
    ddp_sum: bool = False
    """Gradients summed over ranks where DDP averages (no 1/W)."""
    missing_accum: bool = False
    """Each micro-batch normalised by the mean micro-batch size N/(K·W), without the 1/K."""
    adv_not_detached: bool = False
    """Advantages built as ``A − (V − V.detach())``: the pg loss sends a gradient into the values."""
    clip_straight_through: bool = False
    """The clipped ratio as ``ρ + (clip(ρ) − ρ).detach()``: clipped value, unclipped gradient."""
    leak_rows: list[int] = field(default_factory=list)
    """Rows whose padding is not masked out of the policy loss (their padded advantages hold junk)."""
    kl_estimator: str | None = None
    """The KL-in-loss estimator the trainer really uses (None: the convention's)."""
    rank_norm: bool = False
    """Each rank normalises by its own count (accumulating its micro-batches correctly), DDP 1/W."""
    count_padding: bool = False
    """The token-mean normaliser counts every position, B·T, padding included."""
    loss_agg: str | None = None
    """The aggregation the trainer really uses (None: the convention's)."""


def _kl(d: Tensor, est: str) -> Tensor:
    if est.endswith("+"):  # straight-through, as verl's kl_penalty: the value of est, the gradient of ½d²
        half_sq = 0.5 * d * d
        return half_sq - half_sq.detach() + _kl(d, est[:-1]).detach()
    if est == "k1":
        return d
    if est == "k2":
        return 0.5 * d * d
    if est == "k3":
        return torch.exp(-d) - 1.0 + d
    return d.abs()


def _agg(lm: Tensor, m: Tensor, agg: str, n_tok: float, n_seq: float, horizon: float) -> Tensor:
    """``lm`` already masked; normalisers given explicitly (the trainer's choice)."""
    if agg == "token-mean":
        return lm.sum() / n_tok
    if agg == "token-sum":
        return lm.sum()
    if agg == "seq-mean-token-mean":
        return (lm.sum(dim=1) / m.sum(dim=1)).sum() / n_seq
    if agg == "seq-mean-token-sum":
        return lm.sum() / n_seq
    return lm.sum() / horizon / n_seq


def _ratio(lp: Tensor, old: Tensor, m: Tensor, conv: dict[str, Any]) -> Tensor:
    """``exp(clamp(l − l_old, ±κ))`` per token, or GSPO's ``exp(min(l − sg(l) + S_b, κ))`` with
    ``S_b`` the row's mean of ``l − l_old`` over its valid tokens (spec/ppo.md)."""
    kappa = conv.get("log_ratio_clamp")
    d = lp - old
    if conv.get("policy_loss") == "gspo":
        zero = torch.zeros((), dtype=lp.dtype)
        s = (torch.where(m, d, zero).sum(dim=1) / m.sum(dim=1)).detach()
        log_s = lp - lp.detach() + s.unsqueeze(1)
        return torch.exp(log_s if kappa is None else torch.clamp(log_s, max=kappa))
    return torch.exp(d if kappa is None else torch.clamp(d, -kappa, kappa))


def _mb_loss(
    t: dict[str, Tensor],
    lp: Tensor,
    v: Tensor,
    rows: Tensor,
    conv: dict[str, Any],
    bugs: Bugs,
    norm: dict[str, float],
) -> dict[str, Tensor]:
    """The hand-written PPO loss of the rows ``rows`` (``lp``, ``v``: their leaves): ``loss`` and
    its terms ``pg_loss``, ``vf_loss`` (and ``kl_loss`` with ``kl_in = loss``)."""
    m = t["response_mask"][rows].bool()
    pm = m.clone()
    for i, b in enumerate(rows.tolist()):
        if b in bugs.leak_rows:
            pm[i] = True  # the bug: padded positions of this row enter the policy loss
    adv = torch.where(m, t["advantages"][rows], torch.full((), 0.5, dtype=lp.dtype))
    if bugs.adv_not_detached:
        adv = adv - (v - v.detach())
    old = t["old_logprobs"][rows]
    ratio = _ratio(lp, old, m, conv)
    eps = HP["cliprange"]
    clipped = torch.clamp(ratio, 1 - eps, 1 + eps)
    if bugs.clip_straight_through:
        clipped = ratio + (clipped - ratio).detach()
    pg_tok = torch.maximum(-adv * ratio, -adv * clipped)
    if conv.get("dual_clip") is not None:  # the cap −c·A where A < 0
        pg_tok = torch.where(adv < 0, torch.minimum(pg_tok, -conv["dual_clip"] * adv), pg_tok)
    zero = torch.zeros((), dtype=lp.dtype)
    agg = bugs.loss_agg or conv.get("loss_agg", "token-mean")
    T = m.shape[1]
    pg = _agg(torch.where(pm, pg_tok, zero), m, agg, norm["tok"], norm["seq"], T)
    vo, ret = t["old_values"][rows], t["returns"][rows]
    ev = HP["cliprange_value"]
    v_clip = torch.clamp(v, vo - ev, vo + ev)
    vf_tok = 0.5 * torch.maximum((v - ret) ** 2, (v_clip - ret) ** 2)
    vf = _agg(torch.where(m, vf_tok, zero), m, agg, norm["tok"], norm["seq"], T)
    out = {"pg_loss": pg, "vf_loss": vf, "loss": pg + HP["vf_coef"] * vf}
    if "entropy" in t:  # the entropy bonus: a constant here (it reads no logprobs or values)
        ent = t["entropy"][rows]
        out["entropy_loss"] = _agg(torch.where(m, ent, zero), m, agg, norm["tok"], norm["seq"], T)
        out["loss"] = out["loss"] - HP["ent_coef"] * out["entropy_loss"]
    if conv.get("kl_in") == "loss":
        est = bugs.kl_estimator or conv.get("kl_estimator", "k1")
        kl_tok = _kl(lp - t["ref_logprobs"][rows], est)
        out["kl_loss"] = _agg(torch.where(m, kl_tok, zero), m, agg, norm["tok"], norm["seq"], T)
        out["loss"] = out["loss"] + HP["kl_coef"] * out["kl_loss"]
    return out


@dataclass(frozen=True)
class Layout:
    """Which rank and micro-batch each row goes to."""

    rank: tuple[int, ...] = tuple(RANK)
    micro: tuple[int, ...] = tuple(MICRO)
    W: int = 2
    K: int = 2

    def sidecar(self) -> dict[str, int]:
        return {"world_size": self.W, "micro_batches": self.K}


TWO_RANKS_TWO_MB = Layout()
ONE_RANK_THREE_MB = Layout(rank=(0,) * 8, micro=(0, 0, 1, 1, 1, 2, 2, 2), W=1, K=3)


def trainer_grads(
    t: dict[str, Tensor], conv: dict[str, Any], bugs: Bugs, layout: Layout = TWO_RANKS_TWO_MB
) -> dict[str, Tensor]:
    """``grad_logprobs``, ``grad_values`` of the step as this trainer's optimizer would see them."""
    grads, _ = trainer_step(t, conv, bugs, layout)
    return grads


def trainer_step(
    t: dict[str, Tensor], conv: dict[str, Any], bugs: Bugs, layout: Layout = TWO_RANKS_TWO_MB
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The step's gradients (:func:`trainer_grads`) and the losses this trainer logs: each
    micro-batch's loss terms *as passed to backward* (times the scale of its gradient), summed over
    micro-batches and ranks times ``1/W``, as ``StepRecorder(reduce="mean")`` sums them."""
    W, K = layout.W, layout.K
    mask = t["response_mask"].bool()
    n_step, s_step = float(mask.sum()), float(mask.shape[0])
    g_lp = torch.zeros_like(t["logprobs"])
    g_v = torch.zeros_like(t["values"])
    logged: dict[str, Tensor] = {}
    for r in range(W):
        for k in range(K):
            rows = torch.tensor(
                [b for b in range(len(LENGTHS)) if layout.rank[b] == r and layout.micro[b] == k]
            )
            lp = t["logprobs"][rows].clone().requires_grad_(True)
            v = t["values"][rows].clone().requires_grad_(True)
            if bugs.local_norm:  # own counts, averaged over the K micro-batches
                norm, scale = {"tok": float(mask[rows].sum()), "seq": float(rows.numel())}, 1.0 / K
            elif bugs.local_norm_summed:  # own counts, the K micro-batch losses summed
                norm, scale = {"tok": float(mask[rows].sum()), "seq": float(rows.numel())}, 1.0
            elif bugs.rank_norm:  # the rank's own counts; its micro-batch sums add up to the rank's loss
                mine = [b for b in range(len(LENGTHS)) if layout.rank[b] == r]
                norm, scale = {"tok": float(mask[mine].sum()), "seq": float(len(mine))}, 1.0
            elif bugs.count_padding:
                norm, scale = {"tok": float(mask.numel()), "seq": s_step}, float(W)
            elif bugs.missing_accum:  # the mean micro-batch size, and no 1/K
                norm, scale = {"tok": n_step / (K * W), "seq": s_step / (K * W)}, 1.0
            else:  # global normalisers; ×W so that DDP's mean over ranks gives the step's loss
                norm, scale = {"tok": n_step, "seq": s_step}, float(W)
            terms = _mb_loss(t, lp, v, rows, conv, bugs, norm)
            gl, gv = torch.autograd.grad(terms["loss"] * scale, (lp, v))
            ddp = 1.0 if bugs.ddp_sum else 1.0 / W
            g_lp[rows] += ddp * gl
            g_v[rows] += ddp * gv
            for name, x in terms.items():  # as StepRecorder(reduce="mean") sums them: 1/W, whatever the bug
                logged[name] = logged.get(name, torch.zeros((), dtype=x.dtype)) + scale * x.detach() / W
    return {"grad_logprobs": g_lp, "grad_values": g_v}, logged


def step_dump(
    conv: dict[str, Any] | None = None,
    bugs: Bugs | None = None,
    *,
    seed: int = 3,
    keep_scalars: bool = False,
    dtype: torch.dtype = torch.float64,
    layout: Layout = TWO_RANKS_TWO_MB,
    logged_losses: bool = False,
) -> dict[str, Tensor]:
    """A v2 dump: inputs, rollout outputs, the trainer's gradients, ``micro_batch`` and ``rank``;
    ``logged_losses``: also the loss scalars this trainer logs (:func:`trainer_step`)."""
    conv = dict(conv or {})
    inputs = make_inputs(B=len(LENGTHS), T=max(LENGTHS), seed=seed, lengths=LENGTHS)
    d = refppo_dump(inputs, setup_for(conv=conv))
    if not keep_scalars:
        d = {k: v for k, v in d.items() if v.dim() > 0}
    grads, logged = trainer_step(d, conv, bugs or Bugs(), layout)
    d.update(grads)
    if logged_losses:
        d.update(logged)
    d = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in d.items()}
    d["rank"] = torch.tensor(layout.rank)
    d["micro_batch"] = torch.tensor(layout.micro)
    return d


def save_step(
    tmp: Path,
    d: dict[str, Tensor],
    conv: dict[str, Any] | None = None,
    layout: Layout = TWO_RANKS_TWO_MB,
    **extra: Any,
) -> Path:
    path = tmp / "step.safetensors"
    write_dump(path, d, hparams={**HP, **layout.sidecar(), **extra}, convention=conv or {})
    return path
