"""The candidate convention changes of the oracle's diagnosis (:func:`refppo.oracle.check.diagnose.explain`)
and of ``--detect``'s walks, and which convention keys can change each quantity (split out of
``refppo/oracle/check/diagnose.py``, which re-exports every name)."""

from __future__ import annotations

from typing import Any

from refppo.conventions import AdvantageEstimator, GroupKL, GroupSingleton, GroupStdLevel, LossAgg
from refppo.pipeline.settings import SIGMA_ESTIMATORS

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

ALTERNATIVES: dict[str, list[dict[str, Any]]] = {
    "kl_estimator": [{"kl_estimator": e} for e in ("k1", "k2", "k3", "abs")],
    "kl_clamps": list(CLAMP_BUNDLES.values()),
    "kl_in": [{"kl_in": p} for p in ("reward", "loss")],
    "score_at": [{"score_at": s} for s in ("last_valid", "after_last_valid", "last_position")],
    "score_clip": [{"score_clip": c} for c in (None, 5.0, 10.0)],
    "whiten_advantages": [{"whiten_advantages": w} for w in ("none", "masked", "masked_no_shift")],
    "whiten_variance": [{"whiten_variance": v} for v in ("unbiased", "population")],
    "dual_clip": [{"dual_clip": c} for c in (None, 3.0)],
    "log_ratio_clamp": [{"log_ratio_clamp": c} for c in (None, 20.0)],
    # every mode of the enum (token-sum was missing: a token-sum value loss was never detected)
    "loss_agg": [{"loss_agg": a.value} for a in LossAgg],
    "value_loss_agg": [{"value_loss_agg": a} for a in (None, *(m.value for m in LossAgg))],
    "value_loss": [{"value_loss": v} for v in ("clipped", "unclipped")],
    "value_clip_form": [{"value_clip_form": f} for f in ("around_old", "delta")],
    "vf_mask": [{"vf_mask": v} for v in ("value", "response")],
    "approx_kl": [{"approx_kl": v} for v in ("k1", "k2_all_positions")],
}

GROUP_ALTERNATIVES: dict[str, list[dict[str, Any]]] = {
    "advantage": [{"advantage": e.value} for e in AdvantageEstimator if e is not AdvantageEstimator.GAE],
    "group_std": [{"group_std": v} for v in ("unbiased", "population")],
    "group_std_level": [{"group_std_level": v.value} for v in GroupStdLevel],
    "group_eps": [{"group_eps": e} for e in GROUP_EPS],
    "group_singleton": [{"group_singleton": v.value} for v in GroupSingleton],
    "group_kl": [{"group_kl": v.value} for v in GroupKL],
}
"""The critic-free estimators (step 3) and their options, tried only where they apply
(:func:`_applies`); kept apart from :data:`ALTERNATIVES`, which every base setting (and
``--detect``'s walks) reads."""

_KL = ("kl_estimator", "kl_clamps")
_REW = (*_KL, "kl_in", "score_at", "score_clip")
_GROUP = ("advantage", "group_std", "group_std_level", "group_eps", "group_singleton", "group_kl")
_ADV = (*_REW, *_GROUP, "whiten_advantages", "whiten_variance")
AFFECTS: dict[str, tuple[str, ...]] = {
    "kl": _KL,
    "token_rewards": _REW,
    "advantages": _ADV,
    "returns": (*_REW, *_GROUP),
    "pg_loss": (*_ADV, "dual_clip", "log_ratio_clamp", "loss_agg"),
    "pg_clipfrac": (*_ADV, "log_ratio_clamp"),
    "approx_kl": ("approx_kl",),
    "vf_loss": (*_REW, "value_loss", "value_clip_form", "loss_agg", "value_loss_agg", "vf_mask"),
    "vf_clipfrac": (*_REW, "value_loss", "value_clip_form", "vf_mask"),
    "entropy_loss": ("loss_agg",),
    "kl_loss": (*_KL, "kl_in", "loss_agg"),
    "loss": (*ALTERNATIVES, *_GROUP),
}
"""Which convention keys can change each quantity (the stages of the pipeline)."""
