"""Conventions of which rows the loss counts, as typed enums (issue #23 item 5; the core step is
:func:`refppo.core.masked.kept_rows_aggregate`, the walk :mod:`refppo.pipeline.loss_rows`).

A sibling of :mod:`refppo.conventions` (same layer), imported from here; ``parse`` is that module's.
"""

from __future__ import annotations

from enum import StrEnum


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


__all__ = ["TruncatedRows"]
