"""The process a run trains in: its error type, seeds, device, dtype, threads and memory.

Small helpers with no PPO in them, shared by the trainer's setup and loop::

    seed_everything(seed)                   python random, numpy, torch (CPU and CUDA)
    resolve_device(name, dist)              auto / cpu / cuda / cuda:N -> torch.device
    resolve_dtype(name, device)             auto -> bfloat16 on GPU, float32 on CPU
    set_threads(requested, model, device)   model.threads (0: one thread for a small CPU model)
    rank0_output(is_main)                   transformers' bars and logs on rank 0 only
    peak_rss_mb(), context_length(model), finite(x), params_finite(model), reward_errors_at(it)
"""

from __future__ import annotations

import contextlib
import math
import random
import resource
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from refppo.errors import RefPPOError
from refppo.train.dist import DistContext
from refppo.train.reward_fn import RewardFunctionError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
"""A config's dtype name → torch dtype (``model.dtype`` but ``auto``, ``seam.dtype``; each config
section checks which names it allows)."""
SMALL_MODEL_PARAMS = 50_000_000
"""Below this many policy parameters ``model.threads=0`` (auto) uses ONE intra-op thread on CPU
(measured in benchmarks/bench_train.py --threads; see :func:`set_threads`)."""


class TrainingError(RefPPOError):
    """A run that cannot go on correctly (bad model/tokenizer/prompt, non-finite loss, ...)."""


def seed_everything(seed: int) -> None:
    """Seed python ``random``, numpy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_device(name: str, dist: DistContext) -> torch.device:
    """``auto``/``cpu``/``cuda``/``cuda:N`` → a device (under torchrun, ``cuda`` is the local rank's GPU)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise TrainingError(f"model.device={name!r} but CUDA is not available (use --device cpu)")
        if name == "cuda":
            name = f"cuda:{dist.local_rank}"
        torch.cuda.set_device(torch.device(name))
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` → bfloat16 on GPU, float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MB (``getrusage``; KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def context_length(model: nn.Module) -> int | None:
    """The model's maximum sequence length from its config (None if unknown)."""
    cfg = getattr(model, "config", None)
    for attr in ("n_positions", "max_position_embeddings"):
        v = getattr(cfg, attr, None)
        if isinstance(v, int):
            return v
    return None


@contextlib.contextmanager
def reward_errors_at(it: int) -> Iterator[None]:
    """Prefix a reward function's error with the iteration (1-based) it happened in."""
    try:
        yield
    except RewardFunctionError as e:
        raise RewardFunctionError(f"iteration {it + 1}: {e}") from e.__cause__


@contextlib.contextmanager
def rank0_output(is_main: bool) -> Iterator[None]:
    """transformers' progress bars and info/warning logs silenced on every rank but 0 (under
    torchrun each rank loads the same model: one "Loading weights" bar is enough); errors still
    print. No-op on the main rank."""
    if is_main:
        yield
        return
    from transformers.utils import logging as hf_logging_module

    hf_logging: Any = hf_logging_module  # untyped module: its functions are called through Any

    bars, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def set_threads(requested: int, model: nn.Module, device: torch.device) -> int:
    """Apply ``model.threads`` (see its docstring) and return the intra-op thread count in use.

    ``requested > 0``: exactly that. ``0`` (auto): one thread on CPU for a policy below
    :data:`SMALL_MODEL_PARAMS` parameters, else torch's default; on GPU torch's default."""
    if requested > 0:
        torch.set_num_threads(requested)
    elif device.type == "cpu" and sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMS:
        torch.set_num_threads(1)
    return torch.get_num_threads()


def finite(x: float) -> bool:
    """``x`` is a finite float (a metric that is not a float counts as non-finite)."""
    return isinstance(x, float) and math.isfinite(x)


def params_finite(m: nn.Module) -> bool:
    """Every parameter of ``m`` is finite."""
    return all(bool(torch.isfinite(p).all()) for p in m.parameters())


__all__ = [
    "DTYPES",
    "SMALL_MODEL_PARAMS",
    "TrainingError",
    "context_length",
    "finite",
    "params_finite",
    "peak_rss_mb",
    "rank0_output",
    "resolve_device",
    "resolve_dtype",
    "reward_errors_at",
    "seed_everything",
    "set_threads",
]
