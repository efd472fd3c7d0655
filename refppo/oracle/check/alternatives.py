"""The candidate convention changes of the oracle's diagnosis (:func:`refppo.oracle.check.diagnose.explain`),
and which of them can change each output, derived from the stage table and the enums.

- :data:`CANDIDATE_KEYS`: the keys a single-key change is tried on, in the order the diagnosis tries
  and lists them (``kl_clamps`` stands for the pair ``kl_log_ratio_clamp``, ``kl_value_clamp``);
- the alternatives of an enum key are its enum's members (a member whose value is another's, the
  straight-through KL estimators ``k1+``, ``k3+``, ``abs+``, is left out: it changes no value), an
  optional enum's None first (:data:`ALTERNATIVES`, :data:`GROUP_ALTERNATIVES`); a numeric key's are
  the peers' named values (:data:`NAMED`);
- :data:`AFFECTS`: for each output of :data:`refppo.pipeline.stages.OUTPUTS`, the candidate keys that
  some stage upstream of it reads (:func:`refppo.pipeline.stage_graph.keys_upstream`).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from refppo.conventions import AdvantageEstimator, LossAgg
from refppo.pipeline.settings import FLAT, enum_keys
from refppo.pipeline.stage_graph import keys_upstream
from refppo.pipeline.stages import BY_NAME, OUTPUTS
from refppo.pipeline.unread import SIGMA_ESTIMATORS

GROUP_EPS = (1e-6, 1e-9, 1e-4, 1e-8)
"""``group_eps`` of the peers: verl/SkyRL 1e-6, OpenRLHF 1e-9, TRL GRPOTrainer 1e-4, and 1e-8 (also
``search_estimator.NAMED_EPS``, which imports this one)."""
STD_ESTIMATORS = SIGMA_ESTIMATORS
"""The estimators that read ``group_std``, ``group_eps`` and ``group_std_level`` (their σ)."""

CLAMP_BUNDLES: dict[str, dict[str, Any]] = {
    "none": {"kl_log_ratio_clamp": None, "kl_value_clamp": None},
    "verl-k3": {"kl_log_ratio_clamp": (-20.0, 20.0), "kl_value_clamp": 10.0},
    "openrlhf": {"kl_log_ratio_clamp": None, "kl_value_clamp": 10.0},
    "openrlhf-k3": {"kl_log_ratio_clamp": (-10.0, None), "kl_value_clamp": 10.0},
}
"""The KL clamp combinations the peers use (see refppo.oracle.presets.registry)."""

CORRECTION_BUNDLES: dict[str, dict[str, Any]] = {
    "off": {"rollout_is": None},
    "verl-token-tis": {"rollout_is": "token", "rollout_is_mode": "truncate", "rollout_is_low": None,
                       "rollout_is_high": 2.0},
    "trl-sequence-mask": {"rollout_is": "sequence", "rollout_is_agg": "product", "rollout_is_mode": "mask",
                          "rollout_is_low": None, "rollout_is_high": 3.0},
}  # fmt: skip
"""The rollout corrections the diagnosis tries (candidate ``rollout_correction``, only on a dump with
``rollout_logprobs``): none; verl 0.9.1's ``rollout_is: token`` at its default
``rollout_is_threshold`` 2.0 (``trainer/config/algorithm.py::RolloutCorrectionConfig``); TRL 1.16.0
GRPOConfig's default ``vllm_importance_sampling_mode="sequence_mask"``, ``clip_max`` 3.0."""
CORRECTION_KEYS: tuple[str, ...] = BY_NAME["rollout_correction"].keys
"""The rollout correction stage's keys (the ``rollout_is*`` keys)."""

GROUP_KEYS: tuple[str, ...] = (
    "advantage",
    "group_std",
    "group_std_level",
    "group_eps",
    "group_singleton",
    "group_kl",
)
"""The critic-free estimator (step 3) and its options: tried only where they apply
(:func:`refppo.oracle.check.diagnose._applies`)."""

