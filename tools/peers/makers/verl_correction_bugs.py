"""verl 0.9.1 dumps with the rollout correction's classic bugs injected (``verl-openrlhf`` venv; issue
#22 "Done when": each named bug, injected into a dump made by a peer's own code, is caught at the
right first divergence and named).

Every dump is one verl step as :mod:`peers.makers.verl_correction` makes it (verl's ``kl_penalty``,
GAE, ``compute_rollout_correction_weights`` into ``compute_policy_loss_vanilla``, value loss,
``agg_loss``), with the bug injected by calling verl's own functions with the bug's input:

=========================== ============================================================ ==================
case                        verl called with                                              checked as
=========================== ============================================================ ==================
is_sum_not_mean             ``rollout_is="sequence"`` (verl sums the row's log-ratio)     sequence,
                                                                                          geometric, ≤ 2
truncate_mask_swapped       ``rollout_is_threshold="0.5_2.0"`` (IcePop: mask)             truncate [0.5, 2]
truncate_mask_swapped_tis   ``rollout_is_threshold=2.0`` (TIS: truncate)                  mask ≤ 2
cap_on_log_ratio            ``rollout_is_threshold=e^1.5``: ``min(w, e^1.5) =             truncate ≤ 1.5
                            exp(min(log w, 1.5))``
old_is_behaviour            ``old_log_prob`` := ``rollout_log_probs`` (the weight's       truncate ≤ 2
                            log-ratio then 0)
is_weight_against_current   the log-ratio ``log_prob − rollout_log_probs`` (current)       truncate ≤ 2
is_weight_not_detached      on-policy (``old_log_prob = log_prob.detach()``), the live     truncate ≤ 2
                            ``log_prob − rollout_log_probs``, verl's final ``.detach()``
                            undone (``Tensor.detach`` the identity during the call: the
                            code before verl PR #4105); ``grad_logprobs`` by autograd
nonfinite_through_mask      a stale engine log-prob (−1000); the weight is the bug's      mask [0.5, 2]
                            own, ``exp(l^prox − l^beh)·[0.5 ≤ w ≤ 2]`` multiplied (no
                            peer has it: verl and OpenRLHF select with ``torch.where``,
                            verl also clamps the log-ratio at ±20), into verl's loss
clean                       ``rollout_is_threshold=2.0``, no bug (the control)            truncate ≤ 2
=========================== ============================================================ ==================

Token level unless said; "checked as" is the case's ``--set`` (``NAME.set.json``) over verl's preset.
Each case writes ``NAME.bug.json``: ``{"bug": name or null, "first": the first divergence}``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from peers.makers.common import HP, behaviour_inputs, save
from peers.makers.verl_correction import (
    ACTOR,
    BASE_CONV,
    log_ratio,
    rollout_part,
    step_dump,
    verl_fns,
)

TIS2 = {"rollout_is": "token", "rollout_is_mode": "truncate", "rollout_is_low": None, "rollout_is_high": 2.0}
BAND = {"rollout_is": "token", "rollout_is_mode": "mask", "rollout_is_low": 0.5, "rollout_is_high": 2.0}

# case → (the bug it names or None, the checked rollout_is* keys, the first divergence)
CASES: dict[str, tuple[str | None, dict[str, Any], str]] = {
    "is_sum_not_mean": ("is_sum_not_mean", {**TIS2, "rollout_is": "sequence", "rollout_is_agg": "geometric"},
                        "pg_loss"),
    "truncate_mask_swapped": ("truncate_mask_swapped", {**BAND, "rollout_is_mode": "truncate"}, "pg_loss"),
    "truncate_mask_swapped_tis": ("truncate_mask_swapped", {**TIS2, "rollout_is_mode": "mask"}, "pg_loss"),
    "cap_on_log_ratio": ("cap_on_log_ratio", {**TIS2, "rollout_is_high": 1.5}, "pg_loss"),
    "old_is_behaviour": ("old_is_behaviour", TIS2, "pg_loss"),
    "is_weight_against_current": ("is_weight_against_current", TIS2, "pg_loss"),
    "is_weight_not_detached": ("is_weight_not_detached", TIS2, "grad_logprobs"),
    "nonfinite_through_mask": ("nonfinite_through_mask", BAND, "pg_loss"),
    "clean": (None, TIS2, ""),
}  # fmt: skip


def _weights(rch: Any, lr: Any, m: Any, level: str = "token", thr: float | str = 2.0) -> Any:
    return rch.compute_rollout_correction_weights(lr, m, rollout_is=level, rollout_is_threshold=thr)[0]


def _undetached_weights(rch: Any, lr: Any, m: Any) -> Any:
    """verl's own weights with its final ``.detach()`` undone (the code before verl PR #4105)."""
    from unittest import mock

    import torch

    with mock.patch.object(torch.Tensor, "detach", lambda self: self):
        return _weights(rch, lr, m)


