"""Batch statistics of :mod:`refppo.core.group` (its private helpers, split off for size): the
all-reduced batch sums, the std ``σ`` of ``grpo`` at each ``std_level``, and ``grpo-passk``'s margin.
Equations: :mod:`refppo.core.group`'s module docstring.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from refppo.core.masked import AllReduce
from refppo.group_conventions import GroupStdLevel


def batch_stats(x: Tensor, all_reduce: AllReduce | None) -> Tensor:
    """``x`` (a few batch sums) summed over every rank: this process's when ``all_reduce`` is None."""
    return x if all_reduce is None else all_reduce(x.clone())


def group_sigma(
    s: Tensor, mu: Tensor, inv: Tensor, level: GroupStdLevel, unbiased: bool, all_reduce: AllReduce | None
) -> Tensor:
    """The std ``[B]`` of each row at ``level``: ``σ_G`` (its group's, around ``μ_G``), ``σ_B`` (every
    score around the batch mean ``μ_B``) or ``σ_C`` (every ``s_j − μ_G(j)`` around 0); divisor ``n − 1``
    (``unbiased``, at least 1) or ``n``. The batch levels' sums go through ``all_reduce``."""
    ones = torch.ones_like(s)
    if level is GroupStdLevel.GROUP:
        K = int(inv.max()) + 1
        n = torch.zeros(K, dtype=s.dtype, device=s.device).index_add(0, inv, ones)
        sq = torch.zeros(K, dtype=s.dtype, device=s.device).index_add(0, inv, (s - mu) ** 2)
        dof = torch.clamp(n - 1, min=1) if unbiased else n
        return torch.sqrt(sq / dof)[inv]
    if level is GroupStdLevel.BATCH:
        n_sum = batch_stats(torch.stack([ones.sum(), s.sum()]), all_reduce)
        c = s - n_sum[1] / n_sum[0]
    else:
        c = s - mu
    n_sq = batch_stats(torch.stack([ones.sum(), (c**2).sum()]), all_reduce)
    dof = torch.clamp(n_sq[0] - 1, min=1) if unbiased else n_sq[0]
    return torch.sqrt(n_sq[1] / dof).expand_as(s)


def passk_margin(s: Tensor, inv: Tensor, K: int, scale: Tensor | None, eps: float) -> Tensor:
    """``grpo-passk``: ``(s_max − s_2nd)/(σ_G + ε)`` (or unscaled) on the group's unique argmax, else 0."""
    neg_inf = torch.full((K,), -math.inf, dtype=s.dtype, device=s.device)
    top = neg_inf.scatter_reduce(0, inv, s, "amax")
    is_top = s == top[inv]
    n_top = torch.zeros(K, dtype=torch.long, device=s.device).index_add(0, inv, is_top.long())
    rest = torch.where(is_top, torch.full_like(s, -math.inf), s)
    second = neg_inf.scatter_reduce(0, inv, rest, "amax")
    second = torch.where(n_top >= 2, top, second)  # a tie for the best: the gap is 0
    gap = (top - second)[inv]
    if scale is not None:
        gap = gap / (scale + eps)
    return torch.where(is_top & (n_top[inv] == 1), gap, torch.zeros_like(s))
