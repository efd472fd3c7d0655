"""The verify cases of the losses (policy, value, aggregation, entropy bonus, KL loss, total, GSPO),
of their per-token stages (before aggregation, their statistics, ``V^clip``) and of their gradients
(autograd vs the closed-form twins of refppo/core/grad.py).

Each case returns a list of (output name, vectorised, naive, mask-or-None) to compare.
Vectorised functions are looked up on their module at call time (so a test can monkeypatch one).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
from torch import Tensor

from refppo.agg_conventions import MASK_AGGS
from refppo.conventions import KLEstimator, LossAgg, ValueClipForm, ValueLoss
from refppo.core import clipfrac as clipfrac_mod
from refppo.core.policy import PolicyLossNaive, PolicyTokenLoss
from refppo.verify.batches import Batch, Case, Pair

# The modules themselves, looked up by name at run time, so that a test can monkeypatch one
# vectorised function.
aggregate_mod = importlib.import_module("refppo.core.aggregate")
grad_mod = importlib.import_module("refppo.core.grad")
gspo_mod = importlib.import_module("refppo.core.gspo")
objective_mod = importlib.import_module("refppo.core.objective")
policy_mod = importlib.import_module("refppo.core.policy")
value_mod = importlib.import_module("refppo.core.value")


def _t(x: float | list[list[float]], like: Tensor) -> Tensor:
    return torch.tensor(x, dtype=torch.float64, device=like.device)


def token_loss_pairs(
    tag: str, res: PolicyTokenLoss, nv: PolicyLossNaive, *, ratio: bool = True
) -> list[Pair]:
    """The outputs of a per-token policy loss against its naive twin's (``ratio`` False: not ``ρ``)."""
    out: list[Pair] = [(f"per_token({tag})", res.per_token, _t(nv.per_token, res.per_token), None)]
    if ratio:
        out.append((f"ratio({tag})", res.ratio, _t(nv.ratio, res.ratio), None))
    stats = ("clipfrac", "clipfrac_lower", "approx_kl", "approx_kl_k2")
    return out + [(f"{s}({tag})", getattr(res, s), _t(getattr(nv, s), res.clipfrac), None) for s in stats]


def _policy_inputs(b: Batch) -> tuple[Tensor, Tensor, Tensor]:
    lp_old = b.floats(-4.0, -0.1)
    lp = torch.where(b.mask, lp_old + b.floats(-0.6, 0.6), lp_old)
    return lp, lp_old, b.floats(-2.0, 2.0)


def _value_inputs(b: Batch) -> tuple[Tensor, Tensor, Tensor]:
    v_old = b.floats(-2.0, 2.0)
    v = torch.where(b.mask, v_old + b.floats(-0.5, 0.5), v_old)
    return v, v_old, b.floats(-2.0, 2.0)


def _case_policy(b: Batch, dev: torch.device) -> list[Pair]:
    lp_old = b.floats(-4.0, -0.1)
    lp = torch.where(b.mask, lp_old + b.floats(-0.6, 0.6), lp_old)
    adv = b.floats(-2.0, 2.0)
    out: list[Pair] = []
    for dual in (None, 3.0):
        for agg in MASK_AGGS:
            res = policy_mod.clipped_policy_loss(
                lp.to(dev), lp_old.to(dev), adv.to(dev), b.mask.to(dev), clip_low=0.2, dual_clip=dual, agg=agg
            )
            nv = policy_mod.clipped_policy_loss_naive(lp, lp_old, adv, b.mask, dual_clip=dual, agg=agg)
            tag = f"{agg.value}{',dual' if dual else ''}"
            out.append((f"loss({tag})", res.loss, _t(nv.loss, res.loss), None))
            if agg is LossAgg.TOKEN_MEAN:
                out += [
                    (f"per_token({tag})", res.per_token, _t(nv.per_token, res.per_token), None),
                    (f"ratio({tag})", res.ratio, _t(nv.ratio, res.ratio), None),
                    (f"clipfrac({tag})", res.clipfrac, _t(nv.clipfrac, res.clipfrac), None),
                    (f"clipfrac_lower({tag})", res.clipfrac_lower, _t(nv.clipfrac_lower, res.loss), None),
                    (f"approx_kl({tag})", res.approx_kl, _t(nv.approx_kl, res.loss), None),
                    (f"approx_kl_k2({tag})", res.approx_kl_k2, _t(nv.approx_kl_k2, res.loss), None),
                ]
    return out


