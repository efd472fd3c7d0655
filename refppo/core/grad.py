"""Closed-form per-token gradients of the losses: the naive twin of autograd through the core.

Every function here is a *naive twin*: plain Python floats (IEEE double), one token at a time,
reading like the equations below; the vectorized side is torch autograd through
:func:`~refppo.core.policy.clipped_policy_loss`, :func:`~refppo.core.value.value_loss`,
:func:`~refppo.core.objective.kl_loss` and :func:`refppo.pipeline.step.update_quantities`. Outputs are
float64 ``[B, T]`` tensors (on the input's device), exactly 0 at padded positions.

Aggregation weight ``w(b,t) = ∂agg(L)/∂L[b,t]`` at a valid token (0 on padding), with the global
normalisers ``N_tok`` (``token_count``), ``N_seq`` (``seq_count``), ``H`` (``horizon``) when given,
else the local ones (valid tokens, rows ``B``, padded length ``T``); ``L_b`` = valid tokens of row b::

    token-mean 1/N_tok   seq-mean-token-mean 1/(L_b·N_seq)   seq-mean-token-sum 1/N_seq
    seq-mean-token-sum-norm 1/(H·N_seq)   token-sum 1

Policy loss, with ``d = l − l^old``, ``ρ = exp(clamp(d, −κ, κ))``, ``L1 = −Aρ``,
``L2 = −A·clip(ρ, 1−ε_low, 1+ε_high)``, ``ℓ = max(L1, L2)`` (dual-clip: ``min(ℓ, −cA)`` where A < 0)::

    ∂pg/∂l = w · s_min · (−A)·(s1 + s2·[1−ε_low ≤ ρ ≤ 1+ε_high]) · ρ · [−κ ≤ d ≤ κ]

Value loss, ``V^clip`` by the clip form, ``e1 = (V−R)²``, ``e2 = (V^clip−R)²``::

    ∂vf/∂V = w · (s1·(V − R) + s2·(V^clip − R)·[V^clip passes V])      (clipped)
    ∂vf/∂V = w · (V − R)                                                (unclipped)

KL loss (current vs reference log-probs), ``d = l − l^ref`` clamped to ``[lo, hi]``, estimate ``k``::

    ∂kl/∂l = w · k'(d) · [lo ≤ d ≤ hi] · [−c_v ≤ k ≤ c_v]
    k' = 1 (k1), d (k2), 1 − e^{−d} (k3), sign d (abs; 0 at d = 0)
    ∂kl/∂l = w · d, no clamp gate   (straight-through k1+, k3+, abs+: the gradient of ½ d², verl)

Objective (:func:`refppo.pipeline.step.update_quantities`): ``∂J/∂l = ∂pg/∂l + kl_coef·∂kl/∂l`` (the KL
term only with ``kl_in = loss``), ``∂J/∂V = vf_coef·∂vf/∂V``. The entropy is an *input* of the
pipeline (a tensor given beside the log-probs, not computed from them), so it contributes nothing to
``∂J/∂l``; through a model both come from the same logits, which is the model's business.

**Ties: the subgradient autograd takes (torch 2.13, checked in tests/core/test_core_grad.py).**

- ``torch.maximum(x, y)`` / ``torch.minimum``: the *shares* ``(s1, s2)`` are ``(1, 0)`` when x wins
  strictly, ``(0, 1)`` when y does, ``(½, ½)`` on a tie ``x == y``. ``s_min`` is the share of ``ℓ``
  in the dual-clip ``min(ℓ, −cA)``: 1, 0, or ½ when ``ρ = c`` exactly; it is 1 where ``A ≥ 0``.
- ``torch.clamp(x, lo, hi)`` (scalar or tensor bounds) passes the gradient on the closed interval
  ``lo ≤ x ≤ hi``: *inclusive* at the boundary, 0 strictly outside.
- ``torch.where(m, x, 0)`` sends nothing to the branch it did not pick: padding gets exact zeros.
- ``abs`` at 0 has gradient ``sign(0) = 0``.

Consequences: inside the clip range (boundaries included) ``L1 == L2`` and both halves carry the
same gradient, so the unclipped gradient is whole; strictly outside it is whole or 0. A tie of
``L1`` and ``L2`` outside the range (only by rounding when ``A ≠ 0``) gives half. For the clipped
value loss, ``V`` on the boundary ``V^old ± ε_v`` gives the whole ``(V − R)``; ``R`` exactly midway
between ``V`` (outside the range) and the bound gives ``½(V − R)``. The twin applies these rules to
its own double-precision values, so it takes the same branch as autograd wherever the decision does
not hinge on the last rounding step of the core's dtype (ties that are exact in every dtype:
``d = 0``, dyadic ``d = ±κ``, ``V − V^old = ±ε_v``; property tests force them).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from refppo.conventions import KLEstimator, LossAgg, ValueClipForm, ValueLoss
from refppo.core import _pyfloat as pf
from refppo.core._ties import clamp, inside, shares
from refppo.core.aggregate import agg_weights_naive
from refppo.core.kl import LogRatioClamp, _checked_kl_inputs, check_grad_is
from refppo.core.policy import _checked_policy_inputs
from refppo.core.value import _checked_value_inputs

Rows = list[list[float]]


def _out(rows: Rows, like: Tensor) -> Tensor:
    return torch.tensor(rows, dtype=torch.float64, device=like.device)


def _pg_token(
    d: float, a: float, eps_lo: float, eps_hi: float, dual: float | None, kappa: float | None
) -> float:
    """``∂ℓ/∂l`` of one valid token (before the aggregation weight)."""
    neg_a = -a
    ratio = math.exp(clamp(d, -kappa, kappa) if kappa is not None else d)
    lo, hi = 1.0 - eps_lo, 1.0 + eps_hi
    l1, l2 = neg_a * ratio, neg_a * clamp(ratio, lo, hi)
    s1, s2 = shares(l1, l2)
    d_ell_d_ratio = neg_a * (s1 + s2 * float(inside(ratio, lo, hi)))
    s_min = 1.0
    if dual is not None and neg_a > 0:  # the cap −c·A exists where A < 0 only
        # ℓ's share in min(ℓ, cap) is the cap's share in max(cap, ℓ): 1 when ℓ < cap, ½ on a tie
        s_min = shares(neg_a * dual, max(l1, l2))[0]
    pass_kappa = kappa is None or inside(d, -kappa, kappa)
    return d_ell_d_ratio * s_min * ratio if pass_kappa else 0.0


def policy_grad_naive(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    agg: LossAgg | str = LossAgg.TOKEN_MEAN,
    log_ratio_clamp: float | None = None,
    token_count: float | None = None,
    seq_count: float | None = None,
    horizon: float | None = None,
) -> Tensor:
    """``∂pg_loss/∂logp`` ``[B, T]`` of :func:`~refppo.core.policy.clipped_policy_loss` (same args)."""
    _checked_policy_inputs(  # the loss's own refusals (the derivative below is separate)
        logp, logp_old, advantages, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
        agg=agg, log_ratio_clamp=log_ratio_clamp,
    )  # fmt: skip
    eps_hi = clip_high if clip_high is not None else clip_low
    w = agg_weights_naive(mask, agg, token_count=token_count, seq_count=seq_count, horizon=horizon)
    lp, lo, advs, ms = pf.rows(logp), pf.rows(logp_old), pf.rows(advantages), pf.mask_rows(mask)
    out: Rows = []
    for b, mrow in enumerate(ms):
        row = []
        for t, ok in enumerate(mrow):
            if not ok:
                row.append(0.0)
                continue
            g = _pg_token(lp[b][t] - lo[b][t], advs[b][t], clip_low, eps_hi, dual_clip, log_ratio_clamp)
            row.append(w[b][t] * g)
        out.append(row)
    return _out(out, logp)


def _vf_token(v: float, v_old: float, ret: float, clip: float | None, delta_form: bool) -> float:
    """``∂ℓ^v/∂V`` of one valid token of the *clipped* value loss (before the weight)."""
    assert clip is not None
    if delta_form:  # V_old + clamp(V − V_old, ±ε): clamp sees V − V_old
        v_c = v_old + clamp(v - v_old, -clip, clip)
        passes = inside(v - v_old, -clip, clip)
    else:  # clamp(V, V_old − ε, V_old + ε)
        v_c = clamp(v, v_old - clip, v_old + clip)
        passes = inside(v, v_old - clip, v_old + clip)
    s1, s2 = shares((v - ret) ** 2, (v_c - ret) ** 2)
    return s1 * (v - ret) + s2 * (v_c - ret) * float(passes)


def value_grad_naive(
    values: Tensor,
    values_old: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float | None = 0.2,
    kind: ValueLoss | str = ValueLoss.CLIPPED,
    agg: LossAgg | str = LossAgg.TOKEN_MEAN,
    token_count: float | None = None,
    seq_count: float | None = None,
    horizon: float | None = None,
    clip_form: ValueClipForm | str = ValueClipForm.AROUND_OLD,
) -> Tensor:
    """``∂vf_loss/∂values`` ``[B, T]`` of :func:`~refppo.core.value.value_loss` (same args)."""
    _checked_value_inputs(  # the loss's own refusals (the derivative below is separate)
        values, values_old, returns, mask, clip=clip, kind=kind, agg=agg, clip_form=clip_form
    )
    clipped = ValueLoss(kind) == ValueLoss.CLIPPED
    delta_form = ValueClipForm(clip_form) == ValueClipForm.DELTA
    w = agg_weights_naive(mask, agg, token_count=token_count, seq_count=seq_count, horizon=horizon)
    vs, vos, rs, ms = pf.rows(values), pf.rows(values_old), pf.rows(returns), pf.mask_rows(mask)
    out: Rows = []
    for b, mrow in enumerate(ms):
        row = []
        for t, ok in enumerate(mrow):
            if not ok:
                row.append(0.0)
                continue
            v, v_old, ret = vs[b][t], vos[b][t], rs[b][t]
            g = _vf_token(v, v_old, ret, clip, delta_form) if clipped else v - ret
            row.append(w[b][t] * g)
        out.append(row)
    return _out(out, values)


def _kl_token(
    d: float, est: KLEstimator, log_ratio_clamp: LogRatioClamp | None, value_clamp: float | None
) -> float:
    """``∂k/∂l`` of one valid token (before the weight)."""
    if est.straight_through:  # value of the base estimator, gradient of ½ d² (its clamps act on the value)
        return d
    lo, hi = log_ratio_clamp if log_ratio_clamp is not None else (None, None)
    if not inside(d, lo, hi):
        return 0.0
    d = clamp(d, lo, hi)
    if est == KLEstimator.K1:
        k, dk = d, 1.0
    elif est == KLEstimator.K2:
        k, dk = 0.5 * d * d, d
    elif est == KLEstimator.K3:
        k, dk = math.exp(-d) - 1.0 + d, 1.0 - math.exp(-d)
    else:  # abs; sign(0) = 0
        k, dk = abs(d), float((d > 0) - (d < 0))
    if value_clamp is not None and not inside(k, -value_clamp, value_clamp):
        return 0.0
    return dk


def kl_loss_grad_naive(
    logp: Tensor,
    logp_ref: Tensor,
    mask: Tensor,
    estimator: KLEstimator | str = KLEstimator.K3,
    agg: LossAgg | str = LossAgg.TOKEN_MEAN,
    *,
    log_ratio_clamp: LogRatioClamp | None = None,
    value_clamp: float | None = None,
    token_count: float | None = None,
    seq_count: float | None = None,
    horizon: float | None = None,
    logp_old: Tensor | None = None,
    grad_is_clip: float | None = None,
) -> Tensor:
    """``∂kl_loss/∂logp`` ``[B, T]`` of :func:`~refppo.core.objective.kl_loss` (same args): each token's
    ``w(b,t)·∂KL_t/∂l_t``, times ``min(exp(l_t − l^old_t), grad_is_clip)`` when that is set."""
    est, _, _, m = _checked_kl_inputs(logp, logp_ref, mask, estimator, log_ratio_clamp, value_clamp)
    old = check_grad_is(logp_old, grad_is_clip, m, logp)
    w = agg_weights_naive(mask, agg, token_count=token_count, seq_count=seq_count, horizon=horizon)
    lp, lr, ms = pf.rows(logp), pf.rows(logp_ref), pf.mask_rows(mask)
    lo = pf.rows(old) if old is not None else None
    out: Rows = []
    for b, mrow in enumerate(ms):
        row = []
        for t, ok in enumerate(mrow):
            if not ok:
                row.append(0.0)
                continue
            g = w[b][t] * _kl_token(lp[b][t] - lr[b][t], est, log_ratio_clamp, value_clamp)
            if lo is not None and grad_is_clip is not None:
                g *= min(math.exp(lp[b][t] - lo[b][t]), grad_is_clip)
            row.append(g)
        out.append(row)
    return _out(out, logp)
