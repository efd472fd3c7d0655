"""The ``--detect`` walk over the pipeline's stage table: its steps, in pipeline order.

Each step evaluates consecutive stages of :data:`refppo.pipeline.stages.STAGES` through their
functions (:meth:`refppo.oracle.detect.search.Search.evaluate`), walks the options of the keys it
names (every member of each enum key, the peers' constants and the checked setting's for the
numeric ones), compares the dumped quantities it names, and merges the options whose outputs are
bit-identical (:mod:`refppo.oracle.detect.groups`). When no option reproduces a step's dumped
quantity, its solver reads constants off the data and the step is walked again with them.
:func:`run_search` runs the steps; :data:`STEPS` describes them (the module docstring of
:mod:`refppo.oracle.detect.detection` and spec/conventions.md show it; a test checks both against
the stage table).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, replace
from typing import Any

from refppo.oracle.detect.correction import correction_step, note_uncorrectable
from refppo.oracle.detect.estimator import estimator_step, gae_step, needs_estimator_stage
from refppo.oracle.detect.groups import Group
from refppo.oracle.detect.in_loss import walk_rows
from refppo.oracle.detect.policy import policy_step
from refppo.oracle.detect.policy_members import list_classes
from refppo.oracle.detect.rollout import kl_step, reward_step, whiten_step
from refppo.oracle.detect.search import Search
from refppo.oracle.detect.states import AdvState
from refppo.oracle.detect.value import loss_step, no_critic, value_step
from refppo.pipeline.stages import BY_NAME


@dataclass(frozen=True)
class Step:
    """One step of the walk."""

    name: str
    """Its label (``unmatched_stages``, :attr:`Search.walks`)."""
    stages: tuple[str, ...]
    """The pipeline stages it evaluates, in order."""
    checks: tuple[str, ...]
    """The dumped quantities it compares."""
    walks: tuple[str, ...]
    """The flat keys (and hyperparameters) whose values it walks or solves."""
    solver: str
    """What its solver reads off the data when nothing reproduces the dump."""


STEPS: tuple[Step, ...] = (
    Step("kl", ("kl",), ("kl",), ("kl_estimator", "kl_log_ratio_clamp", "kl_value_clamp"), "the KL clamps"),
    Step(
        "token_rewards", ("score_map", "value_mask", "rewards", "reward_whitening"), ("token_rewards",),
        ("score_bias", "score_scale", "score_clip", "kl_in", "score_at", "whiten_rewards", "whiten_variance",
         "whiten_eps_at", "score_slot_kl"),
        "score bias and scale, score clip",
    ),
    Step(
        "returns", ("rollout_gate", "advantages"), ("returns",),
        ("advantage", "gae_padding", "gae_holes", "group_std", "group_std_level", "group_singleton",
         "group_kl", "group_eps", "gae_bootstrap", "rollout_rs", "rollout_rs_stat", "rollout_rs_order",
         "rollout_rs_reduce", "rollout_rs_low", "rollout_rs_high", "rollout_rs_effect"),
        "group_eps; nothing reproducing returns with rollout_logprobs and a critic: a drop_mask gate's "
        "band read off returns (detect/drop_gate.py)",
    ),
    Step(
        "advantages", ("whitening",), ("advantages",),
        ("whiten_advantages", "whiten_variance", "whiten_eps_at", "whiten_holes"), "(a fitted map, named)",
    ),
    Step(
        "correction", ("rollout_correction",), (),
        tuple(k for k in BY_NAME["rollout_correction"].keys if k != "rollout_rs_effect"),
        "the bounds C_low, C_high and the gates' thresholds read off pg_loss (before the walk: the "
        "weight is not dumped; the policy step checks it; not walked without rollout_logprobs)",
    ),
    Step(
        "policy", ("policy", "policy_agg", "approx_kl", "entropy", "kl_loss"),
        ("pg_loss", "pg_clipfrac", "approx_kl", "entropy_loss", "grad_logprobs"),
        ("policy_loss", "dual_clip", "log_ratio_clamp", "cliprange", "cliprange_high", "loss_agg",
         "approx_kl", "entropy_agg", "kl_grad_is_clip", "clipfrac_agg", "clipfrac_counts",
         "kl_loss_estimator", "kl_loss_log_ratio_clamp", "kl_loss_value_clamp", "truncated_rows"),
        "dual-clip c, clip ranges (off pg_loss, or without it off grad_logprobs; walked with every "
        "policy_loss)",
    ),
    Step(
        "value", ("value", "value_agg"), ("vf_loss", "vf_clipfrac", "grad_values"),
        ("value_loss", "value_clip_form", "vf_mask", "value_loss_agg", "cliprange_value", "truncated_rows"),
        "value clip range (off vf_loss, or without it off grad_values)",
    ),
    Step(
        "loss", ("kl_loss", "kl_metric", "total"), ("kl_loss", "loss"),
        ("kl_loss_agg", "kl_metric_agg", "truncated_rows"), "—",
    ),
)  # fmt: skip
"""The walk, in pipeline order."""

NOT_WALKED_YET: dict[str, str] = {}
"""Keys the walk should search and does not yet (an open gap, named: the tests allow only these).
The ``rollout_is*`` keys left it when the correction step walked them (#22), ``truncated_rows``
when the update steps walked it on the rows in the loss (:mod:`refppo.oracle.detect.in_loss`)."""

NOT_WALKED: dict[str, str] = {
    **NOT_WALKED_YET,
    "gamma": "the sidecar's",
    "lam": "the sidecar's",
    "kl_coef": "the sidecar's",
    "vf_coef": "the sidecar's",
    "ent_coef": "the sidecar's",
    "whiten_eps": "the sidecar's",
    "horizon": "the sidecar's",
    "kl_loss_coef": "the sidecar's (kl_in=both: a note reads the KL loss's own β off loss)",
}
"""What the stages read and no step walks: each stays at the checked setting's value."""


def steps_table(width: int = 100) -> str:
    """:data:`STEPS` as a list, one item per step wrapped at ``width`` (the detection docstring and
    spec/conventions.md hold it verbatim; Markdown and reStructuredText alike)."""
    items = []
    for st in STEPS:
        checked = f"checked against {', '.join(st.checks)}" if st.checks else "checks nothing dumped"
        text = (
            f"- ``{st.name}`` (stages {', '.join(st.stages)}): walks {', '.join(st.walks)}; "
            f"{checked}; solver: {st.solver}."
        )
        items.append(textwrap.fill(text, width, subsequent_indent="  ", break_on_hyphens=False))
    return "\n".join(items)


def run_search(s: Search) -> list[Group[Any]]:
    """The steps of :data:`STEPS` on ``s``'s dump: the groups that reproduce every step (or the
    nearest), their conventions relative to the checked setting. The memory-mapped dump keys are
    paged out between steps (a step holds only the keys it reads)."""
    t = s.t
    groups: list[Group[Any]] = [Group([{}], 1, ())]
    s.dump.release_mapped()  # the loader's validation read every key
    groups = kl_step(s, groups)
    s.dump.release_mapped()
    groups = reward_step(s, groups)
    s.dump.release_mapped()
    # a dump with a critic and no group_index under a gae setting walks GAE alone
    groups = estimator_step(s, groups) if needs_estimator_stage(s) else gae_step(s, groups)
    s.dump.release_mapped()
    groups = whiten_step(s, groups)
    if not ("logprobs" in t or "values" in t):
        return groups
    s.dump.release_mapped()
    for g in groups:  # the raw advantages are not read again
        g.patch(drop_raw_advantages)
    return walk_rows(s, groups, update_walk)  # each truncated_rows member on its rows (detect/in_loss.py)


def update_walk(s: Search, groups: list[Group[Any]]) -> list[Group[Any]]:
    """The update steps (correction, policy, value, loss) on ``s``'s rows."""
    groups = correction_step(s, groups)
    groups = policy_step(s, groups)
    note_uncorrectable(s)
    s.dump.release_mapped()
    groups = value_step(s, groups) if "old_values" in s.t else no_critic(s, groups)
    s.dump.release_mapped()
    return list_classes(s, loss_step(s, groups))  # the logged-only keys' classes, after the last step


def drop_raw_advantages(st: AdvState) -> AdvState:
    """The state without its raw advantages (after the whitening step)."""
    return replace(st, adv_raw=None)


__all__ = [
    "NOT_WALKED",
    "NOT_WALKED_YET",
    "STEPS",
    "Step",
    "drop_raw_advantages",
    "run_search",
    "steps_table",
    "update_walk",
]
