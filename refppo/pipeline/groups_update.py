"""The update side's convention groups of :class:`refppo.pipeline.settings.Convention`: the policy
term (:class:`PolicyConvention`) and the aggregations (:class:`AggConvention`); the others are in
:mod:`refppo.pipeline.groups`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from refppo.agg_conventions import ClipfracAgg, ClipFracCounts, TruncatedRows
from refppo.conventions import ApproxKL, LossAgg, PolicyLoss
from refppo.core.checks import check_positive
from refppo.errors import ConventionError, HyperparameterError
from refppo.pipeline.group_fields import _parse_enums, flat_key


@dataclass(frozen=True)
class PolicyConvention:
    """The clipped surrogate's per-token terms (steps 5–6) and the logged ``approx_kl`` metric."""

    loss: PolicyLoss = field(default=PolicyLoss.VANILLA, metadata=flat_key("policy_loss", omit=True))
    """The policy surrogate: ``vanilla`` (the token ratio), ``gspo`` (GSPO's length-normalised sequence
    ratio, :mod:`refppo.core.gspo`; ``log_ratio_clamp`` the upper clamp of the log sequence ratio, verl:
    10) or ``cispo`` (the clipped detached weight times ``l``, :mod:`refppo.core.cispo`); the last two
    need ``dual_clip`` None."""
    dual_clip: float | None = field(default=None, metadata=flat_key())
    """Dual-clip constant c > 1 for negative advantages, or None (off)."""
    log_ratio_clamp: float | None = field(default=None, metadata=flat_key())
    """Clamp of ``logprobs − old_logprobs`` before exp in the ratio (verl, OpenRLHF: 20)."""
    approx_kl: ApproxKL = field(default=ApproxKL.K1, metadata=flat_key(omit=True, config=False))
    """Which ``approx_kl`` metric the trainer logs (:class:`refppo.conventions.ApproxKL`)."""
    clipfrac_agg: ClipfracAgg = field(
        default=ClipfracAgg.TOKEN_MEAN, metadata=flat_key(omit=True, config=False)
    )
    """How the logged ``pg_clipfrac`` averages the clipped tokens (:class:`refppo.conventions.ClipfracAgg`;
    ``row-mean``: ``policy_loss=vanilla`` only)."""
    clipfrac_counts: ClipFracCounts = field(
        default=ClipFracCounts.ALL, metadata=flat_key(omit=True, config=False)
    )
    """Which clipped tokens the logged ``pg_clipfrac`` counts
    (:class:`refppo.agg_conventions.ClipFracCounts`: AReaL's kept ones, TRL's CISPO side)."""

    def __post_init__(self) -> None:
        _parse_enums(self)
        # The core's own checks, at construction (a config error before any model is loaded):
        # dual-clip c finite and > 1 (policy.clipped_policy_loss), the ratio clamp.
        if self.dual_clip is not None and not (math.isfinite(self.dual_clip) and self.dual_clip > 1.0):
            raise HyperparameterError(f"dual_clip: expected c > 1 or None, got {self.dual_clip!r}")
        if self.log_ratio_clamp is not None:
            check_positive("log_ratio_clamp", self.log_ratio_clamp)
        if self.loss is not PolicyLoss.VANILLA and self.clipfrac_agg is ClipfracAgg.ROW_MEAN:
            raise ConventionError(
                f"clipfrac_agg=row-mean: policy_loss=vanilla only, got policy_loss={self.loss}"
            )
        if self.clipfrac_agg is ClipfracAgg.ROW_MEAN and self.clipfrac_counts is not ClipFracCounts.ALL:
            raise ConventionError(
                f"clipfrac_agg=row-mean with clipfrac_counts={self.clipfrac_counts}: no trainer logs both "
                "(oat counts every clipped token); set one of them to its default"
            )
        if self.loss is not PolicyLoss.VANILLA and self.dual_clip is not None:
            raise ConventionError(
                f"dual_clip: policy_loss={self.loss} has no dual-clip (verl compute_policy_loss_"
                f"{self.loss}), got dual_clip={self.dual_clip!r}; set dual_clip=none"
            )


@dataclass(frozen=True)
class AggConvention:
    """How each per-token loss becomes a scalar (:class:`refppo.conventions.LossAgg`)."""

    loss: LossAgg = field(default=LossAgg.TOKEN_MEAN, metadata=flat_key("loss_agg"))
    """Aggregation of the per-token policy, entropy and KL losses (and of the value loss unless
    ``value_loss_agg`` is set)."""
    value: LossAgg | None = field(default=None, metadata=flat_key("value_loss_agg", omit=True))
    """Aggregation of the value loss; None = same as ``loss_agg``. OpenRLHF's critic keeps the value
    loss ``token-mean`` whatever the actor's aggregation (its critic builds ``ValueLoss(value_clip)``).
    Read by ``advantage=gae`` only (the trainer refuses it off its default without a critic)."""
    kl: LossAgg | None = field(default=None, metadata=flat_key("kl_loss_agg", omit=True))
    """Aggregation of the KL loss (``kl_in=loss``); None = ``loss_agg``. SkyRL-train averages per row
    (``seq-mean-token-mean``) whatever its policy-loss reduction."""
    entropy: LossAgg | None = field(default=None, metadata=flat_key("entropy_agg", omit=True))
    """Aggregation of the entropy term; None = ``loss_agg``. SkyRL-train: ``token-mean`` always."""
    kl_metric: LossAgg | None = field(
        default=None, metadata=flat_key("kl_metric_agg", omit=True, config=False)
    )
    """Aggregation of the *logged* KL metric (the dumped ``kl_loss``, ``kl_in=loss``) when a trainer logs
    it unlike the KL term of its loss; None = the term's (``kl_loss_agg``, else ``loss_agg``). TRL
    GRPOTrainer 1.16.0 adds ``β·k3`` per token before its ``loss_type`` aggregation but logs ``kl`` as
    a token mean (``token-mean``). A logging convention: refppo's trainer logs the term."""
    truncated_rows: TruncatedRows = field(
        default=TruncatedRows.KEEP, metadata=flat_key("truncated_rows", omit=True, config=False)
    )
    """The rows flagged ``truncated`` in the loss (``keep``), masked out of it but kept in the row count
    (``mask_in_loss``: TRL ``mask_truncated_completions``) or out of both (``drop``);
    :class:`refppo.agg_conventions.TruncatedRows`, :mod:`refppo.pipeline.row_subset`."""

    def __post_init__(self) -> None:
        _parse_enums(self)
        for name in ("value", "kl", "kl_metric"):  # prompt-mean: the policy's and entropy's only
            if getattr(self, name) is LossAgg.PROMPT_MEAN:
                key = (
                    "value_loss_agg"
                    if name == "value"
                    else f"{name}_loss_agg"
                    if name == "kl"
                    else "kl_metric_agg"
                )
                raise ConventionError(
                    f"{key}=prompt-mean is not supported (the policy and entropy terms only)"
                )

    def of(self, term: str) -> LossAgg:
        """The aggregation of ``term`` (``policy``, ``value``, ``kl``, ``entropy`` or ``kl_metric``):
        its own override, else ``loss_agg`` (``kl_metric``: else the ``kl`` term's)."""
        own: LossAgg | None = None if term == "policy" else getattr(self, term)
        if own is None and term == "kl_metric":
            return self.of("kl")
        return self.loss if own is None else own


__all__ = ["AggConvention", "PolicyConvention"]
