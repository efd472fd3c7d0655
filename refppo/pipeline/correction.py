"""The rollout correction stage (:mod:`refppo.pipeline.update`'s first, per (micro-)batch): the
importance weight of ``rollout_is*`` (:func:`refppo.core.rollout_correction.is_weights`) times the
keep mask of the gate ``rollout_rs*`` (:func:`refppo.core.rollout_correction.rejection_mask`)::

    rollout_correction_stage old_logprobs, rollout_logprobs, mask -> is_weights, is_keep  (off: None)

``w'_t = w^IS_t·keep_t`` (``w^IS`` = 1 on valid tokens without ``rollout_is``); a rejected token has
weight 0 and still counts in the normalisers (spec/rollout-correction.md). Under
``rollout_rs_effect=drop_mask`` (verl 0.9.1) the gate does not touch the weight: its kept tokens
replace the response mask, ``m' = m·keep``, ``value_mask' = value_mask·keep``, for every stage after
it: :func:`rollout_gate_stage` in the rollout phase (before GAE; the KL and the token rewards read
the original mask, as verl's ``apply_kl_penalty`` runs before ``compute_rollout_correction_and_add_
to_batch``) and the rollout correction stage again in the update phase (its IS weight from the
original mask, as verl's ``compute_rollout_correction_weights``). The gate is idempotent
(``keep(m') = keep(m)`` on ``m'``), so a walk that re-runs it changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from refppo.conventions import AdvantageEstimator
from refppo.core.checks import check_mask
from refppo.core.rollout_correction import (
    gate_statistic,
    is_weights,
    is_weights_naive,
    rejection_mask,
    rejection_mask_naive,
)
from refppo.errors import ConventionError, DumpError, MaskError
from refppo.pipeline.blocks import Evaluation
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.rollout_conventions import ISLevel

Q = Mapping[str, Any]


RC_KEYS = ("rollout_is", "rollout_is_agg", "rollout_is_mode", "rollout_is_low", "rollout_is_high")
"""The rollout correction stage's weight keys (:class:`refppo.pipeline.groups.RolloutCorrection`)."""
RS_KEYS = ("rollout_rs", "rollout_rs_stat", "rollout_rs_order", "rollout_rs_reduce", "rollout_rs_low",
           "rollout_rs_high", "rollout_rs_effect")  # fmt: skip
"""Its gate keys (:class:`refppo.pipeline.groups_gate.RolloutGate`)."""


def rollout_correction_reads(conv: Convention) -> tuple[str, ...]:
    """The keys the rollout correction reads under ``conv``: ``rollout_is`` alone when it is off,
    ``rollout_is_agg`` at sequence level only; ``rollout_rs`` alone when the gate is off,
    ``rollout_rs_reduce`` at sequence level only."""
    rc, gate = conv.rollout, conv.gate
    out: tuple[str, ...] = ("rollout_is",)
    if rc.level is not None:
        agg = ("rollout_is_agg",) if rc.level is ISLevel.SEQUENCE else ()
        out = ("rollout_is", *agg, "rollout_is_mode", "rollout_is_low", "rollout_is_high")
    if gate.level is None:
        return (*out, "rollout_rs")
    return (*out, *_gate_reads(conv))


def _gate_reads(conv: Convention) -> tuple[str, ...]:
    red = ("rollout_rs_reduce",) if conv.gate.level is ISLevel.SEQUENCE else ()
    band = ("rollout_rs_stat", "rollout_rs_order", *red, "rollout_rs_low", "rollout_rs_high")
    return ("rollout_rs", *band, "rollout_rs_effect")


def rollout_gate_reads(conv: Convention) -> tuple[str, ...]:
    """The keys :func:`rollout_gate_stage` reads under ``conv``: ``rollout_rs`` alone when the gate is
    off, ``rollout_rs`` and ``rollout_rs_effect`` under ``weight``, the whole gate under
    ``drop_mask``."""
    if conv.gate.level is None:
        return ("rollout_rs",)
    if not conv.gate.drops:
        return ("rollout_rs", "rollout_rs_effect")
    return _gate_reads(conv)


def rollout_gate_needs(conv: Convention, hp: Hyperparams) -> dict[str, str]:
    """``rollout_logprobs`` under a ``drop_mask`` gate (:attr:`refppo.pipeline.stages.Stage.needs`)."""
    return {"rollout_logprobs": _correction_setting(conv)} if conv.gate.drops else {}


def _correction_setting(conv: Convention) -> str:
    on = [
        f"{k}={v.value}"
        for k, v in (("rollout_is", conv.rollout.level), ("rollout_rs", conv.gate.level))
        if v
    ]
    return " and ".join(on)


def rollout_correction_needs(conv: Convention, hp: Hyperparams) -> dict[str, str]:
    """The optional input the correction needs when it is on (a weight or a gate):
    ``rollout_logprobs`` (:attr:`refppo.pipeline.stages.Stage.needs`)."""
    on = conv.rollout.on or conv.gate.on
    return {"rollout_logprobs": _correction_setting(conv)} if on else {}