CANDIDATE_KEYS: tuple[str, ...] = (
    "kl_estimator",
    "kl_clamps",
    "kl_in",
    "score_at",
    "score_clip",
    *GROUP_KEYS,
    "gae_bootstrap",
    "whiten_advantages",
    "whiten_variance",
    "dual_clip",
    "log_ratio_clamp",
    "value_loss",
    "value_clip_form",
    "loss_agg",
    "value_loss_agg",
    "vf_mask",
    "approx_kl",
    "rollout_correction",
)
"""The keys a single-key change is tried on, in the order they are tried (and listed);
``rollout_correction`` stands for the ``rollout_is*`` keys (:data:`CORRECTION_BUNDLES`)."""

NAMED: dict[str, list[Any]] = {
    "score_clip": [None, 5.0, 10.0],
    "dual_clip": [None, 3.0],
    "log_ratio_clamp": [None, 20.0],
    "group_eps": list(GROUP_EPS),
}
"""The peers' named values of the numeric candidate keys (OpenRLHF's score clip 10, DeepSpeed-Chat's
5; verl's dual clip 3; verl/OpenRLHF's log-ratio clamp 20)."""


def flat_keys(key: str) -> tuple[str, ...]:
    """The flat convention keys a candidate key changes (``kl_clamps``: the two KL clamps;
    ``rollout_correction``: the ``rollout_is*`` keys)."""
    if key == "rollout_correction":
        return CORRECTION_KEYS
    return ("kl_log_ratio_clamp", "kl_value_clamp") if key == "kl_clamps" else (key,)


def members(key: str) -> list[Any]:
    """The alternatives of an enum key: its members but those whose value is another member's (a
    ``base`` other than themselves), None first for an optional key; ``advantage`` without ``gae``
    (a GAE dump is not re-run through the critic-free estimators); no ``prompt-mean`` (it reads the
    prompts, and only the policy and entropy terms take it: not offered as a one-key explanation)."""
    enum: type[Enum] = enum_keys()[key]
    out: list[Any] = [None] if FLAT[key].default is None else []
    skip = (AdvantageEstimator.GAE, LossAgg.PROMPT_MEAN)
    out += [m for m in enum if getattr(m, "base", m) is m and m not in skip]
    return out


def _alternatives(key: str) -> list[dict[str, Any]]:
    if key == "kl_clamps":
        return [dict(b) for b in CLAMP_BUNDLES.values()]
    if key == "rollout_correction":
        return [dict(b) for b in CORRECTION_BUNDLES.values()]
    values = NAMED[key] if key in NAMED else members(key)
    return [{key: v} for v in values]


ALTERNATIVES: dict[str, list[dict[str, Any]]] = {
    k: _alternatives(k) for k in CANDIDATE_KEYS if k not in GROUP_KEYS
}
"""Every candidate change but the critic-free ones, by key (``--detect`` reads them too)."""
GROUP_ALTERNATIVES: dict[str, list[dict[str, Any]]] = {k: _alternatives(k) for k in GROUP_KEYS}
"""The critic-free estimators (step 3) and their options."""

AFFECTS: dict[str, tuple[str, ...]] = {
    q: tuple(k for k in CANDIDATE_KEYS if set(flat_keys(k)) & set(keys_upstream(q))) for q in OUTPUTS
}
"""Which candidate keys can change each output (the stages upstream of it read them)."""


__all__ = [
    "AFFECTS",
    "ALTERNATIVES",
    "CANDIDATE_KEYS",
    "CLAMP_BUNDLES",
    "CORRECTION_BUNDLES",
    "CORRECTION_KEYS",
    "GROUP_ALTERNATIVES",
    "GROUP_EPS",
    "GROUP_KEYS",
    "NAMED",
    "STD_ESTIMATORS",
    "flat_keys",
    "members",
]
