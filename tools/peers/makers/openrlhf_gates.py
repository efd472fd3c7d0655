"""OpenRLHF 0.11.2 dumps whose policy term carries its sequence-level IS gate (``verl-openrlhf`` venv).

``openrlhf/models/loss.py::PolicyLoss`` with ``is_correction_level="seq"``,
``is_correction_mode="mask"``, ``is_correction_gating="ratio"``: a row is kept when the geometric
mean of its ratios ``exp(mean_t(l^prox − l^beh))`` lies in ``[lo, hi]``, and its tokens then carry
their own token ratio (``coef = where(keep, token_is, 0)``); rejected rows count in the token-mean
(``Rejected.zero``). In refppo's keys: ``rollout_is=token`` unbounded plus the gate
``rollout_rs=sequence``, ``ratio``, ``proximal``, ``mean``. The step is
:func:`peers.makers.openrlhf_correction.corrected_step` (OpenRLHF's own functions). The control
reduces by the sum (the product gate).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peers.makers.common import HP, behaviour_inputs, save
from peers.makers.openrlhf_correction import BASE_CONV
from peers.makers.openrlhf_step import openrlhf_fns

CASES: list[tuple[float, float]] = [(0.8, 1.25), (0.9, 1.5)]
"""The band ``[lo, hi]`` of the row's geometric-mean ratio."""


def make(out: Path) -> list[str]:
    from peers.makers.openrlhf_correction import corrected_step

    fns = openrlhf_fns()
    made = []
    for i, (lo, hi) in enumerate(CASES):
        dump = corrected_step(fns, behaviour_inputs(540 + i, 640 + i), "mask", lo, hi, level="seq")
        conv: dict[str, Any] = {
            **BASE_CONV, "rollout_is": "token", "rollout_is_mode": "mask", "rollout_is_high": None,
            "rollout_rs": "sequence", "rollout_rs_stat": "ratio", "rollout_rs_order": "proximal",
            "rollout_rs_reduce": "mean", "rollout_rs_low": lo, "rollout_rs_high": hi,
        }  # fmt: skip
        name = f"openrlhf_gates_seq_mask_{lo}_{hi}"
        made.append(
            save(out, name, dump, dict(HP, cliprange=0.2, ent_coef=0.0), conv, {"rollout_rs_reduce": "sum"})
        )
    return made