def rollout_logprobs_of(q: Q, conv: Convention) -> Tensor:
    """``q["rollout_logprobs"]``, the behaviour log-probs the correction reads; a one-line
    :class:`~refppo.errors.DumpError` naming the key and the stage when it is absent."""
    lb = q.get("rollout_logprobs")
    if lb is None:
        raise DumpError(
            f"missing key 'rollout_logprobs' [B, T] (the engine's log-probs of the sampled tokens): stage "
            f"rollout_correction reads it under {_correction_setting(conv)}; dump it or set "
            "rollout_is=none and rollout_rs=none"
        )
    out: Tensor = lb
    return out


def gate_keep(q: Q, conv: Convention) -> Tensor:
    """The tokens the gate of ``conv.gate`` keeps, bool ``[B, T]``
    (:func:`refppo.core.rollout_correction.rejection_mask` of ``(old_logprobs, rollout_logprobs)``)."""
    g = conv.gate
    if g.low is None and g.high is None:
        return check_mask("mask", q["mask"])  # an unbounded band keeps every valid token
    return rejection_mask(
        q["old_logprobs"], rollout_logprobs_of(q, conv), q["mask"], stat=g.stat, order=g.order,
        level=g.level or ISLevel.TOKEN, reduce=g.reduce, low=g.low, high=g.high,
    )  # fmt: skip


def gate_statistic_of(q: Q, conv: Convention) -> Tensor:
    """The statistic the gate of ``conv.gate`` compares with its band, ``[B, T]`` (the token's, or
    its row's; :func:`refppo.core.rollout_correction.gate_statistic`): what ``--detect`` solves
    thresholds on."""
    g = conv.gate
    return gate_statistic(
        q["old_logprobs"], rollout_logprobs_of(q, conv), q["mask"], stat=g.stat, order=g.order,
        level=g.level or ISLevel.TOKEN, reduce=g.reduce,
    )  # fmt: skip


def rollout_gate_stage(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Any]:
    """The response and value masks of every stage after the gate: under ``rollout_rs_effect=
    drop_mask`` ``m' = m ∧ keep`` and ``value_mask' = value_mask ∧ keep`` (``keep``:
    :func:`gate_keep`, bool ``[B, T]``); otherwise both unchanged (nothing else read)."""
    return gate_masks(q, conv)


def gate_masks(q: Q, conv: Convention) -> dict[str, Any]:
    """:func:`rollout_gate_stage`'s ``{"mask", "value_mask"}`` (also for a stage variant that
    replaces the rollout correction: :mod:`refppo.pipeline.bugs_rollout`)."""
    vm = q.get("value_mask")  # None: a caller that walks the update's policy side only
    if not conv.gate.drops:
        return {"mask": q["mask"], "value_mask": vm}
    m = _none_left(q["mask"] & gate_keep(q, conv), conv, q["mask"])
    return {
        "mask": m,
        "value_mask": None if vm is None else check_mask("value_mask", vm, require_nonempty_rows=False) & m,
    }


def _none_left(m: Tensor, conv: Convention, before: Tensor) -> Tensor:
    """``m`` (the gate's mask), refused in one line when no token is left, or when the gate empties a
    row under ``advantage=opo`` (verl's lengths ``L_i`` are the reduced mask's: an emptied row has
    ``L_i = 0``, which the core's group step does not take). The other group estimators read every
    row (:func:`refppo.pipeline.row_subset.group_advantages_on_every_row`, as verl 0.9.1's
    ``compute_grpo_outcome_advantage``: tests/peers/test_peer_verl_rollout_rs_grpo.py)."""
    if not bool(m.any()):
        raise MaskError(
            f"rollout_rs_effect=drop_mask: the gate ({_correction_setting(conv)}) rejects every token of the "
            "batch; no row is left to train on"
        )
    emptied = before.bool().any(dim=-1) & ~m.any(dim=-1)
    if conv.adv.estimator is AdvantageEstimator.OPO and bool(emptied.any()):
        raise ConventionError(
            f"rollout_rs_effect=drop_mask empties {int(emptied.sum())} row(s) under advantage=opo: verl "
            "weighs them by their reduced length 0, which refppo does not compute (use rollout_rs_effect="
            "weight or a token-level gate)"
        )
    return m


def _and_naive(a: list[list[bool]], b: list[list[bool]]) -> list[list[bool]]:
    return [[x and y for x, y in zip(ra, rb, strict=True)] for ra, rb in zip(a, b, strict=True)]


def _gate_naive(q: Q, conv: Convention) -> list[list[bool]]:
    g = conv.gate
    if g.level is None or (g.low is None and g.high is None):
        return [[bool(v) for v in row] for row in q["mask"].tolist()]
    return rejection_mask_naive(
        q["old_logprobs"], rollout_logprobs_of(q, conv), q["mask"], stat=g.stat, order=g.order, level=g.level,
        reduce=g.reduce, low=g.low, high=g.high,
    )  # fmt: skip


