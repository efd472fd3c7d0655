"""The verify cases of the update stage's row-block losses (:mod:`refppo.core.by_rows`, the oracle's
no-grad path) and of the per-token terms they and the whole-batch losses share
(``policy_terms``, ``log_ratio_terms``, ``gspo_terms``, ``value_terms``).

Every output is compared with the NAIVE twin of the whole-batch loss (``clipped_policy_loss_naive``,
``gspo_policy_loss_naive``, ``value_loss_naive``, ``entropy_bonus_naive``, ``kl_loss_naive``): the
blocks are 2 rows, so a batch of more than two rows is cut in several blocks and a block that
misses, repeats or shifts rows shows. Each case returns (output name, vectorised, naive,
mask-or-None) pairs; vectorised functions are looked up on their module at call time.
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor

from refppo.agg_conventions import MASK_AGGS
from refppo.conventions import KLEstimator, LossAgg, ValueClipForm, ValueLoss
from refppo.verify.batches import Batch, Case, Pair
from refppo.verify.cases_loss import token_loss_pairs

by_rows_mod = importlib.import_module("refppo.core.by_rows")
gspo_mod = importlib.import_module("refppo.core.gspo")
objective_mod = importlib.import_module("refppo.core.objective")
policy_mod = importlib.import_module("refppo.core.policy")
value_mod = importlib.import_module("refppo.core.value")

ROWS = 2
"""Rows per block: several blocks for every batch of more than two rows."""


def _t(x: float | list[list[float]], like: Tensor) -> Tensor:
    return torch.tensor(x, dtype=torch.float64, device=like.device)


def _policy_inputs(b: Batch) -> tuple[Tensor, Tensor, Tensor]:
    lp_old = b.floats(-4.0, -0.1)
    lp = torch.where(b.mask, lp_old + b.floats(-0.6, 0.6), lp_old)
    return lp, lp_old, b.floats(-2.0, 2.0)


def _case_policy_by_rows(b: Batch, dev: torch.device) -> list[Pair]:
    lp, lp_old, adv = _policy_inputs(b)
    args = (lp.to(dev), lp_old.to(dev), adv.to(dev), b.mask.to(dev))
    out: list[Pair] = []
    for gspo, dual in ((False, None), (False, 3.0), (True, None)):
        for agg in MASK_AGGS:
            if gspo:
                res = by_rows_mod.policy_loss_by_rows(ROWS, *args, gspo=True, clip_high=0.28, agg=agg)
                nv = gspo_mod.gspo_policy_loss_naive(lp, lp_old, adv, b.mask, clip_high=0.28, agg=agg)
            else:
                res = by_rows_mod.policy_loss_by_rows(ROWS, *args, dual_clip=dual, agg=agg)
                nv = policy_mod.clipped_policy_loss_naive(lp, lp_old, adv, b.mask, dual_clip=dual, agg=agg)
            tag = f"{'gspo' if gspo else 'ppo'}{',dual' if dual else ''},{agg.value}"
            out.append((f"loss({tag})", res.loss, _t(nv.loss, res.loss), None))
            if agg is LossAgg.TOKEN_MEAN:
                out += [
                    (f"per_token({tag})", res.per_token, _t(nv.per_token, res.per_token), None),
                    (f"ratio({tag})", res.ratio, _t(nv.ratio, res.ratio), None),
                    (f"clipfrac({tag})", res.clipfrac, _t(nv.clipfrac, res.loss), None),
                ]
    return out


def _case_value_by_rows(b: Batch, dev: torch.device) -> list[Pair]:
    v_old = b.floats(-2.0, 2.0)
    v = torch.where(b.mask, v_old + b.floats(-0.5, 0.5), v_old)
    ret = b.floats(-2.0, 2.0)
    args = (v.to(dev), v_old.to(dev), ret.to(dev), b.mask.to(dev))
    out: list[Pair] = []
    for kind in ValueLoss:
        for form in ValueClipForm:
            for agg in (LossAgg.TOKEN_MEAN, LossAgg.SEQ_MEAN_TOKEN_SUM):
                res = by_rows_mod.value_loss_by_rows(ROWS, *args, kind=kind, agg=agg, clip_form=form)
                nv = value_mod.value_loss_naive(v, v_old, ret, b.mask, kind=kind, agg=agg, clip_form=form)
                tag = f"{kind.value},{form.value},{agg.value}"
                out += [
                    (f"loss({tag})", res.loss, _t(nv.loss, res.loss), None),
                    (f"per_token({tag})", res.per_token, _t(nv.per_token, res.per_token), None),
                    (f"clipfrac({tag})", res.clipfrac, _t(nv.clipfrac, res.clipfrac), None),
                ]
    return out


def _case_policy_token_by_rows(b: Batch, dev: torch.device) -> list[Pair]:
    """The per-token policy loss by blocks (with and without the ratio kept) against the naive loss."""
    lp, lp_old, adv = _policy_inputs(b)
    args = (lp.to(dev), lp_old.to(dev), adv.to(dev), b.mask.to(dev))
    out: list[Pair] = []
    for gspo, dual, kappa in ((False, None, None), (False, 3.0, 0.3), (True, None, 0.1)):
        for keep in (True, False):
            res = by_rows_mod.policy_token_loss_by_rows(
                ROWS, *args, gspo=gspo, clip_high=0.28, dual_clip=dual, log_ratio_clamp=kappa, keep_ratio=keep
            )
            if gspo:
                nv = gspo_mod.gspo_policy_loss_naive(
                    lp, lp_old, adv, b.mask, clip_high=0.28, log_ratio_max=kappa
                )
            else:
                nv = policy_mod.clipped_policy_loss_naive(
                    lp, lp_old, adv, b.mask, clip_high=0.28, dual_clip=dual, log_ratio_clamp=kappa
                )
            tag = f"{'gspo' if gspo else 'ppo'},dual={dual},κ={kappa},keep_ratio={keep}"
            out += token_loss_pairs(tag, res, nv, ratio=keep)
    return out


def _case_value_token_by_rows(b: Batch, dev: torch.device) -> list[Pair]:
    v_old = b.floats(-2.0, 2.0)
    v = torch.where(b.mask, v_old + b.floats(-0.5, 0.5), v_old)
    ret = b.floats(-2.0, 2.0)
    args = (v.to(dev), v_old.to(dev), ret.to(dev), b.mask.to(dev))
    out: list[Pair] = []
    for kind in ValueLoss:
        for form in ValueClipForm:
            res = by_rows_mod.value_token_loss_by_rows(ROWS, *args, kind=kind, clip_form=form)
            nv = value_mod.value_loss_naive(v, v_old, ret, b.mask, kind=kind, clip_form=form)
            tag = f"{kind.value},{form.value}"
            out += [
                (f"per_token({tag})", res.per_token, _t(nv.per_token, res.per_token), None),
                (f"clipfrac({tag})", res.clipfrac, _t(nv.clipfrac, res.clipfrac), None),
            ]
    return out


def _case_entropy_kl_by_rows(b: Batch, dev: torch.device) -> list[Pair]:
    ent = b.floats(0.0, 3.0)
    lp, lr = b.floats(-5.0, -0.1), b.floats(-5.0, -0.1)
    m = b.mask.to(dev)
    out: list[Pair] = [
        (
            f"entropy({agg.value})",
            by_rows_mod.entropy_bonus_by_rows(ROWS, ent.to(dev), m, agg),
            objective_mod.entropy_bonus_naive(ent, b.mask, agg),
            None,
        )
        for agg in MASK_AGGS
    ]
    agg = LossAgg.SEQ_MEAN_TOKEN_MEAN
    for est in KLEstimator:
        vec = by_rows_mod.kl_loss_by_rows(ROWS, lp.to(dev), lr.to(dev), m, est, agg)
        out.append((f"kl({est.value})", vec, objective_mod.kl_loss_naive(lp, lr, b.mask, est, agg), None))
    return out


def _case_terms(b: Batch, dev: torch.device) -> list[Pair]:
    """The per-token terms called on the whole batch: ``ℓ`` and ``ρ`` against the naive losses'
    per-token outputs, ``d = l − l^old`` against a loop over the valid tokens."""
    lp, lp_old, adv = _policy_inputs(b)
    m = b.mask.to(dev)
    out: list[Pair] = []
    for dual, kappa in ((None, None), (3.0, 0.3)):
        pt = policy_mod.policy_terms(
            lp.to(dev),
            lp_old.to(dev),
            adv.to(dev),
            m,
            eps_lo=0.2,
            eps_hi=0.2,
            dual_clip=dual,
            log_ratio_clamp=kappa,
        )
        nv = policy_mod.clipped_policy_loss_naive(
            lp, lp_old, adv, b.mask, dual_clip=dual, log_ratio_clamp=kappa
        )
        out += [
            (f"policy_terms.per_token(dual={dual})", pt.per_token, _t(nv.per_token, pt.per_token), None),
            (f"policy_terms.ratio(dual={dual})", pt.ratio, _t(nv.ratio, pt.ratio), None),
        ]
    d, rho = policy_mod.log_ratio_terms(lp.to(dev), lp_old.to(dev), m, 0.3)
    d_naive = [
        [float(lp[i, t]) - float(lp_old[i, t]) if bool(b.mask[i, t]) else 0.0 for t in range(b.shape[1])]
        for i in range(b.shape[0])
    ]
    nv = policy_mod.clipped_policy_loss_naive(lp, lp_old, adv, b.mask, log_ratio_clamp=0.3)
    out += [
        ("log_ratio_terms.d", d, _t(d_naive, d), None),
        ("log_ratio_terms.ratio", rho, _t(nv.ratio, rho), None),
    ]
    gt = gspo_mod.gspo_terms(
        lp.to(dev), lp_old.to(dev), adv.to(dev), m, eps_lo=0.2, eps_hi=0.28, log_ratio_max=10.0
    )
    gn = gspo_mod.gspo_policy_loss_naive(lp, lp_old, adv, b.mask, clip_high=0.28, log_ratio_max=10.0)
    out += [
        ("gspo_terms.per_token", gt.per_token, _t(gn.per_token, gt.per_token), None),
        ("gspo_terms.ratio", gt.ratio, _t(gn.ratio, gt.ratio), None),
    ]
    v_old = b.floats(-2.0, 2.0)
    v = torch.where(b.mask, v_old + b.floats(-0.5, 0.5), v_old)
    ret = b.floats(-2.0, 2.0)
    for form in ValueClipForm:
        vt, _ = value_mod.value_terms(v.to(dev), v_old.to(dev), ret.to(dev), m, eps_v=0.2, form=form)
        vn = value_mod.value_loss_naive(v, v_old, ret, b.mask, clip_form=form)
        out.append((f"value_terms({form.value})", vt, _t(vn.per_token, vt), None))
    return out


def _case_row_blocks(b: Batch, dev: torch.device) -> list[Pair]:
    """The blocks cover every row exactly once: how often each row is listed, against ones."""
    B = b.shape[0]
    times = torch.zeros(B, dtype=torch.float64, device=dev)
    for r in by_rows_mod.row_blocks(B, ROWS):
        times[r] += 1
    return [("times each row is covered", times, torch.ones(B, dtype=torch.float64), None)]


def _case_approx_kl_k1_clamped(b: Batch, dev: torch.device) -> list[Pair]:
    """:func:`approx_kl_k1_clamped` (``approx_kl=k1_clamped``, RLinf 0.3.0): without a clamp, and with
    one that binds on some tokens."""
    mod = importlib.import_module("refppo.core.approx_kl")
    old = b.floats(-3.0, -0.1)
    lp = old + b.floats(-0.6, 0.6)
    out: list[Pair] = []
    for kappa in (None, 0.3):
        vec = mod.approx_kl_k1_clamped(lp.to(dev), old.to(dev), b.mask.to(dev), kappa)
        naive = torch.tensor(mod.approx_kl_k1_clamped_naive(lp, old, b.mask, kappa), dtype=lp.dtype)
        out.append((f"clamp={kappa}", vec, naive, None))
    return out


ROW_CASES: dict[str, Case] = {
    "approx_kl_k1_clamped": _case_approx_kl_k1_clamped,
    "policy_terms": _case_terms,
    "row_blocks": _case_row_blocks,
    "policy_loss_by_rows": _case_policy_by_rows,
    "value_loss_by_rows": _case_value_by_rows,
    "policy_token_loss_by_rows": _case_policy_token_by_rows,
    "value_token_loss_by_rows": _case_value_token_by_rows,
    "entropy_kl_by_rows": _case_entropy_kl_by_rows,
}
"""The row-block losses' and per-token terms' cases (after the losses)."""
