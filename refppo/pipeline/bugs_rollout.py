"""Known bugs of the rollout correction (spec/rollout-correction.md, "Bugs the diagnosis names"), as
variants of the stage table like :mod:`refppo.pipeline.bugs` (which registers them in its catalogue).

Symbols as :mod:`refppo.core.rollout_correction`: ``d_t = m_t·(l^prox_t − l^beh_t)``, ``w`` the raw
weight, ``[C_low, C_high]`` the bounds, ``keep`` the kept tokens, ``l`` the current log-probs.

============================ ================== ================================================
bug                          replaces           how
============================ ================== ================================================
is_sum_not_mean              rollout_correction ``log w_b = Σ_t d_t`` where the convention says
                                                ``(1/L_b)·Σ_t d_t`` (TRL #5814)
is_weight_not_detached       rollout_correction ``w = π_θ/π^beh`` from the live ``l``, left in the
                                                graph (verl PR #4105); seen in ``grad_logprobs``
truncate_mask_swapped        rollout_correction the other ``rollout_is_mode`` (truncate ↔ mask)
cap_on_log_ratio             rollout_correction the bounds applied to ``log w``: truncate
                                                ``exp(clamp(log w, C_low, C_high))``, mask
                                                ``keep = [C_low ≤ log w ≤ C_high]``
old_is_behaviour             update input       ``old_logprobs`` := ``rollout_logprobs`` (the ratio,
                                                its clip, ``approx_kl``; the weight becomes 1)
                                                (SkyRL #1315)
is_weight_against_current    rollout_correction ``w = π_θ/π^beh`` (detached): the current policy's
                                                log-probs, not the proximal ones (miles #1829)
nonfinite_through_mask       rollout_correction mask mode ``w' = w·keep`` multiplied, not selected:
                                                an overflowed ``w = inf`` outside the band gives
                                                ``inf·0 = NaN`` (prime-rl PR #2084)
============================ ================== ================================================

Each bug's ``requires`` refuses a convention it cannot act under (the correction off, a token-level
or product weight for the sum, no bound for the swap or the log cap, truncate mode for the
multiplied mask).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from refppo.core.rollout_correction import is_weights
from refppo.pipeline.blocks import Evaluation
from refppo.pipeline.bugs_base import Bug
from refppo.pipeline.correction import gate_keep, gate_masks, rollout_logprobs_of
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.rollout_conventions import ISAgg, ISLevel, ISMode

Q = Mapping[str, Any]


def _weights(
    num: Tensor, q: Q, conv: Convention, *, detach: bool = True, gate: bool = True, **over: Any
) -> dict[str, Tensor]:
    """The correction stage's outputs with numerator ``num`` (and ``over`` replacing the setting),
    the gate applied (``gate`` False: not)."""
    rc = conv.rollout
    kw: dict[str, Any] = {"level": rc.level, "agg": rc.agg, "mode": rc.mode, "low": rc.low, "high": rc.high}
    kw.update(over)
    w = is_weights(num, rollout_logprobs_of(q, conv), q["mask"], detach=detach, **kw)
    out = {"is_weights": w.weight, "is_keep": w.keep}
    return _gated(out, q, conv) if gate else out


def _gated(out: dict[str, Tensor], q: Q, conv: Convention) -> dict[str, Tensor]:
    """The gate of ``rollout_rs*`` applied to a (buggy) weight as the correct stage applies it:
    ``keep ← keep·gate``, ``w' ← 0`` off ``keep``; unchanged when the gate is off or drops its
    tokens from the mask instead (``rollout_rs_effect=drop_mask``); with the stage's masks."""
    masks = gate_masks(q, conv)
    if not conv.gate.on or conv.gate.drops:
        return {**out, **masks}
    keep = out["is_keep"] & gate_keep(q, conv)
    zero = torch.zeros((), dtype=out["is_weights"].dtype, device=keep.device)
    return {"is_weights": torch.where(keep, out["is_weights"], zero), "is_keep": keep, **masks}


