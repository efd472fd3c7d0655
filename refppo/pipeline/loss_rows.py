"""Rows masked out of the loss (``truncated_rows``, :class:`refppo.agg_conventions.TruncatedRows`): the
update walk on the rows in the loss, with the step's normalisers of the whole batch.

Under ``mask_in_loss`` a row flagged ``truncated`` [B] adds nothing to any token sum or token count
of the loss terms (policy, value, entropy, KL) and of their statistics (clip fractions, approx_kl),
and 1 to the row count ``N_seq = B``; under ``drop`` it adds nothing to ``N_seq`` either. Every
aggregation is a sum of per-row terms over a normaliser (:mod:`refppo.core.aggregate`), so the walk
on the rows in the loss with ``token_count`` = their tokens and ``seq_count`` = ``B``
(``mask_in_loss``) is that loss exactly: ``Σ_{b∈in} Σ_t w_bt·ℓ_bt`` with the weights of
:func:`refppo.core.masked.kept_rows_aggregate` (the property tests compare the two). The rollout
stages (rewards, group statistics, GAE, whitening) see every row (TRL 1.16.0 computes the rewards
and advantages before it zeroes the ``completion_mask``). Outputs ``[B, T]`` of the walk are
scattered back: 0 on the rows out of the loss (``ratio``: 1; gradients: 0, as the trainer's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from refppo.agg_conventions import TruncatedRows
from refppo.conventions import LossAgg
from refppo.core.checks import check_in_loss, count_true
from refppo.errors import ConventionError
from refppo.pipeline.blocks import Normalisers
from refppo.pipeline.settings import Convention


def rows_in_loss(q: Mapping[str, Any], conv: Convention) -> Tensor | None:
    """``[B]`` bool, True on the rows in the loss; None when every row is (``truncated_rows=keep``, or
    no row flagged). Refuses ``mask_in_loss``/``drop`` without ``truncated`` and a batch with no row
    left, each with one line naming the key."""
    mode = conv.agg.truncated_rows
    if mode is TruncatedRows.KEEP:
        return None
    prompt_mean = [
        k
        for k, a in (("loss_agg", conv.agg.loss), ("entropy_agg", conv.agg.entropy))
        if a is LossAgg.PROMPT_MEAN
    ]
    if prompt_mean:
        raise ConventionError(
            f"truncated_rows={mode} with {prompt_mean[0]}=prompt-mean: no trainer combines them and the "
            "prompt token counts over the rows in the loss are not defined here (set one of them differently)"
        )
    flags = q.get("truncated")
    mask: Tensor = q["mask"]
    if flags is None:
        raise ConventionError(
            f"truncated: truncated_rows={mode} reads the [B] `truncated` flags (1 = no EOS: out of the "
            "loss); the dump has none (add them, or set truncated_rows=keep)"
        )
    keep = ~check_in_loss("truncated", flags.to(mask.device), int(mask.shape[0]), mask.device)
    if bool(keep.all()):
        return None
    if not bool(keep.any()):
        raise ConventionError(
            f"truncated: every row is flagged; truncated_rows={mode} leaves no row in the loss "
            "(the trainer's loss is 0, nothing to check)"
        )
    return keep


def select_rows(
    q: Mapping[str, Any], keep: Tensor, conv: Convention, norm: Normalisers
) -> tuple[dict[str, Any], Normalisers]:
    """``q`` restricted to the rows in the loss, and the normalisers of the whole batch (those of
    ``norm`` given by a split step's caller are kept: they must count the tokens in the loss)."""
    B = int(keep.shape[0])
    idx = keep.nonzero().flatten()
    sub = {
        k: v[idx] if isinstance(v, Tensor) and v.dim() >= 1 and int(v.shape[0]) == B else v
        for k, v in q.items()
    }
    tc = norm.token_count if norm.token_count is not None else float(count_true(sub["mask"]))
    vtc = norm.value_token_count
    if vtc is None and sub.get("value_mask") is not None:
        vtc = float(count_true(sub["value_mask"]))
    sc = norm.seq_count
    if sc is None and conv.agg.truncated_rows is TruncatedRows.MASK_IN_LOSS:
        sc = float(B)
    return sub, replace(norm, token_count=tc, seq_count=sc, value_token_count=vtc)


def scatter_rows(x: Tensor, keep: Tensor, fill: float = 0.0) -> Tensor:
    """``x`` ``[B_in, T]`` on the rows in the loss, as ``[B, T]`` with ``fill`` on the others."""
    out = torch.full((int(keep.shape[0]), *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
    out[keep] = x
    return out


__all__ = ["rows_in_loss", "scatter_rows", "select_rows"]
