"""Aggregation conventions beside :class:`refppo.conventions.LossAgg`: the modes the per-term core
functions take (:data:`MASK_AGGS`), which tokens a logged clip fraction counts (:class:`ClipFracCounts`)
and how it averages them (:class:`ClipfracAgg`), and which rows the loss counts (:class:`TruncatedRows`;
the core step is :func:`refppo.core.masked.kept_rows_aggregate`, the walk :mod:`refppo.pipeline.row_subset`).

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
    the mean over rows (oat-llm 0.2.4 ``PPOLearner.learning_step``;
    :func:`refppo.core.clipfrac.clipfrac_row_mean`)."""

    TOKEN_MEAN = "token-mean"
    ROW_MEAN = "row-mean"


class ClipFracCounts(StrEnum):
    """Which clipped tokens the logged clip fraction ``pg_clipfrac`` counts, always over every valid
    token (:func:`refppo.core.clipfrac.clip_fraction`).

    - ``all``: every valid token the policy term clips (the clipped surrogate's ``L2 > L1``;
      CISPO's ``ρ`` outside ``[1−ε_low, 1+ε_high]``; verl 0.9.1, SkyRL-train 0.3.1; default);
    - ``kept``: those the rollout correction keeps (``w'_t ≠ 0``): AReaL 1.0.4
      ``areal/utils/functional/functional.py::ppo_actor_loss_fn`` (``clip_mask.logical_and_(loss_mask)``
      after ``apply_rejection_sampling`` narrowed ``loss_mask``; logged as ``clip_ratio`` over
      ``n_valid_tokens`` by ``areal/trainer/ppo/actor.py``). Without a correction: ``all``;
    - ``by_advantage``: a token counts when its weight is clipped on the side its advantage would
      clip a PPO surrogate, ``(ρ > 1+ε_high ∧ A > 0) ∨ (ρ < 1−ε_low ∧ A < 0)``: TRL 1.16.0
      ``GRPOTrainer._compute_loss`` ``cispo_clip_ratio`` (``(coef_1 > epsilon_high) & (advantages >
      0)``, no lower bound). The clipped surrogate's ``L2 > L1`` is already so: ``all`` there.
    """

    ALL = "all"
    KEPT = "kept"
    BY_ADVANTAGE = "by_advantage"


class TruncatedRows(StrEnum):
    """What the loss does with the rows flagged ``truncated`` [B] (cut at the generation limit, no
    EOS). Every rollout stage (rewards, group statistics, GAE, whitening) sees them either way.

    - ``keep``: in the loss like every row (default; verl, OpenRLHF, SkyRL, TRL's default);
    - ``mask_in_loss``: masked out of the loss (out of every token sum and token count, the loss
      terms' and their statistics') but kept in the row count ``N_seq``: TRL 1.16.0
      ``GRPOConfig.mask_truncated_completions=True``
      (``trl/trainer/grpo_trainer.py::GRPOTrainer._generate_and_score_completions`` zeroes the
      ``completion_mask`` of those rows after the rewards; ``_compute_loss`` then divides by ``B``
      (``grpo``, ``dr_grpo``) or by the masked token count (``bnpo``, ``dapo``));
    - ``drop``: masked out of the loss and out of the row count (the rows filtered away after the
      advantages: ``N_seq`` = the rows left).
    """

    KEEP = "keep"
    MASK_IN_LOSS = "mask_in_loss"
    DROP = "drop"


__all__ = ["MASK_AGGS", "ClipFracCounts", "ClipfracAgg", "TruncatedRows"]
