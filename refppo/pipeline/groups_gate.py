"""The rejection gate of the rollout correction: a convention group of its own (``gate``) of
:class:`refppo.pipeline.settings.Convention`, read by the ``rollout_correction`` stage.

A gate keeps or rejects tokens (or whole rows) by a statistic of ``x_t = ±(l^prox_t − l^beh_t)``
(:func:`refppo.core.rollout_correction.rejection_mask`, spec/rollout-correction.md); the stage
multiplies its keep mask into the importance weight of ``rollout_is`` (1 when that is off)::

    w'_t = w^IS_t · keep_t          ℓ_t = w'_t·ℓ^PPO_t

A rejected token has weight 0 and still counts in the loss's normalisers (``Rejected.zero``): AReaL
1.0.4 ``rejection_sampling`` (``areal/utils/functional/functional.py``: the behaviour weight
``where(mask, ratio, 0)``, the loss divided by the original mask count) and OpenRLHF 0.11.2's
``is_correction_level: seq`` gate (``models/loss.py::PolicyLoss``: ``coef = ratio·seq_mask``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from refppo.errors import HyperparameterError
from refppo.pipeline.group_fields import _parse_enums, flat_key
from refppo.rollout_conventions import ISLevel, RSEffect, RSOrder, RSReduce, RSStat


@dataclass(frozen=True)
class RolloutGate:
    """A rejection gate on the policy surrogate (module docstring). Off by default (no key read)."""

    level: ISLevel | None = field(default=None, metadata=flat_key("rollout_rs", omit=True))
    """``token`` (each token by its own statistic), ``sequence`` (the row by the reduction of its
    tokens' statistics, kept or rejected whole), or none (off, the default)."""
    stat: RSStat = field(default=RSStat.RATIO, metadata=flat_key("rollout_rs_stat", omit=True))
    """The per-token statistic of ``x``: ``ratio`` ``e^x`` (reduced in log space), ``k1`` ``x``,
    ``k2`` ``x²/2``, ``k3`` ``e^{−x} − 1 + x`` (AReaL ``metric``: ratio, kl_k1, kl_k2, kl_k3)."""
    order: RSOrder = field(default=RSOrder.PROXIMAL, metadata=flat_key("rollout_rs_order", omit=True))
    """``proximal``: ``x = l^prox − l^beh`` (AReaL, OpenRLHF); ``behaviour``: ``x = l^beh − l^prox``
    (verl 0.9.1 ``rollout_rs``)."""
    reduce: RSReduce = field(default=RSReduce.MEAN, metadata=flat_key("rollout_rs_reduce", omit=True))
    """A sequence gate's reduction over the row's valid tokens: ``sum``, ``mean``, ``max`` (the veto;
    AReaL ``agg``, verl ``seq_sum_*``/``seq_mean_*``/``seq_max_*``). Read at ``rollout_rs=sequence``."""
    low: float | None = field(default=None, metadata=flat_key("rollout_rs_low", omit=True))
    """The closed band's lower bound of the (reduced) statistic, or none (AReaL ``lower``)."""
    high: float | None = field(default=None, metadata=flat_key("rollout_rs_high", omit=True))
    """The upper bound, or none (AReaL ``upper``, verl's threshold). Neither bound: the gate keeps
    every valid token (its band is the whole line)."""
    effect: RSEffect = field(default=RSEffect.WEIGHT, metadata=flat_key("rollout_rs_effect", omit=True))
    """``weight``: the keep mask multiplies the IS weight, rejected tokens still count (AReaL,
    OpenRLHF); ``drop_mask``: ``m' = m·keep`` is the response mask of every stage after the reward
    (verl 0.9.1; :data:`refppo.pipeline.correction.rollout_gate_stage`)."""

    def __post_init__(self) -> None:
        _parse_enums(self)
        for name, value in (("rollout_rs_low", self.low), ("rollout_rs_high", self.high)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise HyperparameterError(f"{name}: expected a finite number or none, got {value!r}")
            if self.stat is RSStat.RATIO and value < 0:
                raise HyperparameterError(f"{name}: expected a ratio bound >= 0, got {value!r}")
        if self.low is not None and self.high is not None and self.low > self.high:
            raise HyperparameterError(
                f"rollout_rs_low, rollout_rs_high: expected low <= high, got {self.low!r} > {self.high!r}"
            )

    @property
    def on(self) -> bool:
        """A gate is applied (``rollout_rs`` is ``token`` or ``sequence``)."""
        return self.level is not None

    @property
    def drops(self) -> bool:
        """The gate is on and its kept tokens replace the response mask (``drop_mask``)."""
        return self.level is not None and self.effect is RSEffect.DROP_MASK


__all__ = ["RolloutGate"]
