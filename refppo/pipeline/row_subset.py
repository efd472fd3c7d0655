"""Rows that a stage's rewritten ``mask`` leaves empty, taken out of the rest of a walk.

The rejection gate under ``rollout_rs_effect=drop_mask`` (:func:`refppo.pipeline.correction.
rollout_gate_stage`) can reject every token of a row (always the whole row at sequence level). verl
0.9.1 then drops the row from every count: GAE gives it nothing to train on, the whitening moments
and the losses' token and sequence counts skip it (``agg_loss``: "exclude fully masked sequences"),
its gradient is 0. The core's steps need a valid token per row, so :func:`refppo.pipeline.stages.walk`
runs the stages after such a rewrite on the other rows (:func:`take_rows`) and scatters what they
make back (:func:`put_rows`): 0 (False) on an emptied row, the values of the kept rows unchanged.
The same values as the whole batch where the whole batch is defined: every stage after the gate
is per row or reduces over the (reduced) mask only. A group estimator's statistics (GRPO, RLOO)
are then over the kept rows of each group.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch import Tensor


def kept_rows(out: Mapping[str, Any]) -> Tensor | None:
    """The rows of ``out["mask"]`` with a valid token, bool ``[B]``, when some row has none; None
    when every row has one (nothing to take out)."""
    m = out.get("mask")
    if not isinstance(m, Tensor) or m.dim() != 2:
        return None
    rows = m.any(dim=1)
    return None if bool(rows.all()) else rows


def take_rows(q: Mapping[str, Any], rows: Tensor) -> dict[str, Any]:
    """``q`` with every tensor of ``B`` rows (its first dimension) cut to ``rows``; the rest as is."""
    B = rows.shape[0]
    return {
        k: v[rows] if isinstance(v, Tensor) and v.dim() >= 1 and v.shape[0] == B else v for k, v in q.items()
    }


def put_rows(out: dict[str, Any], sub: Mapping[str, Any], rows: Tensor, made: Collection[str]) -> None:
    """Write into ``out`` the quantities ``made`` of the row subset ``sub``: a tensor of the subset's
    rows scattered back to ``B`` rows (0 / False elsewhere, or ``out``'s own value where ``out``
    holds it with that shape: a mask rewritten again); anything else (a 0-dim loss) as is."""
    B, n = rows.shape[0], int(rows.sum())
    idx = rows.nonzero().flatten()
    for k in made:
        if k not in sub:
            continue
        v = sub[k]
        if not (isinstance(v, Tensor) and v.dim() >= 1 and v.shape[0] == n):
            out[k] = v
            continue
        base = out.get(k)
        if isinstance(base, Tensor) and base.shape == (B, *v.shape[1:]) and base.dtype == v.dtype:
            full = base.detach().clone()
        else:
            full = torch.zeros((B, *v.shape[1:]), dtype=v.dtype, device=v.device)
        out[k] = full.index_put((idx,), v)


__all__ = ["kept_rows", "put_rows", "take_rows"]
