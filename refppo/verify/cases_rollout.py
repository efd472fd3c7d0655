"""The verify cases of the rollout correction (importance weights, rejection gates, the weighted and
decoupled surrogates, CISPO, weighted REINFORCE).

Inputs on a dyadic grid, exact in float32 and float64: ``l^beh = k/16``, ``l^prox − l^beh = j/64``
(``|j| ≤ 24``), ``l − l^prox = i/64``; every ratio bound sits half a grid step from the grid
(``exp((n + ½)/64)``), so a mask decision never hinges on the last bit of a float32 ``exp`` and the
float32 rows compare as cleanly as the float64 ones. The gates whose statistic leaves the grid (a row
mean, a sum of ``k3``) are left to the Hypothesis properties (float64).
"""

from __future__ import annotations

import importlib
import math

import torch
from torch import Tensor

from refppo.agg_conventions import MASK_AGGS, ClipFracCounts
from refppo.verify.batches import Batch, Case, Pair

rc_mod = importlib.import_module("refppo.core.rollout_correction")
rl_mod = importlib.import_module("refppo.core.rollout_losses")
cispo_mod = importlib.import_module("refppo.core.cispo")
cf_mod = importlib.import_module("refppo.core.clipfrac")

LO, HI = math.exp(-10.5 / 64), math.exp(12.5 / 64)
"""Token-level ratio bounds, half a grid step off the grid: ≈ 0.849 and ≈ 1.216."""


def _t(x: float | list[list[float]] | list[list[bool]], like: Tensor) -> Tensor:
    return torch.tensor(x, dtype=torch.float64, device=like.device)


def _grid(b: Batch, lo: int, hi: int) -> Tensor:
    """``[B, T]`` integers in ``[lo, hi]`` over 64 (exact), junk on the padding like ``b.floats``."""
    j = torch.randint(lo, hi + 1, b.shape, generator=b.gen).to(torch.float64) / 64
    return torch.where(b.mask, j.to(b.dtype), b.floats(0.0, 1.0))


