"""The ``approx_kl`` statistic of the clamped log-ratio (:class:`refppo.conventions.ApproxKL`
``k1_clamped``).

With ``d_t = l_t − l^old_t`` on the valid tokens (``n`` of them) and the ratio's log-ratio clamp
``κ`` (``log_ratio_clamp``)::

    approx_kl = −Σ_valid clamp(d_t, −κ, κ) / max(n, 1)        (κ None: no clamp, = k1)

RLinf 0.3.0 ``rlinf/algorithms/losses.py::compute_ppo_actor_loss`` logs this: its ``approx_kl`` is
made from the log-ratio after ``clip_log_ratio_min`` / ``clip_log_ratio_max`` (symmetric ``±κ``
here), divided by ``loss_mask.count_nonzero() or 1``. Where no ``|d_t|`` exceeds ``κ`` it equals
``k1`` (``mean_valid(l^old − l)``). Shapes: ``logp``, ``logp_old``, ``mask`` ``[B, T]``; a
detached scalar of ``logp``'s dtype.
"""

from __future__ import annotations

import math

import torch

from refppo.core import _pyfloat as pf
from refppo.core.checks import check_bt, check_mask
from refppo.errors import HyperparameterError
from refppo.types import ResponseMask, Scalar, TokenFloat


def _check_clamp(log_ratio_clamp: float | None) -> None:
    if log_ratio_clamp is not None and not (math.isfinite(log_ratio_clamp) and log_ratio_clamp > 0):
        raise HyperparameterError(f"log_ratio_clamp: must be finite and > 0 or None, got {log_ratio_clamp!r}")


def approx_kl_k1_clamped(
    logp: TokenFloat, logp_old: TokenFloat, mask: ResponseMask, log_ratio_clamp: float | None
) -> Scalar:
    """``−Σ_valid clamp(l − l^old, ±κ) / max(n, 1)`` (module docstring; detached)."""
    _check_clamp(log_ratio_clamp)
    m = check_mask("mask", mask, require_nonempty_rows=False)
    logp = check_bt("logp", logp, m)
    logp_old = check_bt("logp_old", logp_old, m)
    with torch.no_grad():
        d = torch.where(m, logp - logp_old, torch.zeros((), dtype=logp.dtype, device=logp.device))
        if log_ratio_clamp is not None:
            d = d.clamp(-log_ratio_clamp, log_ratio_clamp)
        return -d.sum() / max(int(m.sum()), 1)


def approx_kl_k1_clamped_naive(
    logp: TokenFloat, logp_old: TokenFloat, mask: ResponseMask, log_ratio_clamp: float | None
) -> float:
    """Naive twin of :func:`approx_kl_k1_clamped`, token by token in Python floats."""
    _check_clamp(log_ratio_clamp)
    total, n = 0.0, 0
    for prow, orow, mrow in zip(pf.rows(logp), pf.rows(logp_old), pf.mask_rows(mask), strict=True):
        for p, o, ok in zip(prow, orow, mrow, strict=True):
            if not ok:
                continue
            d = p - o
            if log_ratio_clamp is not None:
                d = min(max(d, -log_ratio_clamp), log_ratio_clamp)
            total += d
            n += 1
    return -total / max(n, 1)


__all__ = ["approx_kl_k1_clamped", "approx_kl_k1_clamped_naive"]
