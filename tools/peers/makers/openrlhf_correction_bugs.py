"""OpenRLHF 0.11.2 dumps with rollout-correction bugs injected (``verl-openrlhf`` venv; issue #22
"Done when"), beside :mod:`peers.makers.verl_correction_bugs`.

Every dump is one OpenRLHF step as :mod:`peers.makers.openrlhf_correction` makes it (its KL, shaped
reward, GAE, ``PolicyLoss`` with the token-level IS correction, value loss), the bug injected by
calling ``PolicyLoss`` with the bug's input:

=========================== ============================================================ ==================
case                        ``PolicyLoss`` called with                                    checked as
=========================== ============================================================ ==================
truncate_mask_swapped       ``is_correction_mode="mask"``, ``[0.5, 2]``                   truncate [0.5, 2]
truncate_mask_swapped_clip  ``is_correction_mode="clip"``, ``[0.5, 1.5]``                 mask [0.5, 1.5]
cap_on_log_ratio            ``"clip"``, ``[e^0.1, e^1]``: ``clamp(w, e^0.1, e^1) =        truncate [0.1, 1]
                            exp(clamp(log w, 0.1, 1))``
old_is_behaviour            ``old_log_probs`` := ``rollout_log_probs`` (its IS log-ratio  truncate [0.5, 1.5]
                            then 0), ``"clip"``, ``[0.5, 1.5]``
clean                       ``"clip"``, ``[0.5, 1.5]``, no bug (the control)              truncate [0.5, 1.5]
=========================== ============================================================ ==================

OpenRLHF detaches its IS log-ratio and reads ``old_log_probs`` for the policy ratio too, so the
weight not detached or against the current policy cannot be injected through its own function; it
has no sequence-level product weight and selects its band with ``torch.where`` (verl's maker covers
those). Each case writes ``NAME.bug.json``: ``{"bug": name or null, "first": the first divergence}``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from peers.makers.common import HP, behaviour_inputs, save
from peers.makers.openrlhf_correction import BASE_CONV, corrected_step
from peers.makers.openrlhf_step import openrlhf_fns

# case → (PolicyLoss mode, [lo, hi], the bug or None, the checked mode and bounds)
CASES: dict[str, tuple[str, tuple[float, float], str | None, tuple[str, float, float]]] = {
    "truncate_mask_swapped": ("mask", (0.5, 2.0), "truncate_mask_swapped", ("truncate", 0.5, 2.0)),
    "truncate_mask_swapped_clip": ("clip", (0.5, 1.5), "truncate_mask_swapped", ("mask", 0.5, 1.5)),
    "cap_on_log_ratio": ("clip", (math.exp(0.1), math.exp(1.0)), "cap_on_log_ratio", ("truncate", 0.1, 1.0)),
    "old_is_behaviour": ("clip", (0.5, 1.5), "old_is_behaviour", ("truncate", 0.5, 1.5)),
    "clean": ("clip", (0.5, 1.5), None, ("truncate", 0.5, 1.5)),
}


def make(out: Path) -> list[str]:
    fns = openrlhf_fns()
    made = []
    for i, (name, (mode, (lo, hi), bug, (c_mode, c_lo, c_hi))) in enumerate(CASES.items()):
        x = behaviour_inputs(900 + i, 950 + i)
        old = x["rollout_logprobs"] if name == "old_is_behaviour" else None
        dump = corrected_step(fns, x, mode, lo, hi, old=old)
        conv = {
            **BASE_CONV, "rollout_is": "token", "rollout_is_mode": c_mode, "rollout_is_low": c_lo,
            "rollout_is_high": c_hi,
        }  # fmt: skip
        case = f"openrlhf_correction_bug_{name}"
        made.append(save(out, case, dump, dict(HP, cliprange=0.2, ent_coef=0.0), conv))
        (out / f"{case}.bug.json").write_text(
            json.dumps({"bug": bug, "first": "" if bug is None else "pg_loss"})
        )
    return made