def rollout_gate_naive(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Any]:
    """Naive twin of :func:`rollout_gate_stage` (verl 0.9.1 ``compute_rollout_rejection_mask``:
    ``modified_response_mask = response_mask · final_mask``): token by token, ``m'_bt = m_bt and
    keep_bt`` (:func:`refppo.core.rollout_correction.rejection_mask_naive`), the same for the value
    mask."""
    v = q.get("value_mask")
    if not conv.gate.drops:
        return {"mask": q["mask"], "value_mask": v}
    keep = _gate_naive(q, conv)
    dev = q["mask"].device
    m = _and_naive([[bool(x) for x in r] for r in q["mask"].tolist()], keep)
    vm = None if v is None else _and_naive([[bool(x) for x in r] for r in v.tolist()], keep)
    return {
        "mask": _none_left(torch.tensor(m, dtype=torch.bool, device=dev), conv, q["mask"]),
        "value_mask": None if vm is None else torch.tensor(vm, dtype=torch.bool, device=dev),
    }


def rollout_correction_stage(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Any]:
    """The rollout correction's weight ``w'`` of ``π^prox/π^beh`` and its kept tokens
    (:func:`refppo.core.rollout_correction.is_weights`, detached), times the gate's keep mask
    (``w' ← w'·keep``, ``w'`` = 1 without ``rollout_is``); both None when both are off
    (``rollout_logprobs`` is then not read). Under ``rollout_rs_effect=drop_mask`` the gate leaves
    the weight alone and makes the update's masks instead (:func:`gate_masks`); otherwise ``mask``
    and ``value_mask`` pass unchanged."""
    rc, m, masks = conv.rollout, q["mask"], gate_masks(q, conv)
    gate = conv.gate.on and not conv.gate.drops
    if rc.level is None and not gate:
        return {"is_weights": None, "is_keep": None, **masks}
    if rc.level is None:
        weight, keep = torch.where(m, 1.0, 0.0).to(q["old_logprobs"].dtype), m
    else:
        w = is_weights(
            q["old_logprobs"], rollout_logprobs_of(q, conv), m, level=rc.level, agg=rc.agg, mode=rc.mode,
            low=rc.low, high=rc.high,
        )  # fmt: skip
        weight, keep = w.weight, w.keep
    if gate:
        keep = keep & gate_keep(q, conv)
        weight = torch.where(keep, weight, torch.zeros((), dtype=weight.dtype, device=weight.device))
    return {"is_weights": weight, "is_keep": keep, **masks}


def _f64(x: Any, device: torch.device) -> Tensor:
    return torch.tensor(x, dtype=torch.float64, device=device)


def rollout_correction_naive(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Any]:
    """Naive twin of :func:`rollout_correction_stage`: each token's weight by
    :func:`refppo.core.rollout_correction.is_weights_naive` (1 without ``rollout_is``), then 0 where
    :func:`refppo.core.rollout_correction.rejection_mask_naive` rejects it, token by token; under
    ``drop_mask`` the weight without the gate and the masks of :func:`rollout_gate_naive`."""
    masks = rollout_gate_naive(q, conv, hp, ev)
    if conv.gate.drops:
        conv = conv.with_updates({"rollout_rs": None})
    return {**_weights_naive(q, conv), **masks}


def _weights_naive(q: Q, conv: Convention) -> dict[str, Any]:
    rc, g, m = conv.rollout, conv.gate, q["mask"]
    if rc.level is None and g.level is None:
        return {"is_weights": None, "is_keep": None}
    lb = rollout_logprobs_of(q, conv)
    ok = [[bool(v) for v in row] for row in m.tolist()]
    weight = [[1.0 if v else 0.0 for v in row] for row in ok]
    keep = ok
    if rc.level is not None:
        weight, _, keep = is_weights_naive(
            q["old_logprobs"], lb, m, level=rc.level, agg=rc.agg, mode=rc.mode, low=rc.low, high=rc.high
        )
    if g.level is not None and (g.low is not None or g.high is not None):
        gate = rejection_mask_naive(
            q["old_logprobs"], lb, m, stat=g.stat, order=g.order, level=g.level, reduce=g.reduce, low=g.low,
            high=g.high,
        )  # fmt: skip
        keep = [[k and t for k, t in zip(kr, gr, strict=True)] for kr, gr in zip(keep, gate, strict=True)]
        weight = [
            [w if k else 0.0 for w, k in zip(wr, kr, strict=True)]
            for wr, kr in zip(weight, keep, strict=True)
        ]
    return {
        "is_weights": _f64(weight, m.device),
        "is_keep": torch.tensor(keep, dtype=torch.bool, device=m.device),
    }


__all__ = [
    "RC_KEYS",
    "RS_KEYS",
    "gate_keep",
    "gate_masks",
    "gate_statistic_of",
    "rollout_correction_naive",
    "rollout_correction_needs",
    "rollout_correction_reads",
    "rollout_correction_stage",
    "rollout_gate_naive",
    "rollout_gate_needs",
    "rollout_gate_reads",
    "rollout_gate_stage",
    "rollout_logprobs_of",
]
