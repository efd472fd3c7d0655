"""Padding and cross-rank gathering of a recorder's rows (no pickling: tensor collectives only).

Every rank holds ``B_r`` rows of each key, ``[B_r, T_r]`` (token keys) or ``[B_r]`` (row keys).
:func:`gather_rows` pads them to a common ``[B_max, T_max]`` with zeros, ``all_gather``\\ s the
padded tensors and the true sizes, and trims each rank's block back to its ``B_r`` rows before
concatenating in rank order: ``[Σ_r B_r, T_max]``. A padded position (beyond a row's own ``T_r``)
holds 0, and so does its ``response_mask``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

Collective = Callable[[list[Tensor], Tensor], None]
"""``all_gather(out_list, tensor)`` (``torch.distributed.all_gather``)."""


def pad_to(t: Tensor, rows: int, cols: int | None) -> Tensor:
    """``t`` zero-padded on the right to ``[rows, cols]`` (``[rows]`` when ``cols`` is None)."""
    if t.shape[0] > rows or (cols is not None and t.shape[1] > cols):
        raise ValueError(f"cannot pad a tensor of shape {tuple(t.shape)} to {(rows, cols)}")
    shape = (rows,) if cols is None else (rows, cols)
    out = torch.zeros(shape, dtype=t.dtype, device=t.device)
    if cols is None:
        out[: t.shape[0]] = t
    else:
        out[: t.shape[0], : t.shape[1]] = t
    return out


def concat_padded(parts: Sequence[Tensor], token: bool) -> Tensor:
    """Concatenate micro-batch blocks along rows, padding token keys to the widest ``T``."""
    if not token:
        return torch.cat(list(parts), dim=0)
    width = max(int(p.shape[1]) for p in parts)
    return torch.cat([pad_to(p, int(p.shape[0]), width) for p in parts], dim=0)


def gather_ints(values: Sequence[int], world: int, all_gather: Collective) -> list[list[int]]:
    """Every rank's ``values`` (the same length on every rank), in rank order."""
    local = torch.tensor(list(values), dtype=torch.int64)
    out = [torch.zeros_like(local) for _ in range(world)]
    all_gather(out, local)
    return [[int(v) for v in o.tolist()] for o in out]


def gather_rows(t: Tensor, sizes: Sequence[Sequence[int]], all_gather: Collective) -> Tensor:
    """All ranks' rows of ``t`` (``[B_r]`` or ``[B_r, T_r]``), concatenated in rank order.

    ``sizes[r]`` is rank r's ``(B_r, T_r)``; ``T_r`` is ignored for a row key. Each rank pads to
    ``[max B_r, max T_r]`` so every ``all_gather`` buffer has one shape; the padding is trimmed off
    the rows again (the columns stay at ``max T_r``, zero-filled).
    """
    token = t.dim() == 2
    b_max = max(s[0] for s in sizes)
    t_max = max(s[1] for s in sizes) if token else None
    local = pad_to(t, b_max, t_max)
    out = [torch.zeros_like(local) for _ in sizes]
    all_gather(out, local)
    return torch.cat([o[: s[0]] for o, s in zip(out, sizes, strict=True)], dim=0)


def dist_rank_world() -> tuple[int, int]:
    """``(rank, world_size)`` from ``torch.distributed`` when initialised, else ``(0, 1)``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather_cpu(out: list[Tensor], t: Tensor) -> None:
    """``torch.distributed.all_gather`` on the backend's device (CUDA for NCCL), back to CPU."""
    import torch.distributed as dist

    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else t.device
    bufs = [o.to(dev) for o in out]
    dist.all_gather(bufs, t.to(dev))
    for o, b in zip(out, bufs, strict=True):
        o.copy_(b.cpu())


def hash_names(names: list[str]) -> int:
    """A stable 62-bit fingerprint of a list of key names (equal lists ⇔ equal on every rank)."""
    import hashlib

    digest = hashlib.sha256("\n".join(names).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 2


__all__ = [
    "Collective",
    "all_gather_cpu",
    "concat_padded",
    "dist_rank_world",
    "gather_ints",
    "gather_rows",
    "hash_names",
    "pad_to",
]
