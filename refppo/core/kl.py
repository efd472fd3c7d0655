"""Per-token KL estimators between the policy and the reference.

With ``d_t = log π(y_t) − log π_ref(y_t)`` at a token sampled from π:

======= ===================== =============================================================
name    value                 properties (proven in tests/core/test_kl_properties.py)
======= ===================== =============================================================
k1      ``d``                 unbiased for KL(π‖π_ref); can be negative
k2      ``½ d²``              ≥ 0; biased
k3      ``exp(−d) + d − 1``   ≥ 0; unbiased (Schulman 2020, "low variance", verl low_var_kl)
abs     ``|d|``               ≥ 0; biased
k1+ …   as k1, k3, abs        straight-through: gradient ``∂/∂ log π = d`` (that of ``½ d²``)
======= ===================== =============================================================

The ``+`` variants (verl 0.9.1 ``core_algos.kl_penalty``: ``backward − backward.detach() +
forward.detach()`` with ``backward = ½ (log π − log π_ref)²``) have the base estimator's value,
clamps included, and the gradient ``d`` of the *unclamped* log-ratio (the clamps act on the
detached value only). It matters only for the KL in the loss (the reward's KL is not differentiated).

Optional clamps mirror the peers: ``log_ratio_clamp=(lo, hi)`` clamps ``d`` first (either side may
be None), ``value_clamp=c`` clamps the estimate to ``[−c, c]``. verl ``core_algos.kl_penalty_forward``
uses, for k3 only, ``d ∈ [−20, 20]`` and value ``∈ [−10, 10]``; OpenRLHF
``models/utils.py::compute_approx_kl`` uses, for k3, ``d ≥ −10``, and value ``∈ [−10, 10]`` for every
estimator. Outputs are 0 at padded positions.

Importance-weighted gradient (``grad_is_clip=c``, OpenRLHF 0.11.2 ``models/utils.py::compute_approx_kl``
with ``unbiased_gradient=True``, ``KL_IS_WEIGHT_CLIP = 10``): the value is unchanged and the gradient
is multiplied per token by ``w_t = min(exp(log π − log π_old), c)``, detached (``logp_old`` the old
log-probs, the ones the rollout was sampled from): ``KL_t ← sg(KL_t) + w_t·(KL_t − sg(KL_t))``, so
``∂/∂ log π = w_t·∂KL_t/∂ log π``. OpenRLHF's form (value of its estimator, gradient ``w·d``) is
``k1+``/``k3+`` (and ``k2`` where ``½ d² ≤`` the value clamp) with ``grad_is_clip=10``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from refppo.conventions import KLEstimator, parse
from refppo.core import _pyfloat as pf
from refppo.core.checks import check_bt, check_mask, check_same_dtype
from refppo.errors import HyperparameterError
from refppo.types import ResponseMask, TokenFloat

LogRatioClamp = tuple[float | None, float | None]


def check_kl_clamps(
    log_ratio_clamp: LogRatioClamp | None, value_clamp: float | None, *, prefix: str = ""
) -> None:
    """``log_ratio_clamp`` a pair ``(lo, hi)``, each a finite number or None, ``lo <= hi``;
    ``value_clamp``: finite, > 0. Anything else is one :class:`HyperparameterError`.

    ``prefix`` goes before the names in the messages (``kl_`` for the pipeline's Convention fields).
    """
    lr, vc = f"{prefix}log_ratio_clamp", f"{prefix}value_clamp"
    if log_ratio_clamp is not None:
        if not (isinstance(log_ratio_clamp, (tuple, list)) and len(log_ratio_clamp) == 2):
            raise HyperparameterError(f"{lr}: expected a pair (lo, hi), got {log_ratio_clamp!r}")
        lo, hi = log_ratio_clamp
        for side, bound in (("lo", lo), ("hi", hi)):
            if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float))):
                raise HyperparameterError(f"{lr}: {side} must be a number or None, got {bound!r}")
            if bound is not None and not math.isfinite(bound):
                raise HyperparameterError(f"{lr}: {side} must be finite or None, got {bound!r}")
        if lo is not None and hi is not None and lo > hi:
            raise HyperparameterError(f"{lr}: expected lo <= hi, got ({lo}, {hi})")
    if value_clamp is not None and not (math.isfinite(value_clamp) and value_clamp > 0):
        raise HyperparameterError(f"{vc}: expected a number > 0, got {value_clamp!r}")


def _checked_kl_inputs(
    logp: Tensor,
    logp_ref: Tensor,
    mask: Tensor,
    estimator: KLEstimator | str,
    log_ratio_clamp: LogRatioClamp | None,
    value_clamp: float | None,
) -> tuple[KLEstimator, Tensor, Tensor, Tensor]:
    """:func:`token_kl`'s inputs checked in one place (shared with :func:`token_kl_naive`, so a bad
    input gets the same error from both): ``(estimator, logp, logp_ref, mask)``."""
    est = parse(KLEstimator, estimator, what="kl_estimator")
    m = check_mask("mask", mask, require_nonempty_rows=False)
    logp = check_bt("logp", logp, m)
    logp_ref = check_bt("logp_ref", logp_ref, m)
    check_same_dtype(logp=logp, logp_ref=logp_ref)
    check_kl_clamps(log_ratio_clamp, value_clamp)
    return est, logp, logp_ref, m


def check_grad_is(logp_old: object, grad_is_clip: float | None, m: Tensor, logp: Tensor) -> Tensor | None:
    """``grad_is_clip`` None, or finite > 0 with ``logp_old`` ``[B, T]`` of ``logp``'s dtype (returned)."""
    if grad_is_clip is None:
        return None
    if isinstance(grad_is_clip, bool) or not isinstance(grad_is_clip, int | float):
        raise HyperparameterError(f"kl_grad_is_clip: expected a number > 0 or None, got {grad_is_clip!r}")
    if not (math.isfinite(grad_is_clip) and grad_is_clip > 0):
        raise HyperparameterError(f"kl_grad_is_clip: expected a finite number > 0, got {grad_is_clip!r}")
    if logp_old is None:
        raise HyperparameterError("kl_grad_is_clip: the importance weight needs the old log-probs (logp_old)")
    old = check_bt("logp_old", logp_old, m)
    check_same_dtype(logp=logp, logp_old=old)
    return old


