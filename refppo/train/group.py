"""Group sampling for the critic-free estimators in the trainer (issue #13, item 5).

``rollout.group_size = G``: each rank draws ``P = batch_size / world_size / G`` prompts and
answers each one ``G`` times; row ``b`` of rank ``r`` answers prompt ``group_index[b]``::

    texts        = [x_0]*G + [x_1]*G + ... + [x_{P-1}]*G          (consecutive rows, one group each)
    group_index  = [r·P + 0]*G + [r·P + 1]*G + ... + [r·P + P-1]*G  (globally unique prompt ids)

Design (the simplest correct one): a group never straddles ranks. Every rank samples whole
groups, so the group statistics (μ_G, σ_G, the leave-one-out mean) computed on one rank are the
global ones, and only the batch-level whitening (REINFORCE++) needs the all-reduce the PPO
pipeline already does. :func:`check_groups_on_rank` asserts it before every update: it gathers
every rank's group ids and refuses an id seen on two ranks (GroupError, one line), so
``refppo.pipeline.step.rollout_quantities(groups_on_rank=True)`` is only ever told the truth.
(verl 0.9.1 computes the advantages once over the whole batch on its driver,
``ray_trainer.compute_advantage``, before the data-parallel split; refppo's ranks compute their
own rows' advantages, hence the invariant.)

Functions::

    expand_groups(texts, group_size, rank) -> (repeated texts, group_index [B] int64)
    check_groups_on_rank(group_index, world_size, device, refuse_one_row=...) -> None
                                                     (collective under torchrun)
"""

from __future__ import annotations

import torch
import torch.distributed as torch_dist
from torch import Tensor

from refppo.errors import RefPPOError


class GroupError(RefPPOError):
    """A group of responses split over ranks, or a malformed group layout."""


def expand_groups(texts: list[str], group_size: int, rank: int = 0) -> tuple[list[str], Tensor]:
    """Each prompt of ``texts`` (``P`` of them, this rank's) repeated ``group_size`` times in
    consecutive rows, and ``group_index`` ``[P·G]`` = ``rank·P + i`` for the rows of prompt ``i``
    (unique over ranks, since every rank draws the same ``P``)."""
    if group_size < 1:
        raise GroupError(f"rollout.group_size: expected >= 1, got {group_size}")
    p = len(texts)
    rows = [t for t in texts for _ in range(group_size)]
    index = torch.arange(p, dtype=torch.int64).repeat_interleave(group_size) + rank * p
    return rows, index


def check_groups_on_rank(
    group_index: Tensor, world_size: int, device: torch.device, *, refuse_one_row: bool = False
) -> None:
    """Every group id of this rank appears on no other rank (all ranks call it: an all-gather);
    with ``refuse_one_row`` (a group estimator under ``ppo.group_singleton=error``) no group has
    a single row either.

    One process: nothing to check. Else the ids are gathered (all ranks hold the same number of
    rows, :meth:`refppo.train.config.schema.TrainConfig.check_world_size`) and an id on two ranks raises.
    Every
    rank reads the same gathered ids, so every rank raises the same :class:`GroupError` here,
    before the update's collectives: the core's own singleton refusal
    (:class:`refppo.errors.SingletonGroupError`, raised on the rank holding the group only, before
    ``gpg``'s and the batch σ's all-reduce) would leave the other ranks waiting in that all-reduce.
    (It cannot happen with refppo's sampling, :func:`expand_groups`: every group has exactly
    ``rollout.group_size`` ≥ 2 rows; this makes a future non-uniform layout fail, not hang.)"""
    if world_size <= 1:
        return
    local = group_index.to(device=device, dtype=torch.int64)
    parts = [torch.empty_like(local) for _ in range(world_size)]
    torch_dist.all_gather(parts, local)
    owner: dict[int, int] = {}
    rows: dict[int, int] = {}
    for r, part in enumerate(parts):
        ids = part.tolist()
        for gid in set(ids):
            if gid in owner and owner[gid] != r:
                raise GroupError(
                    f"group {gid} has rows on ranks {owner[gid]} and {r}: a group's responses must sit "
                    "on one rank (its statistics are computed per rank)"
                )
            owner[gid] = r
            rows[gid] = ids.count(gid)
    single = sorted(gid for gid, n in rows.items() if n == 1)
    if refuse_one_row and single:
        raise GroupError(
            f"groups {single[:8]} have one response (group {single[0]} on rank {owner[single[0]]}) under "
            "ppo.group_singleton=error: refused on every rank before the update (set "
            "ppo.group_singleton=score or zero)"
        )


__all__ = ["GroupError", "check_groups_on_rank", "expand_groups"]