def rollout_inputs(b: Batch) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(l, l^prox, l^beh, A)`` on the grid of the module docstring."""
    beh = torch.floor(b.floats(-4.0, -0.1).to(torch.float64) * 16) / 16
    beh = torch.where(b.mask, beh.to(b.dtype), b.floats(0.0, 1.0))
    prox = torch.where(b.mask, beh + _grid(b, -24, 24), beh)
    cur = torch.where(b.mask, prox + _grid(b, -20, 20), prox)
    return cur, prox, beh, b.floats(-2.0, 2.0)


def _case_is_weights(b: Batch, dev: torch.device) -> list[Pair]:
    _, prox, beh, _ = rollout_inputs(b)
    out: list[Pair] = []
    settings = [
        ("token", "product", "truncate", None, HI, None),
        ("token", "product", "truncate", LO, HI, 0.25),
        ("token", "product", "mask", LO, HI, None),
        ("sequence", "product", "truncate", LO, math.exp(40.5 / 64), None),
        ("sequence", "product", "mask", math.exp(-30.5 / 64), math.exp(40.5 / 64), 1.0),
        ("sequence", "geometric", "truncate", LO, HI, None),
    ]
    for level, agg, mode, low, high, kappa in settings:
        kw = {"level": level, "agg": agg, "mode": mode, "low": low, "high": high, "log_ratio_clamp": kappa}
        res = rc_mod.is_weights(prox.to(dev), beh.to(dev), b.mask.to(dev), **kw)
        weight, raw, keep = rc_mod.is_weights_naive(prox, beh, b.mask, **kw)
        tag = f"{level},{agg},{mode},κ={kappa}"
        out += [
            (f"weight({tag})", res.weight, _t(weight, res.weight), None),
            (f"raw({tag})", res.raw, _t(raw, res.raw), None),
            (f"keep({tag})", res.keep.to(torch.float64), _t(keep, res.raw), None),
        ]
    return out


def _case_rejection_mask(b: Batch, dev: torch.device) -> list[Pair]:
    _, prox, beh, _ = rollout_inputs(b)
    k3 = math.exp(-12.5 / 64) - 1 + 12.5 / 64  # k3 at half a grid step: never equal to a grid value's
    settings = [
        ("ratio", "proximal", "token", "mean", LO, HI),
        ("ratio", "behaviour", "token", "mean", None, HI),
        ("k1", "behaviour", "token", "mean", -10.5 / 64, 12.5 / 64),
        ("k2", "proximal", "token", "mean", None, (12.5 / 64) ** 2 / 2),
        ("k3", "behaviour", "token", "mean", None, k3),
        ("ratio", "proximal", "sequence", "sum", math.exp(-30.5 / 64), math.exp(40.5 / 64)),
        ("ratio", "behaviour", "sequence", "max", None, HI),
        ("k1", "proximal", "sequence", "sum", -30.5 / 64, 40.5 / 64),
        ("k2", "behaviour", "sequence", "max", None, (12.5 / 64) ** 2 / 2),
        ("k3", "proximal", "sequence", "max", None, k3),
    ]
    out: list[Pair] = []
    for stat, order, level, reduce, low, high in settings:
        kw = {"stat": stat, "order": order, "level": level, "reduce": reduce, "low": low, "high": high}
        res = rc_mod.rejection_mask(prox.to(dev), beh.to(dev), b.mask.to(dev), **kw)
        nv = rc_mod.rejection_mask_naive(prox, beh, b.mask, **kw)
        out.append((f"keep({stat},{order},{level},{reduce})", res.to(torch.float64), _t(nv, prox), None))
    return out


def _case_gate_statistic(b: Batch, dev: torch.device) -> list[Pair]:
    """The statistic against its naive twin, every statistic / order / level / reduction."""
    _, prox, beh, _ = rollout_inputs(b)
    settings = [
        ("ratio", "proximal", "token", "mean"),
        ("k2", "behaviour", "token", "mean"),
        ("k3", "proximal", "token", "mean"),
        ("ratio", "behaviour", "sequence", "max"),
        ("k3", "proximal", "sequence", "mean"),
        ("k1", "proximal", "sequence", "sum"),
    ]
    out: list[Pair] = []
    for stat, order, level, reduce in settings:
        kw = {"stat": stat, "order": order, "level": level, "reduce": reduce}
        res = rc_mod.gate_statistic(prox.to(dev), beh.to(dev), b.mask.to(dev), **kw)
        nv = rc_mod.gate_statistic_naive(prox, beh, b.mask, **kw)
        out.append((f"stat({stat},{order},{level},{reduce})", res, _t(nv, res), None))
    return out


def _case_corrected_policy_loss(b: Batch, dev: torch.device) -> list[Pair]:
    cur, prox, beh, adv = rollout_inputs(b)
    # the weights and the gate from the naive twins (the vectorized ones have their own cases)
    weight_rows, _, keep_rows = rc_mod.is_weights_naive(prox, beh, b.mask, mode="mask", low=LO, high=HI)
    weight, keep_w = torch.tensor(weight_rows, dtype=b.dtype), torch.tensor(keep_rows)
    gate = torch.tensor(
        rc_mod.rejection_mask_naive(
            prox, beh, b.mask, level="sequence", reduce="max", high=math.exp(20.5 / 64)
        )
    )
    out: list[Pair] = []
    for agg in MASK_AGGS:
        for rejected, keep in (("zero", keep_w), ("drop", gate)):
            kw = {"keep": keep, "rejected": rejected, "norms": rl_mod.Norms(agg=agg)}
            kw["clip"] = rl_mod.PolicyClip(clip_high=0.28, dual_clip=3.0)
            args = (cur.to(dev), prox.to(dev), adv.to(dev), b.mask.to(dev), weight.to(dev))
            res = rl_mod.corrected_policy_loss(*args, **{**kw, "keep": keep.to(dev)})
            nv = rl_mod.corrected_policy_loss_naive(cur, prox, adv, b.mask, weight, **kw)
            tag = f"{agg.value},{rejected}"
            out += [
                (f"loss({tag})", res.loss, _t(nv.loss, res.loss), None),
                (f"per_token({tag})", res.per_token, _t(nv.per_token, res.loss), None),
                (f"clipfrac({tag})", res.clipfrac, _t(nv.clipfrac, res.loss), None),
                (f"approx_kl({tag})", res.approx_kl, _t(nv.approx_kl, res.loss), None),
            ]
    return out


def _case_decoupled_policy_loss(b: Batch, dev: torch.device) -> list[Pair]:
    cur, prox, beh, adv = rollout_inputs(b)
    out: list[Pair] = []
    for bw in (
        rl_mod.BehaviourWeight(mode="mask", high=HI),
        rl_mod.BehaviourWeight(mode="truncate", low=LO, high=HI),
        rl_mod.BehaviourWeight(level="sequence", mode="truncate", low=LO, high=HI),
    ):
        args = (cur, prox, beh, adv, b.mask)
        res = rl_mod.decoupled_policy_loss(*(x.to(dev) for x in args), behaviour=bw)
        nv, weights = rl_mod.decoupled_policy_loss_naive(*args, behaviour=bw)
        tag = f"{bw.level},{bw.mode}"
        out += [
            (f"loss({tag})", res.policy.loss, _t(nv.loss, res.policy.loss), None),
            (f"weight({tag})", res.weights.weight, _t(weights, res.policy.loss), None),
        ]
    return out


def _case_cispo(b: Batch, dev: torch.device) -> list[Pair]:
    cur, prox, _, adv = rollout_inputs(b)
    eps_lo, eps_hi = 1 - math.exp(-10.5 / 64), math.exp(12.5 / 64) - 1
    out: list[Pair] = []
    for agg in MASK_AGGS:
        for clip_low, kappa in ((eps_lo, None), (None, 0.25)):
            kw = {
                "clip_low": clip_low,
                "clip_high": eps_hi,
                "log_ratio_clamp": kappa,
                "norms": rl_mod.Norms(agg=agg),
            }
            res = cispo_mod.cispo_policy_loss(cur.to(dev), prox.to(dev), adv.to(dev), b.mask.to(dev), **kw)
            nv = cispo_mod.cispo_policy_loss_naive(cur, prox, adv, b.mask, **kw)
            tag = f"{agg.value},ε_low={clip_low is not None},κ={kappa}"
            out += [
                (f"loss({tag})", res.loss, _t(nv.loss, res.loss), None),
                (f"per_token({tag})", res.per_token, _t(nv.per_token, res.loss), None),
                (f"ratio({tag})", res.ratio, _t(nv.ratio, res.loss), None),
                (f"clipfrac({tag})", res.clipfrac, _t(nv.clipfrac, res.loss), None),
                (f"approx_kl_k2({tag})", res.approx_kl_k2, _t(nv.approx_kl_k2, res.loss), None),
            ]
    return out


def _case_clip_fraction(b: Batch, dev: torch.device) -> list[Pair]:
    """:func:`clip_fraction` for every ``clipfrac_counts``, the surrogate's and CISPO's, with a weight
    that zeroes a third of the tokens (``kept``) and without one."""
    cur, prox, _, adv = rollout_inputs(b)
    ratio = torch.exp(cur - prox)
    w = torch.where(torch.arange(ratio.numel()).reshape(ratio.shape) % 3 == 0, 0.0, 1.5).to(ratio.dtype)
    out: list[Pair] = []
    for counts in ClipFracCounts:
        for surrogate, band in ((True, (LO, HI)), (False, (None, HI))):
            kw = {"band": band, "surrogate": surrogate, "counts": counts}
            vec = cf_mod.clip_fraction(ratio.to(dev), adv.to(dev), b.mask.to(dev), weight=w.to(dev), **kw)
            naive = cf_mod.clip_fraction_naive(ratio, adv, b.mask, weight=w, **kw)
            out.append((f"clip_fraction({counts.value},surrogate={surrogate})", vec, _t(naive, vec), None))
    return out


def _case_weighted_logprob_loss(b: Batch, dev: torch.device) -> list[Pair]:
    cur, _, beh, adv = rollout_inputs(b)
    # verl bypass: π_θ/π^beh, truncated (from the naive twin: is_weights has its own case)
    w = torch.tensor(rc_mod.is_weights_naive(cur, beh, b.mask, high=HI)[0], dtype=b.dtype)
    out: list[Pair] = []
    for agg in MASK_AGGS:
        norms = rl_mod.Norms(agg=agg)
        loss, per_token = cispo_mod.weighted_logprob_loss(
            cur.to(dev), w.to(dev), adv.to(dev), b.mask.to(dev), norms=norms
        )
        nv_loss, nv_per_token = cispo_mod.weighted_logprob_loss_naive(cur, w, adv, b.mask, norms=norms)
        out += [
            (f"loss({agg.value})", loss, _t(nv_loss, loss), None),
            (f"per_token({agg.value})", per_token, _t(nv_per_token, loss), None),
        ]
    return out


ROLLOUT_CASES: dict[str, Case] = {
    "is_weights": _case_is_weights,
    "rejection_mask": _case_rejection_mask,
    "gate_statistic": _case_gate_statistic,
    "corrected_policy_loss": _case_corrected_policy_loss,
    "decoupled_policy_loss": _case_decoupled_policy_loss,
    "cispo_policy_loss": _case_cispo,
    "weighted_logprob_loss": _case_weighted_logprob_loss,
    "clip_fraction": _case_clip_fraction,
}
"""The rollout correction's cases (after :data:`.cases_loss.LOSS_CASES` in :data:`.cases.CASES`)."""
