"""Re-exports :mod:`refppo.models.naive` (the per-prefix naive twins of the read-outs), its old path."""

from refppo.models.naive import (
    prefix_logits,
    prefix_value,
    response_logprobs_naive,
    response_values_naive,
    reward_scores_naive,
)

__all__ = [
    "prefix_logits",
    "prefix_value",
    "response_logprobs_naive",
    "response_values_naive",
    "reward_scores_naive",
]