def _sum_not_mean(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """The sequence weight of the row's summed log-ratio (``product``) where ``geometric`` is set."""
    return _weights(q["old_logprobs"], q, conv, agg=ISAgg.PRODUCT)


def _mode_swapped(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """The weight under the other mode: ``mask`` where ``truncate`` is set, and the converse."""
    other = ISMode.MASK if conv.rollout.mode is ISMode.TRUNCATE else ISMode.TRUNCATE
    return _weights(q["old_logprobs"], q, conv, mode=other)


def _against_current(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """``w = π_θ/π^beh`` from the current log-probs ``l`` (detached)."""
    return _weights(q["logprobs"], q, conv)


def _not_detached(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """``w = π_θ/π^beh`` from the live ``l``, not detached: ``∂w'/∂l = w'`` inside the band."""
    return _weights(q["logprobs"], q, conv, detach=False)


def _cap_on_log_ratio(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """The bounds applied to ``log w`` (token or sequence, as set) instead of ``w``::

    truncate:  w'_t = m_t·exp(clamp(log w_t, C_low, C_high))
    mask:      keep_t = m_t·[C_low ≤ log w_t ≤ C_high],  w'_t = w_t·keep_t
    """
    rc, m = conv.rollout, q["mask"]
    unbounded = _weights(q["old_logprobs"], q, conv, gate=False, mode=ISMode.TRUNCATE, low=None, high=None)
    raw = unbounded["is_weights"]
    zero = torch.zeros((), dtype=raw.dtype, device=raw.device)
    log_w = torch.where(m, torch.log(torch.where(m, raw, torch.ones_like(raw))), zero)
    if rc.mode is ISMode.TRUNCATE:
        w = torch.where(m, torch.exp(torch.clamp(log_w, min=rc.low, max=rc.high)), zero)
        return _gated({"is_weights": w, "is_keep": m}, q, conv)
    keep = m.clone()
    if rc.low is not None:
        keep &= log_w >= rc.low
    if rc.high is not None:
        keep &= log_w <= rc.high
    return _gated({"is_weights": torch.where(keep, raw, zero), "is_keep": keep}, q, conv)


def _mask_multiplied(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """Mask mode with the band multiplied in, ``w'_t = w_t·keep_t``: ``inf·0 = NaN`` where the raw
    weight overflowed outside the band (the correct step selects: ``w' = 0`` there)."""
    w = _weights(q["old_logprobs"], q, conv, mode=ISMode.MASK)
    raw = _weights(q["old_logprobs"], q, conv, gate=False, low=None, high=None)["is_weights"]  # no bound
    keep = w["is_keep"]  # already gated (_weights)
    return {"is_weights": raw * keep.to(raw.dtype), "is_keep": keep, **gate_masks(q, conv)}


_ON = "the rollout correction on (rollout_is=token or sequence)"


def _on(conv: Convention, hp: Hyperparams) -> str | None:
    return None if conv.rollout.on else _ON


def _geometric(conv: Convention, hp: Hyperparams) -> str | None:
    rc = conv.rollout
    ok = rc.level is ISLevel.SEQUENCE and rc.agg is ISAgg.GEOMETRIC
    return None if ok else "a geometric sequence weight (rollout_is=sequence, rollout_is_agg=geometric)"


def _bounded(conv: Convention, hp: Hyperparams) -> str | None:
    rc = conv.rollout
    ok = rc.on and (rc.low is not None or rc.high is not None)
    return None if ok else f"{_ON} with a bound (rollout_is_low or rollout_is_high)"


def _masking(conv: Convention, hp: Hyperparams) -> str | None:
    ok = conv.rollout.on and conv.rollout.mode is ISMode.MASK
    return None if ok else f"{_ON} in mask mode (rollout_is_mode=mask)"


RC = "rollout_correction"
ROLLOUT_BUGS: tuple[Bug, ...] = (
    Bug(
        "is_sum_not_mean",
        "the sequence-level importance weight sums the row's log-ratios instead of averaging them: "
        "log w = Σ_t (log π_old − log π_rollout), the product of the token weights, where the geometric "
        "mean (1/L)·Σ_t is set (TRL #5814)",
        stages={RC: _sum_not_mean}, phase="update", needs=("rollout_logprobs",), requires=_geometric,
    ),
    Bug(
        "is_weight_not_detached",
        "the importance weight π_θ/π_rollout is computed from the live log-probs and not detached: "
        "its gradient ∂w/∂log π_θ = w flows into grad_logprobs (verl PR #4105)",
        stages={RC: _not_detached}, phase="update", needs=("logprobs", "rollout_logprobs", "grad_logprobs"),
        requires=_on,
    ),
    Bug(
        "truncate_mask_swapped",
        "the importance weight is truncated where it should be masked, or masked where it should be "
        "truncated: clamp(w, C_low, C_high) and w·[C_low ≤ w ≤ C_high] swapped",
        stages={RC: _mode_swapped}, phase="update", needs=("rollout_logprobs",), requires=_bounded,
    ),
    Bug(
        "cap_on_log_ratio",
        "the importance weight's bounds are applied to the log-ratio instead of the ratio: "
        "exp(clamp(log w, C_low, C_high)) instead of clamp(w, C_low, C_high) (and the mask's band on "
        "log w)",
        stages={RC: _cap_on_log_ratio}, phase="update", needs=("rollout_logprobs",), requires=_bounded,
    ),
    Bug(
        "old_is_behaviour",
        "the update's old log-probs are the inference engine's (rollout_logprobs) instead of the "
        "trainer's recompute (old_logprobs): the ratio and its clip are taken against the behaviour "
        "policy and the correction weight is 1, so it cannot act (SkyRL #1315)",
        inputs={"old_logprobs": "rollout_logprobs"}, phase="update", needs=("logprobs", "rollout_logprobs"),
    ),
    Bug(
        "is_weight_against_current",
        "the importance weight is computed against the current policy, π_θ/π_rollout, instead of the "
        "proximal (old) one, π_old/π_rollout (radixark/miles #1829)",
        stages={RC: _against_current}, phase="update", needs=("logprobs", "rollout_logprobs"),
        requires=_on,
    ),
    Bug(
        "nonfinite_through_mask",
        "the importance-weight mask is multiplied in instead of selected: a weight that overflowed to "
        "inf outside the band gives inf·0 = NaN, which reaches the loss (prime-rl PR #2084)",
        stages={RC: _mask_multiplied}, phase="update", needs=("rollout_logprobs",), requires=_masking,
    ),
)  # fmt: skip
"""The rollout correction's known bugs, in the order the diagnosis tries them."""


__all__ = ["ROLLOUT_BUGS"]
