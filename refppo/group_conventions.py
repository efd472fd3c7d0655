"""Conventions of the critic-free group estimators as typed enums (:mod:`refppo.core.group`).

A sibling of :mod:`refppo.conventions` (same layer); ``parse`` is that module's.
"""

from __future__ import annotations

from enum import StrEnum


class GroupSingleton(StrEnum):
    """What a group estimator does with a prompt that has one response (:mod:`refppo.core.group`).

    - ``error``: refuse (refppo default; OpenRLHF 0.11.2 ``cli/train_ppo_ray.py`` asserts
      ``n_samples_per_prompt > 1``);
    - ``score``: μ := 0, σ := 1, the advantage is the raw score (``s/(1+ε)`` for ``grpo``): verl
      0.9.1 ``compute_grpo_outcome_advantage``, ``compute_rloo_outcome_advantage``,
      ``compute_reinforce_plus_plus_baseline_outcome_advantage``; SkyRL-train 0.3.1 GRPO;
    - ``zero``: the advantage is 0 (verl ``compute_rloo_vectorized_outcome_advantage``, SkyRL-train
      ``compute_rloo_outcome_advantage``).
    """

    ERROR = "error"
    SCORE = "score"
    ZERO = "zero"


class GroupKL(StrEnum):
    """How the reward's ``−β·KL`` reaches a critic-free advantage (``advantage`` ≠ ``gae``).

    - ``fold``: into the score before grouping, ``s_i = Σ_t r_{i,t}`` over the token rewards (verl
      0.9.1 ``compute_grpo_outcome_advantage`` sums ``token_level_rewards``; SkyRL-train 0.3.1 the
      same; refppo default);
    - ``to_go``: after grouping, as the return-to-go of ``−β·KL_t`` added to every token
      (OpenRLHF 0.11.2 ``experience_maker.py::compute_advantages_and_returns``: ``compute_reward``
      then ``get_cumulative_returns``).

    ``reinforce++`` has no group: its discounted returns read the token rewards either way.
    """

    FOLD = "fold"
    TO_GO = "to_go"


class GroupStdLevel(StrEnum):
    """Over which rows the σ of ``grpo`` and ``grpo-passk`` is taken (the mean is always the group's,
    ``μ_G(i)``).

    - ``group``: ``σ_G`` of the row's group around ``μ_G`` (verl, OpenRLHF, SkyRL, TRL
      ``scale_rewards="group"``; refppo default);
    - ``batch``: every score of the batch around the batch mean, ``σ_B² = Σ_j (s_j − μ_B)²/(B−1)``
      (TRL 1.12.0/1.16.0 ``GRPOTrainer._generate_and_score_completions``, ``scale_rewards="batch"``:
      ``nanstd(rewards)``);
    - ``batch-centred``: the batch's centred scores around 0, ``σ² = Σ_j (s_j − μ_G(j))²/(B−1)``
      (AReaL 1.0.4 ``utils/data.py::Normalization`` with ``mean_level: group``, ``std_level: batch``:
      ``_compute_std`` reads ``x − mean`` with the per-row group mean).

    ``group_std`` still picks the divisor (``B−1`` or ``B``). Both batch levels are batch statistics,
    all-reduced across data-parallel ranks (:func:`refppo.core.group.group_scalar_advantages`).
    """

    GROUP = "group"
    BATCH = "batch"
    BATCH_CENTRED = "batch-centred"


__all__ = ["GroupKL", "GroupSingleton", "GroupStdLevel"]