def _case_policy_ratio(b: Batch, dev: torch.device) -> list[Pair]:
    """``ρ = exp(clamp(l − l^old, ±κ))``: the twin is the ratio of the naive clipped loss, token by token."""
    lp_old = b.floats(-4.0, -0.1)
    lp = torch.where(b.mask, lp_old + b.floats(-2.0, 2.0), lp_old)
    zeros = torch.zeros_like(lp)
    out: list[Pair] = []
    for clamp in (None, 0.5):
        vec = policy_mod.policy_ratio(lp.to(dev), lp_old.to(dev), b.mask.to(dev), log_ratio_clamp=clamp)
        nv = policy_mod.clipped_policy_loss_naive(lp, lp_old, zeros, b.mask, log_ratio_clamp=clamp)
        out.append((f"κ={clamp}", vec, _t(nv.ratio, vec), None))
    return out


def _case_value(b: Batch, dev: torch.device) -> list[Pair]:
    v_old = b.floats(-2.0, 2.0)
    v = torch.where(b.mask, v_old + b.floats(-0.5, 0.5), v_old)
    ret = b.floats(-2.0, 2.0)
    out: list[Pair] = []
    for kind in ValueLoss:
        for agg in (LossAgg.TOKEN_MEAN, LossAgg.SEQ_MEAN_TOKEN_MEAN):
            res = value_mod.value_loss(
                v.to(dev), v_old.to(dev), ret.to(dev), b.mask.to(dev), kind=kind, agg=agg
            )
            nv = value_mod.value_loss_naive(v, v_old, ret, b.mask, kind=kind, agg=agg)
            tag = f"{kind.value},{agg.value}"
            out += [
                (f"loss({tag})", res.loss, _t(nv.loss, res.loss), None),
                (f"per_token({tag})", res.per_token, _t(nv.per_token, res.per_token), None),
                (f"clipfrac({tag})", res.clipfrac, _t(nv.clipfrac, res.clipfrac), None),
            ]
    return out


def _case_aggregate(b: Batch, dev: torch.device) -> list[Pair]:
    x = b.floats(-3.0, 3.0)
    out: list[Pair] = []
    norms = {"token_count": 97.0, "seq_count": 13.0, "horizon": 40.0}
    for agg in MASK_AGGS:
        xd, md = x.to(dev), b.mask.to(dev)
        out.append(
            (
                agg.value,
                aggregate_mod.aggregate_loss(xd, md, agg),
                aggregate_mod.aggregate_loss_naive(x, b.mask, agg),
                None,
            )
        )
        out.append(
            (
                f"{agg.value}(global counts)",
                aggregate_mod.aggregate_loss(xd, md, agg, **norms),
                aggregate_mod.aggregate_loss_naive(x, b.mask, agg, **norms),
                None,
            )
        )
    return out


def _case_aggregate_masked(b: Batch, dev: torch.device) -> list[Pair]:
    """The core-internal entry of :func:`aggregate_loss` (inputs already 0 on padding)."""
    x = torch.where(b.mask, b.floats(-3.0, 3.0), torch.zeros((), dtype=b.dtype))
    norms = {"token_count": 97.0, "seq_count": 13.0, "horizon": 40.0}
    out: list[Pair] = []
    for agg in MASK_AGGS:
        for tag, kw in (("", {}), ("(global counts)", norms)):
            vec = aggregate_mod.aggregate_masked(x.to(dev), b.mask.to(dev), agg, **kw)
            out.append(
                (f"{agg.value}{tag}", vec, aggregate_mod.aggregate_loss_naive(x, b.mask, agg, **kw), None)
            )
    return out


