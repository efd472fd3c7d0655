"""The trainer's public names, from their homes in the :mod:`refppo.train` package.

``from refppo.trainer import Trainer, TrainingError, run`` keeps working: the trainer itself is
:mod:`refppo.train.loop` (its numbered skeleton), its setup :mod:`refppo.train.setup`, its
checkpoints :mod:`refppo.train.checkpointing`, torchrun :mod:`refppo.train.dist`.
"""

from __future__ import annotations

from refppo.reward_fn import load_reward_function, resolve_reward_function, text_reward
from refppo.train.checkpointing import RESUMABLE_KEYS
from refppo.train.dist import SUMMED_OVER_RANKS, DistContext, init_distributed, shutdown_distributed
from refppo.train.loop import Trainer, run
from refppo.train.report import ROLLOUT_KEYS
from refppo.train.runtime import (
    SMALL_MODEL_PARAMS,
    TrainingError,
    context_length,
    peak_rss_mb,
    rank0_output,
    resolve_device,
    resolve_dtype,
    seed_everything,
    set_threads,
)
from refppo.train.setup import EMBEDDED_POLICIES, RULE_REWARD

__all__ = [
    "EMBEDDED_POLICIES",
    "RESUMABLE_KEYS",
    "ROLLOUT_KEYS",
    "RULE_REWARD",
    "SMALL_MODEL_PARAMS",
    "SUMMED_OVER_RANKS",
    "DistContext",
    "Trainer",
    "TrainingError",
    "context_length",
    "init_distributed",
    "load_reward_function",
    "peak_rss_mb",
    "rank0_output",
    "resolve_device",
    "resolve_dtype",
    "resolve_reward_function",
    "run",
    "seed_everything",
    "set_threads",
    "shutdown_distributed",
    "text_reward",
]