def token_kl(
    logp: TokenFloat,
    logp_ref: TokenFloat,
    mask: ResponseMask,
    estimator: KLEstimator | str = KLEstimator.K1,
    *,
    log_ratio_clamp: LogRatioClamp | None = None,
    value_clamp: float | None = None,
    logp_old: TokenFloat | None = None,
    grad_is_clip: float | None = None,
) -> TokenFloat:
    """Per-token KL estimate ``[B, T]`` of the chosen ``estimator``; 0 at padded positions.
    ``grad_is_clip``: the gradient times ``min(exp(logp − logp_old), grad_is_clip)`` (module docstring)."""
    est, logp, logp_ref, m = _checked_kl_inputs(logp, logp_ref, mask, estimator, log_ratio_clamp, value_clamp)
    old = check_grad_is(logp_old, grad_is_clip, m, logp)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    d = torch.where(m, logp - logp_ref, zero)
    if log_ratio_clamp is not None and log_ratio_clamp != (None, None):
        # (None, None) means "no clamp" (torch.clamp refuses two Nones).
        d = torch.clamp(d, min=log_ratio_clamp[0], max=log_ratio_clamp[1])
    kl: Tensor
    base = est.base
    if base is KLEstimator.K1:
        kl = d
    elif base is KLEstimator.K2:
        kl = 0.5 * d * d
    elif base is KLEstimator.K3:
        kl = torch.expm1(-d) + d
    else:
        kl = d.abs()
    if value_clamp is not None:
        kl = torch.clamp(kl, min=-value_clamp, max=value_clamp)
    if est.straight_through:  # value kl, gradient that of ½ d² on the unclamped log-ratio
        d_raw = torch.where(m, logp - logp_ref, zero)
        k2 = 0.5 * d_raw * d_raw
        kl = k2 - k2.detach() + kl.detach()
    if old is not None and grad_is_clip is not None:  # value kl, gradient w·∂kl
        w = torch.where(m, logp.detach() - old, zero).exp().clamp(max=grad_is_clip)
        kl = kl.detach() + w * (kl - kl.detach())
    return torch.where(m, kl, zero)


def token_kl_naive(
    logp: TokenFloat,
    logp_ref: TokenFloat,
    mask: ResponseMask,
    estimator: KLEstimator | str = KLEstimator.K1,
    *,
    log_ratio_clamp: LogRatioClamp | None = None,
    value_clamp: float | None = None,
    logp_old: TokenFloat | None = None,
    grad_is_clip: float | None = None,
) -> TokenFloat:
    """Naive twin of :func:`token_kl` (values: a ``+`` variant is its base estimator; the importance
    weight of ``grad_is_clip`` changes no value, its inputs are checked the same)."""
    est, _, _, m = _checked_kl_inputs(logp, logp_ref, mask, estimator, log_ratio_clamp, value_clamp)
    est = est.base
    check_grad_is(logp_old, grad_is_clip, m, logp)
    lp, lr, ms = pf.rows(logp), pf.rows(logp_ref), pf.mask_rows(mask)
    out = []
    for row_p, row_r, mrow in zip(lp, lr, ms, strict=True):
        new_row = []
        for a, b, ok in zip(row_p, row_r, mrow, strict=True):
            if not ok:
                new_row.append(0.0)
                continue
            d = a - b
            if log_ratio_clamp is not None:
                lo, hi = log_ratio_clamp
                if lo is not None and d < lo:
                    d = lo
                if hi is not None and d > hi:
                    d = hi
            if est == KLEstimator.K1:
                k = d
            elif est == KLEstimator.K2:
                k = d * d / 2.0
            elif est == KLEstimator.K3:
                k = math.exp(-d) - 1.0 + d
            else:
                k = abs(d)
            if value_clamp is not None:
                k = min(max(k, -value_clamp), value_clamp)
            new_row.append(k)
        out.append(new_row)
    return pf.tensor_like(out, logp)