def _case_prompt_mean(b: Batch, dev: torch.device) -> list[Pair]:
    """:func:`prompt_mean_loss`: prompts of 1–3 rows, not adjacent (ids drawn from the batch's generator)."""
    x = b.floats(-3.0, 3.0)
    B = b.shape[0]
    groups = torch.randint(0, max(1, B // 2), (B,), generator=b.gen)
    out: list[Pair] = []
    for tag, kw in (("", {}), ("(global count)", {"prompt_count": 11.0})):
        vec = aggregate_mod.prompt_mean_loss(x.to(dev), b.mask.to(dev), groups.to(dev), **kw)
        out.append(
            (f"prompt_mean{tag}", vec, aggregate_mod.prompt_mean_loss_naive(x, b.mask, groups, **kw), None)
        )
    table = tuple((int(g), 2.0 + int(g)) for g in torch.unique(groups))  # a split step's N_p by prompt
    for tag, pr in (("", None), ("(split table)", table)):
        lm = torch.where(b.mask, x, torch.zeros((), dtype=x.dtype)).to(dev)
        vec = aggregate_mod.prompt_mean_masked(lm, b.mask.to(dev), aggregate_mod.Prompts(groups.to(dev), pr))
        naive = aggregate_mod.prompt_mean_naive(x, b.mask, aggregate_mod.Prompts(groups, pr))
        out.append((f"loss_agg=prompt-mean{tag}", vec, naive, None))
    return out


def _case_clipfrac_row_mean(b: Batch, dev: torch.device) -> list[Pair]:
    """:func:`clipfrac_row_mean` (``clipfrac_agg=row-mean``), with and without ε_high and κ."""
    old = b.floats(-3.0, -0.1)
    lp, adv = old + b.floats(-0.4, 0.4), b.floats(-2.0, 2.0)
    out: list[Pair] = []
    for tag, kw in (("", {}), ("(eps_high, clamp)", {"clip_high": 0.3, "log_ratio_clamp": 0.3})):
        vec = clipfrac_mod.clipfrac_row_mean(lp.to(dev), old.to(dev), adv.to(dev), b.mask.to(dev), **kw)
        naive = torch.tensor(clipfrac_mod.clipfrac_row_mean_naive(lp, old, adv, b.mask, **kw), dtype=lp.dtype)
        out.append((f"clipfrac_row_mean{tag}", vec, naive, None))
    return out


def _case_entropy_bonus(b: Batch, dev: torch.device) -> list[Pair]:
    ent = b.floats(0.0, 3.0)
    return [
        (
            agg.value,
            objective_mod.entropy_bonus(ent.to(dev), b.mask.to(dev), agg),
            objective_mod.entropy_bonus_naive(ent, b.mask, agg),
            None,
        )
        for agg in MASK_AGGS
    ]


def _case_kl_loss(b: Batch, dev: torch.device) -> list[Pair]:
    lp, lr = b.floats(-5.0, -0.1), b.floats(-5.0, -0.1)
    agg = LossAgg.SEQ_MEAN_TOKEN_MEAN
    return [
        (
            est.value,
            objective_mod.kl_loss(lp.to(dev), lr.to(dev), b.mask.to(dev), est, agg),
            objective_mod.kl_loss_naive(lp, lr, b.mask, est, agg),
            None,
        )
        for est in KLEstimator
    ]


def _case_total_loss(b: Batch, dev: torch.device) -> list[Pair]:
    terms = [float(t) for t in torch.rand(5, generator=b.gen, dtype=torch.float64)]
    coefs = {"vf_coef": 0.1, "ent_coef": 0.01, "kl_coef": 0.05, "ptx_coef": 0.5}
    vec = objective_mod.total_loss(*(torch.tensor(t, dtype=b.dtype, device=dev) for t in terms), **coefs)
    return [("total", vec, _t(objective_mod.total_loss_naive(*terms, **coefs), vec), None)]


def _case_gspo(b: Batch, dev: torch.device) -> list[Pair]:
    lp_old = b.floats(-4.0, -0.1)
    lp = torch.where(b.mask, lp_old + b.floats(-0.6, 0.6), lp_old)
    adv = b.floats(-2.0, 2.0)
    out: list[Pair] = []
    for agg in MASK_AGGS:
        args = (lp.to(dev), lp_old.to(dev), adv.to(dev), b.mask.to(dev))
        res = gspo_mod.gspo_policy_loss(*args, clip_high=0.28, agg=agg, log_ratio_max=10.0)
        nv = gspo_mod.gspo_policy_loss_naive(
            lp, lp_old, adv, b.mask, clip_high=0.28, agg=agg, log_ratio_max=10.0
        )
        out.append((f"loss({agg.value})", res.loss, _t(nv.loss, res.loss), None))
    out.append(("ratio", res.ratio, _t(nv.ratio, res.ratio), None))
    out.append(("per_token", res.per_token, _t(nv.per_token, res.per_token), None))
    return out


def _case_policy_token_loss(b: Batch, dev: torch.device) -> list[Pair]:
    """The clipped surrogate before aggregation against the naive loss's per-token outputs and stats."""
    lp, lp_old, adv = _policy_inputs(b)
    args = (lp.to(dev), lp_old.to(dev), adv.to(dev), b.mask.to(dev))
    out: list[Pair] = []
    for dual, kappa in ((None, None), (3.0, 0.3)):
        kw = {"clip_high": 0.28, "dual_clip": dual, "log_ratio_clamp": kappa}
        res = policy_mod.clipped_policy_token_loss(*args, **kw)
        nv = policy_mod.clipped_policy_loss_naive(lp, lp_old, adv, b.mask, **kw)
        out += token_loss_pairs(f"dual={dual},κ={kappa}", res, nv)
    return out


def _case_token_statistics(b: Batch, dev: torch.device) -> list[Pair]:
    """The statistics of the clipped (and GSPO) per-token terms against the naive losses'."""
    lp, lp_old, adv = _policy_inputs(b)
    args, m = (lp.to(dev), lp_old.to(dev), adv.to(dev), b.mask.to(dev)), b.mask.to(dev)
    out: list[Pair] = []
    for dual in (None, 3.0):
        t = policy_mod.policy_terms(*args, eps_lo=0.2, eps_hi=0.28, dual_clip=dual, log_ratio_clamp=None)
        nv = policy_mod.clipped_policy_loss_naive(lp, lp_old, adv, b.mask, clip_high=0.28, dual_clip=dual)
        out += token_loss_pairs(f"ppo,dual={dual}", policy_mod.token_statistics(t, m), nv)
    t = gspo_mod.gspo_terms(*args, eps_lo=0.2, eps_hi=0.28, log_ratio_max=0.1)
    nv = gspo_mod.gspo_policy_loss_naive(lp, lp_old, adv, b.mask, clip_high=0.28, log_ratio_max=0.1)
    return out + token_loss_pairs("gspo", policy_mod.token_statistics(t, m), nv)


def _case_gspo_token_loss(b: Batch, dev: torch.device) -> list[Pair]:
    """GSPO before aggregation (κ = 0.1 caps some rows' ``S_b``) against the naive GSPO loss."""
    lp, lp_old, adv = _policy_inputs(b)
    out: list[Pair] = []
    for kappa in (None, 0.1):
        kw = {"clip_high": 0.28, "log_ratio_max": kappa}
        res = gspo_mod.gspo_policy_token_loss(lp.to(dev), lp_old.to(dev), adv.to(dev), b.mask.to(dev), **kw)
        out += token_loss_pairs(
            f"κ={kappa}", res, gspo_mod.gspo_policy_loss_naive(lp, lp_old, adv, b.mask, **kw)
        )
    return out


def _case_gspo_ratio(b: Batch, dev: torch.device) -> list[Pair]:
    """``s_b = exp(min(S_b, κ))`` on each valid token against the naive GSPO loss's ratio."""
    lp, lp_old, _ = _policy_inputs(b)
    zeros = torch.zeros_like(lp)
    out: list[Pair] = []
    for kappa in (None, 0.1):
        vec = gspo_mod.gspo_ratio(lp.to(dev), lp_old.to(dev), b.mask.to(dev), log_ratio_max=kappa)
        nv = gspo_mod.gspo_policy_loss_naive(lp, lp_old, zeros, b.mask, log_ratio_max=kappa)
        out.append((f"κ={kappa}", vec, _t(nv.ratio, vec), None))
    return out


def _case_approx_kl_k2_all(b: Batch, dev: torch.device) -> list[Pair]:
    lp, lp_old, _ = _policy_inputs(b)
    vec = policy_mod.approx_kl_k2_all_positions(lp.to(dev), lp_old.to(dev), b.mask.to(dev))
    nv = policy_mod.approx_kl_k2_all_positions_naive(lp, lp_old, b.mask)
    return [("k2_all_positions", vec, _t(nv, vec), None)]


def _case_value_token_loss(b: Batch, dev: torch.device) -> list[Pair]:
    v, v_old, ret = _value_inputs(b)
    out: list[Pair] = []
    for kind in ValueLoss:
        for form in ValueClipForm:
            kw = {"kind": kind, "clip_form": form}
            res = value_mod.value_token_loss(v.to(dev), v_old.to(dev), ret.to(dev), b.mask.to(dev), **kw)
            nv = value_mod.value_loss_naive(v, v_old, ret, b.mask, **kw)
            tag = f"{kind.value},{form.value}"
            out += [
                (f"per_token({tag})", res.per_token, _t(nv.per_token, res.per_token), None),
                (f"clipfrac({tag})", res.clipfrac, _t(nv.clipfrac, res.clipfrac), None),
            ]
    return out


def _case_clipped_value(b: Batch, dev: torch.device) -> list[Pair]:
    """``V^clip`` through the naive twin of its whole: ``½·max((V − R)², (V^clip − R)²)`` on the
    valid tokens against the naive clipped value loss's per-token term (ε_v = 0.2, both forms)."""
    v, v_old, ret = _value_inputs(b)
    vd, vod, rd, m = v.to(dev), v_old.to(dev), ret.to(dev), b.mask.to(dev)
    out: list[Pair] = []
    for form in ValueClipForm:
        vc = value_mod.clipped_value(vd, vod, 0.2, form)
        per_token = 0.5 * torch.maximum((vd - rd) ** 2, (vc - rd) ** 2)
        nv = value_mod.value_loss_naive(v, v_old, ret, b.mask, clip=0.2, clip_form=form)
        out.append((f"ℓ^v({form.value})", per_token, _t(nv.per_token, per_token), m))
    return out


def _autograd(loss_fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    leaf = x.detach().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(loss_fn(leaf), leaf)
    return grad


def _case_gradients(b: Batch, dev: torch.device) -> list[Pair]:
    """Autograd through the losses vs the closed-form twins of refppo/core/grad.py (``token-sum``:
    the weight is 1, so the gradients are O(1) and the tolerance means what it says)."""
    lp_old, adv, ref = b.floats(-4.0, -0.1), b.floats(-2.0, 2.0), b.floats(-4.0, -0.1)
    lp = torch.where(b.mask, lp_old + b.floats(-0.6, 0.6), lp_old)
    v_old, ret = b.floats(-2.0, 2.0), b.floats(-2.0, 2.0)
    v = torch.where(b.mask, v_old + b.floats(-0.5, 0.5), v_old)
    m, md, agg = b.mask, b.mask.to(dev), LossAgg.TOKEN_SUM
    pol = {"clip_high": 0.28, "dual_clip": 3.0, "agg": agg, "log_ratio_clamp": 0.5}
    kl = {"log_ratio_clamp": (-1.0, 1.0), "value_clamp": 0.5}
    grads = {
        "policy": (
            _autograd(
                lambda x: policy_mod.clipped_policy_loss(x, lp_old.to(dev), adv.to(dev), md, **pol).loss,
                lp.to(dev),
            ),
            grad_mod.policy_grad_naive(lp, lp_old, adv, m, **pol),
        ),
        "gspo": (
            _autograd(
                lambda x: gspo_mod.gspo_policy_loss(x, lp_old.to(dev), adv.to(dev), md, agg=agg).loss,
                lp.to(dev),
            ),
            gspo_mod.gspo_policy_grad_naive(lp, lp_old, adv, m, agg=agg),
        ),
        "value": (
            _autograd(
                lambda x: value_mod.value_loss(x, v_old.to(dev), ret.to(dev), md, agg=agg).loss, v.to(dev)
            ),
            grad_mod.value_grad_naive(v, v_old, ret, m, agg=agg),
        ),
        "kl_k3": (
            _autograd(lambda x: objective_mod.kl_loss(x, ref.to(dev), md, "k3", agg, **kl), lp.to(dev)),
            grad_mod.kl_loss_grad_naive(lp, ref, m, "k3", agg, **kl),
        ),
    }
    return [(name, auto, twin, None) for name, (auto, twin) in grads.items()]


LOSS_CASES: dict[str, Case] = {
    "policy_ratio": _case_policy_ratio,
    "clipped_policy_loss": _case_policy,
    "value_loss": _case_value,
    "aggregate_loss": _case_aggregate,
    "aggregate_masked": _case_aggregate_masked,
    "prompt_mean_loss": _case_prompt_mean,
    "clipfrac_row_mean": _case_clipfrac_row_mean,
    "entropy_bonus": _case_entropy_bonus,
    "kl_loss": _case_kl_loss,
    "total_loss": _case_total_loss,
    "gspo_policy_loss": _case_gspo,
    "clipped_policy_token_loss": _case_policy_token_loss,
    "token_statistics": _case_token_statistics,
    "gspo_policy_token_loss": _case_gspo_token_loss,
    "gspo_ratio": _case_gspo_ratio,
    "approx_kl_k2_all_positions": _case_approx_kl_k2_all,
    "value_token_loss": _case_value_token_loss,
    "clipped_value": _case_clipped_value,
    "loss_gradients": _case_gradients,
}
"""The losses' and gradients' cases, in table order (after :data:`.cases.TOKEN_CASES`)."""