def _multiplied_band(x: dict[str, Any]) -> Any:
    """The bug's weight: ``w = exp(l^prox − l^beh)`` (no clamp), times the band ``[0.5 ≤ w ≤ 2]``
    as a float: ``inf·0 = NaN`` where ``w`` overflowed."""
    import torch

    m = x["response_mask"]
    w = torch.exp(log_ratio(x))
    return w * ((w >= 0.5) & (w <= 2.0)).to(w.dtype) * m


def _case(ca: Any, rch: Any, name: str, i: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """One case's dump and its extra sidecar keys."""
    import torch

    x = behaviour_inputs(700 + i, 800 + i)
    m = x["response_mask"]
    old, extra = x["old_logprobs"], {}
    if name == "nonfinite_through_mask":
        x["rollout_logprobs"][0, 3] = -1000.0  # row 0 is full: a valid token, 999 nats stale
    if name == "is_weight_not_detached":
        x["logprobs"] = x["old_logprobs"].clone()  # on-policy: l = l^old in value
    lp = x["logprobs"].clone().requires_grad_(name == "is_weight_not_detached")
    ro = rollout_part(ca, x)
    if name == "is_sum_not_mean":
        w = _weights(rch, log_ratio(x), m, level="sequence")
    elif name == "truncate_mask_swapped":
        w = _weights(rch, log_ratio(x), m, thr="0.5_2.0")
    elif name == "cap_on_log_ratio":
        w = _weights(rch, log_ratio(x), m, thr=math.exp(1.5))
    elif name == "old_is_behaviour":
        old = x["rollout_logprobs"]
        w = _weights(rch, log_ratio(x, "rollout_logprobs"), m)
    elif name == "is_weight_against_current":
        w = _weights(rch, log_ratio(x, "logprobs"), m)
    elif name == "is_weight_not_detached":
        old = lp.detach()  # verl's on-policy old_log_prob
        w = _undetached_weights(
            rch, torch.where(m.bool(), lp - x["rollout_logprobs"], torch.zeros_like(m)), m
        )
    elif name == "nonfinite_through_mask":
        w = _multiplied_band(x)
    else:  # clean, truncate_mask_swapped_tis
        w = _weights(rch, log_ratio(x), m)
    pg, metrics = ca.compute_policy_loss_vanilla(
        old, lp, ro["advantages"], m, loss_agg_mode="token-mean", config=ACTOR, rollout_is_weights=w
    )
    dump = step_dump(ca, x, ro, pg, metrics, "token-mean")
    if lp.requires_grad:
        (g,) = torch.autograd.grad(pg, lp)
        dump.update(logprobs=lp.detach(), grad_logprobs=g)
        extra = {"world_size": 1, "micro_batches": 1}
    return dump, extra


def make(out: Path) -> list[str]:
    ca, rch = verl_fns()
    made = []
    for i, (name, (bug, rc, first)) in enumerate(CASES.items()):
        dump, extra = _case(ca, rch, name, i)
        conv = {**BASE_CONV, "loss_agg": "token-mean", **rc}
        case = f"verl_correction_bug_{name}"
        made.append(save(out, case, dump, dict(HP, cliprange=0.2, ent_coef=0.0, **extra), conv))
        (out / f"{case}.bug.json").write_text(json.dumps({"bug": bug, "first": first}))
    return made
