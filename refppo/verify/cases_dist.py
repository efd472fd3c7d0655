"""The verify case of the distributed (``all_reduce``) paths: the batch split over two simulated
ranks (:func:`refppo.verify.ranks.run_ranks`), each rank's result against the naive twin on the
whole batch. Covers ``masked_moments``/``masked_var``/``masked_whiten``, ``normalize`` (every kind,
``eps_at``) and the batch statistics of ``group_advantages``/``group_scalar_advantages`` (``gpg``,
``flash-reinforce``, ``grpo`` at ``std_level`` ``batch``/``batch-centred``; groups never split).

Vectorised functions are looked up on their module at call time (so a test can monkeypatch one).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from refppo.conventions import AdvantageEstimator, WhitenEps, Whitening
from refppo.core import group_naive, helpers_naive
from refppo.core.masked import AllReduce
from refppo.group_conventions import GroupStdLevel
from refppo.verify.batches import Batch, Case, Pair
from refppo.verify.cases_adv import _distinct_scores, _groups
from refppo.verify.ranks import run_ranks

group_mod = importlib.import_module("refppo.core.group")
masked_mod = importlib.import_module("refppo.core.masked")
normalize_mod = importlib.import_module("refppo.core.normalize")

E = AdvantageEstimator
Shards = list[Tensor]
"""The row indices ``[B_r]`` of each rank."""


def _on_ranks(
    fn: Callable[..., Any], rows: tuple[Tensor | None, ...], kw: dict[str, Any], shards: Shards
) -> list[Any]:
    """``fn(*(a[rows of rank r] for a in rows), **kw, all_reduce=…)`` on every rank (None stays None)."""

    def call(r: int, ar: AllReduce) -> Any:
        return fn(*(a[shards[r]] if a is not None else None for a in rows), **kw, all_reduce=ar)

    return run_ranks(call, len(shards))


def _gathered(
    fn: Callable[..., Any], rows: tuple[Tensor | None, ...], kw: dict[str, Any], shards: Shards
) -> Tensor:
    """:func:`_on_ranks` with row outputs ``[B_r, …]``, put back in batch order ``[B, …]``."""
    parts: list[Tensor] = _on_ranks(fn, rows, kw, shards)
    B = sum(len(idx) for idx in shards)
    out = torch.empty((B, *parts[0].shape[1:]), dtype=parts[0].dtype, device=parts[0].device)
    for idx, part in zip(shards, parts, strict=True):
        out[idx.to(part.device)] = part
    return out


def _masked_pairs(b: Batch, dev: torch.device, shards: Shards) -> list[Pair]:
    x, m = b.floats(-3.0, 3.0), b.mask
    rows = (x.to(dev), m.to(dev))
    out: list[Pair] = []
    for unb in (True, False):
        var_n = masked_mod.masked_var_naive(x, m, unbiased=unb)
        for r, (mu, var) in enumerate(_on_ranks(masked_mod.masked_moments, rows, {"unbiased": unb}, shards)):
            out.append((f"masked_moments.mean(rank {r})", mu, masked_mod.masked_mean_naive(x, m), None))
            out.append((f"masked_moments.var(rank {r},unbiased={unb})", var, var_n, None))
        for r, var in enumerate(_on_ranks(masked_mod.masked_var, rows, {"unbiased": unb}, shards)):
            out.append((f"masked_var(rank {r},unbiased={unb})", var, var_n, None))
        for shift in (True, False):
            kw = {"shift_mean": shift, "unbiased": unb}
            vec = _gathered(masked_mod.masked_whiten, rows, kw, shards)
            out.append((f"masked_whiten({kw})", vec, masked_mod.masked_whiten_naive(x, m, **kw), None))
    for kind in Whitening:
        for at in WhitenEps:
            vec = _gathered(normalize_mod.normalize, rows, {"kind": kind, "eps_at": at}, shards)
            nv = normalize_mod.normalize_naive(x, m, kind, eps_at=at)
            out.append((f"normalize({kind.value},{at.value})", vec, nv, None))
    return out


def _group_pairs(b: Batch, dev: torch.device) -> list[Pair]:
    s, g, m = _distinct_scores(b), _groups(b, False), b.mask
    ids = torch.unique(g)
    if len(ids) < 2:
        return []  # one group: it cannot be split over two ranks (groups stay on one rank)
    rank0 = torch.isin(g, ids[: len(ids) // 2])
    shards = [torch.nonzero(rank0).flatten(), torch.nonzero(~rank0).flatten()]
    cfgs = [
        (E.GPG, GroupStdLevel.GROUP),
        (E.FLASH_REINFORCE, GroupStdLevel.GROUP),
        (E.GRPO, GroupStdLevel.BATCH),
        (E.GRPO, GroupStdLevel.BATCH_CENTRED),
        (E.GRPO_PASSK, GroupStdLevel.BATCH),
    ]
    out: list[Pair] = []
    for est, level in cfgs:
        gi = None if est is E.FLASH_REINFORCE else g
        gid = gi.to(dev) if gi is not None else None
        kw: dict[str, Any] = {"estimator": est, "std_level": level}
        tag = f"({est.value},{level.value})"
        vec = _gathered(group_mod.group_advantages, (s.to(dev), gid, m.to(dev)), kw, shards)
        out.append((f"group_advantages{tag}", vec, group_naive.group_advantages_naive(s, gi, m, **kw), None))
        vec = _gathered(group_mod.group_scalar_advantages, (s.to(dev), gid), kw, shards)
        nv = helpers_naive.group_scalar_advantages_naive(s, gi, **kw)
        out.append((f"group_scalar_advantages{tag}", vec, torch.tensor(nv, dtype=torch.float64), None))
    return out


def _case_all_reduce(b: Batch, dev: torch.device) -> list[Pair]:
    B, _ = b.shape
    perm = torch.randperm(B, generator=b.gen)
    k = B // 2  # B >= 2: both ranks hold at least one row
    shards = [perm[:k].sort().values, perm[k:].sort().values]
    return _masked_pairs(b, dev, shards) + _group_pairs(b, dev)


DIST_CASES: dict[str, Case] = {"all_reduce_2_ranks": _case_all_reduce}
"""The distributed paths' case (after the losses in table order)."""
