"""The trainer under torchrun: this process's rank, the all-reduce hook, metrics over ranks.

Without torchrun (``WORLD_SIZE`` unset or 1) every function here is a no-op or the identity:
:class:`DistContext` is ``rank 0 of 1``. With it, ranks join one gloo (CPU) or NCCL (CUDA)
process group; each iteration's update metrics are averaged over ranks except
:data:`SUMMED_OVER_RANKS` (per-rank shares of a global value, summed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist
from torch import Tensor

from refppo.core.masked import AllReduce

SUMMED_OVER_RANKS = ("loss", "pg_loss", "vf_loss", "entropy", "kl_loss")
"""Update metrics that are per-rank shares of a global value (global normalisers): summed over ranks."""


@dataclass(frozen=True)
class DistContext:
    """This process's place in a (torchrun) job; ``world_size == 1`` without torchrun."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0 writes logs, plots and weights."""
        return self.rank == 0

    def all_reduce(self) -> AllReduce | None:
        """SUM all-reduce hook for :func:`refppo.train.iteration.iteration` (None on one process): global loss
        normalisers in the update and global advantage-whitening moments (μ, σ² over every rank's
        rows, as verl), so a torchrun step equals one process on the concatenated batch."""
        if self.world_size == 1:
            return None

        def reduce(t: Tensor) -> Tensor:
            torch_dist.all_reduce(t)
            return t

        return reduce

    def barrier(self) -> None:
        """Wait for every rank (no-op on one process)."""
        if self.world_size > 1:
            torch_dist.barrier()


def init_distributed(device: str) -> DistContext:
    """Join the torchrun job described by ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (gloo on CPU,
    NCCL on CUDA); a plain process gets ``DistContext()``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not torch_dist.is_initialized():
        use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        torch_dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return DistContext(rank, world, local)


def shutdown_distributed(d: DistContext) -> None:
    """Leave the torchrun job after this rank finished training (no-op on one process).

    ``barrier()`` first, so no rank closes its gloo/NCCL connections while a peer is still in a
    collective or writing its checkpoint/plot; then ``destroy_process_group()``. Called on
    success only (as torchtitan's ``train.py`` main, pytorch/torchtitan#1342): after an error
    the other ranks may be blocked in a collective this rank will never join, so a barrier or a
    destroy could hang until the backend timeout; the error propagates and torchrun stops them."""
    if d.world_size > 1 and torch_dist.is_initialized():
        torch_dist.barrier()
        torch_dist.destroy_process_group()


def reduce_metrics(d: DistContext, metrics: dict[str, float], device: torch.device) -> dict[str, float]:
    """Metrics over every rank (collective): the mean, or the sum for :data:`SUMMED_OVER_RANKS`;
    a copy on one process."""
    if d.world_size == 1:
        return dict(metrics)
    keys = sorted(metrics)
    t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=device)
    torch_dist.all_reduce(t)
    W = d.world_size
    return {
        k: float(v) if k in SUMMED_OVER_RANKS else float(v) / W for k, v in zip(keys, t.tolist(), strict=True)
    }


def mean_over_ranks(d: DistContext, x: float, device: torch.device) -> float:
    """The mean of ``x`` over every rank (collective); ``x`` on one process."""
    if d.world_size == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device)
    torch_dist.all_reduce(t)
    return float(t) / d.world_size


__all__ = [
    "SUMMED_OVER_RANKS",
    "DistContext",
    "init_distributed",
    "mean_over_ranks",
    "reduce_metrics",
    "shutdown_distributed",
]
