"""A walk on a subset of the rows, scattered back: the one mechanism for the rows a stage's rewritten
``mask`` leaves empty and for the rows out of the loss (``truncated_rows``).

:func:`take_rows` cuts every ``[B, …]`` quantity to the rows, :func:`put_rows` writes what the walk
on them made back to ``B`` rows (``fill`` on the others, or the caller's own value).

**Emptied rows** (:func:`kept_rows`). The rejection gate under ``rollout_rs_effect=drop_mask``
(:func:`refppo.pipeline.correction.rollout_gate_stage`) can reject every token of a row (always the
whole row at sequence level). verl 0.9.1 then drops the row from every count: GAE gives it nothing to
train on, the whitening moments and the losses' token and sequence counts skip it (``agg_loss``:
"exclude fully masked sequences"), its gradient is 0. The core's steps need a valid token per row, so
:func:`refppo.pipeline.stages.walk` runs the stages after such a rewrite on the other rows and
scatters what they make back: 0 (False) on an emptied row, the values of the kept rows unchanged.
The same values as the whole batch where the whole batch is defined: every stage after the gate is
per row or reduces over the (reduced) mask only. A group estimator's statistics (GRPO, RLOO, …) are
not: verl 0.9.1's ``compute_grpo_outcome_advantage`` (and its siblings) read every row's score
``token_level_rewards.sum(-1)`` (the rewards of the original mask) and multiply by the reduced mask
``m'``, so :func:`group_advantages_on_every_row` runs that stage on every row, with the masks before
the gate, times ``m'`` (``A'_bt = A_bt·m'_bt``), before the other rows walk on; ``opo`` (whose lengths
verl takes from ``m'``) keeps the reduced mask.

**Rows out of the loss** (:func:`rows_in_loss`, :func:`whole_normalisers`; ``truncated_rows``,
:class:`refppo.agg_conventions.TruncatedRows`). Under ``mask_in_loss`` a row flagged ``truncated``
[B] adds nothing to any token sum or token count of the loss terms (policy, value, entropy, KL) and
of their statistics (clip fractions, approx_kl), and 1 to the row count ``N_seq = B``; under
``drop`` it adds nothing to ``N_seq`` either. Every aggregation is a sum of per-row terms over a
normaliser (:mod:`refppo.core.aggregate`), so the update walk on the rows in the loss with
``token_count`` = their tokens and ``seq_count`` = ``B`` (``mask_in_loss``) is that loss exactly:
``Σ_{b∈in} Σ_t w_bt·ℓ_bt`` with the weights of :func:`refppo.core.masked.kept_rows_aggregate` (the
property tests compare the two). The rollout stages (rewards, group statistics, GAE, whitening) see
every row (TRL 1.16.0 computes the rewards and advantages before it zeroes the ``completion_mask``).
Outputs ``[B, T]`` of the walk come back 0 on the rows out of the loss (``ratio``: 1; gradients: 0,
as the trainer's).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from refppo.agg_conventions import TruncatedRows
from refppo.conventions import AdvantageEstimator, LossAgg
from refppo.core.checks import check_in_loss, count_true
from refppo.errors import ConventionError
from refppo.pipeline.blocks import Evaluation, Normalisers
from refppo.pipeline.naive_group import times_mask_naive
from refppo.pipeline.settings import Convention


def take_rows(q: Mapping[str, Any], rows: Tensor) -> dict[str, Any]:
    """``q`` with every tensor of ``B`` rows (its first dimension) cut to ``rows`` (bool ``[B]``);
    the rest as is."""
    B = rows.shape[0]
    return {
        k: v[rows] if isinstance(v, Tensor) and v.dim() >= 1 and v.shape[0] == B else v for k, v in q.items()
    }


def put_rows(
    out: dict[str, Any],
    sub: Mapping[str, Any],
    rows: Tensor,
    made: Collection[str],
    fill: Mapping[str, float] | None = None,
) -> None:
    """Write into ``out`` the quantities ``made`` of the row subset ``sub``: a tensor of the subset's
    rows scattered back to ``B`` rows (``fill[k]``, default 0 / False, elsewhere; or ``out``'s own
    value where ``out`` holds it with that shape: a mask rewritten again); anything else (a 0-dim
    loss) as is."""
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
            full = torch.full((B, *v.shape[1:]), (fill or {}).get(k, 0), dtype=v.dtype, device=v.device)
        out[k] = full.index_put((idx,), v)


def kept_rows(out: Mapping[str, Any]) -> Tensor | None:
    """The rows of ``out["mask"]`` with a valid token, bool ``[B]``, when some row has none; None
    when every row has one (nothing to take out)."""
    m = out.get("mask")
    if not isinstance(m, Tensor) or m.dim() != 2:
        return None
    rows = m.any(dim=1)
    return None if bool(rows.all()) else rows


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


def whole_normalisers(sub: Mapping[str, Any], B: int, conv: Convention, norm: Normalisers) -> Normalisers:
    """The normalisers of the whole batch of ``B`` rows for the walk on the rows in the loss ``sub``
    (:func:`take_rows`): ``norm``'s own where given (a split step's caller: they must count the
    tokens in the loss), else the tokens of ``sub`` and, under ``mask_in_loss``, ``N_seq = B``."""
    tc = norm.token_count if norm.token_count is not None else float(count_true(sub["mask"]))
    vtc = norm.value_token_count
    if vtc is None and sub.get("value_mask") is not None:
        vtc = float(count_true(sub["value_mask"]))
    sc = norm.seq_count
    if sc is None and conv.agg.truncated_rows is TruncatedRows.MASK_IN_LOSS:
        sc = float(B)
    return replace(norm, token_count=tc, seq_count=sc, value_token_count=vtc)


_OWN_MASK = (AdvantageEstimator.GAE, AdvantageEstimator.REINFORCE_PP, AdvantageEstimator.OPO)
"""The estimators that read the gate's mask ``m'`` (per row, or ``opo``'s lengths): not re-run."""


def group_advantages_on_every_row(
    rest: Sequence[Any],
    out: dict[str, Any],
    before: Mapping[str, Any],
    conv: Convention,
    hp: Any,
    ev: Evaluation | None,
    *,
    naive: bool,
) -> None:
    """Under ``rollout_rs_effect=drop_mask``, a group estimator's ``advantages`` stage of ``rest``
    (the stages after the gate) run on EVERY row with the masks ``before`` the gate (each row's score,
    group statistics over every row of the group), its ``[B, T]`` outputs times the gate's mask
    ``m' = out["mask"]``: ``A'_bt = A_bt·m'_bt`` (verl 0.9.1 ``compute_grpo_outcome_advantage``:
    ``scores = token_level_rewards.sum(-1)``, ``scores.unsqueeze(-1) * response_mask``); written into
    ``out``, so that the walk on the kept rows reuses them. Nothing otherwise (no gate that drops,
    GAE, ``reinforce++``, ``opo``, no such stage, or ``before`` empty: not after a rewrite)."""
    if not before or not conv.gate.drops or conv.adv.estimator in _OWN_MASK:
        return
    st = next((s for s in rest if s.name == "advantages"), None)
    if st is None or all(k in out for k in st.makes):
        return
    made = st.run({**out, **before}, conv, hp, ev, naive=naive)
    m2: Tensor = out["mask"]
    for k, v in made.items():
        if naive:
            out[k] = times_mask_naive(v, m2)
        else:
            out[k] = torch.where(m2, v, torch.zeros((), dtype=v.dtype, device=v.device))


__all__ = [
    "group_advantages_on_every_row",
    "kept_rows",
    "put_rows",
    "rows_in_loss",
    "take_rows",
    "whole_normalisers",
]
