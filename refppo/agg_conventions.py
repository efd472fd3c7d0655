"""Aggregation conventions beside :class:`refppo.conventions.LossAgg`: the modes the per-term core
functions take (:data:`MASK_AGGS`), and how a logged clip fraction is averaged (:class:`ClipfracAgg`).

A sibling of :mod:`refppo.conventions` (same layer); ``parse`` is that module's.
"""

from __future__ import annotations

from enum import StrEnum

from refppo.conventions import LossAgg

MASK_AGGS: tuple[LossAgg, ...] = tuple(a for a in LossAgg if a is not LossAgg.PROMPT_MEAN)
"""The :class:`LossAgg` members that read the mask alone: the core's per-term functions (policy,
value, KL, entropy losses) take these; ``prompt-mean`` also reads the prompt of each row and is
aggregated by the pipeline (:func:`refppo.core.aggregate.prompt_mean_masked`), refused elsewhere in
one line."""


class ClipfracAgg(StrEnum):
    """How the logged policy clip fraction ``pg_clipfrac`` averages the clipped tokens
    (``c_t = [ℓ2_t > ℓ1_t]``, the clipped term wins strictly): ``token-mean`` ``Σ m c / Σ m`` (refppo,
    verl, OpenRLHF, TRL); ``row-mean`` ``(1/B) Σ_b (Σ_t m c / Σ_t m)``, each row's token mean, then
    the mean over rows (oat-llm 0.2.4 ``PPOLearner.learning_step``; :mod:`refppo.core.clipfrac_rows`)."""

    TOKEN_MEAN = "token-mean"
    ROW_MEAN = "row-mean"


__all__ = ["MASK_AGGS", "ClipfracAgg"]
