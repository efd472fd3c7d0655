"""``[seam]``: the rollout–trainer seam mode (spec/trainer.md "The seam mode").

Off by default. On, the rollout is made by
an *engine*: a copy of the policy with its own weights, in ``seam.dtype``, synced from the policy
``seam.staleness`` iterations old, whose log-probs of the sampled tokens (raw, or over the sampler's
top-k / top-p support: ``seam.logprobs``) are the behaviour log-probs ``rollout_logprobs`` that the
update reads under ``ppo.rollout_is*`` (the pipeline's ``rollout_correction`` stage).
"""

from __future__ import annotations

from dataclasses import dataclass

from refppo.train.config.sections import ConfigError

SEAM_DTYPES = ("float32", "bfloat16", "float16", "float64")
"""The engine's precisions (``seam.dtype``)."""
SEAM_LOGPROBS = ("raw", "processed")
"""What the engine reports (``seam.logprobs``; vLLM ``logprobs_mode`` ``raw_logprobs`` /
``processed_logprobs``)."""


@dataclass(frozen=True)
class SeamConfig:
    """The rollout–trainer seam: where the behaviour log-probs come from (off by default)."""

    enabled: bool = False
    """On: sample with a separate engine copy of the policy (``seam.dtype``, ``seam.staleness``)
    and hand the update its log-probs of the sampled tokens as ``rollout_logprobs`` (the behaviour
    policy; ``old_logprobs`` stay the trainer's recompute, the proximal policy). Its dumps carry
    ``rollout_logprobs`` and ``policy_version``. Off: the trainer samples with the policy itself."""
    dtype: str = "bfloat16"
    """The engine's weights and forward: ``float32``, ``bfloat16``, ``float16`` or ``float64``
    (the trainer keeps its own ``model.dtype``: bfloat16 sampling, float32 training)."""
    logprobs: str = "raw"
    """The engine's log-prob of a sampled token: ``raw`` (log softmax(z/τ) over the whole
    vocabulary) or ``processed`` (renormalised over the top-k / top-p support the sampler drew
    from, ``log p − log S``: needs ``rollout.top_p`` < 1 or ``rollout.top_k`` > 0)."""
    staleness: int = 0
    """k: the engine samples with the policy of k iterations ago (asynchronous by k; the initial
    policy while fewer than k have run); each row's ``policy_version`` is that iteration's number.
    The k snapshots are saved in every checkpoint."""
    staleness_min: int | None = None
    """j (0 ≤ j ≤ k) for mixed staleness within one batch, as an asynchronous trainer with partial
    rollouts has: row b of each rank's batch is sampled by the policy ``j + (b mod (k − j + 1))``
    iterations old (each row's ``policy_version`` recorded). None: every row is k iterations old."""

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"seam.enabled: expected true or false, got {self.enabled!r}")
        if self.dtype not in SEAM_DTYPES:
            raise ConfigError(f"seam.dtype: expected one of {list(SEAM_DTYPES)}, got {self.dtype!r}")
        if self.logprobs not in SEAM_LOGPROBS:
            raise ConfigError(f"seam.logprobs: expected one of {list(SEAM_LOGPROBS)}, got {self.logprobs!r}")
        if isinstance(self.staleness, bool) or not isinstance(self.staleness, int) or self.staleness < 0:
            raise ConfigError(f"seam.staleness: expected an integer >= 0, got {self.staleness!r}")
        j = self.staleness_min
        if j is not None and (isinstance(j, bool) or not isinstance(j, int) or not 0 <= j <= self.staleness):
            raise ConfigError(
                f"seam.staleness_min: expected none or an integer in [0, seam.staleness={self.staleness}], "
                f"got {j!r}"
            )

    def row_staleness(self, rows: int) -> list[int]:
        """The staleness of each of ``rows`` rows: ``j + (b mod (k − j + 1))``, or k for every row
        when ``staleness_min`` is None."""
        j = self.staleness if self.staleness_min is None else self.staleness_min
        return [j + b % (self.staleness - j + 1) for b in range(rows)]


__all__ = ["SEAM_DTYPES", "SEAM_LOGPROBS", "SeamConfig"]
