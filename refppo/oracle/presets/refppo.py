"""``--preset refppo``: refppo's own defaults, every key spelled out (any critic-free estimator is
taken as set: :func:`refppo.oracle.presets.registry.critic_free_variant`)."""

from __future__ import annotations

from refppo.oracle.presets.base import Preset, Sourced, make_preset
from refppo.oracle.presets.kl_clamps import no_kl_clamps

_CONV = "refppo/pipeline/settings.py::Convention (the default)"
_EXTRAS = "refppo/oracle/check/settings.py::Extras (the default)"

CONVENTIONS: dict[str, Sourced] = {
    "kl_estimator": ("k1", _CONV),
    "kl_in": ("reward", _CONV),
    "score_at": ("last_valid", _CONV),
    "whiten_advantages": ("masked", _CONV),
    "whiten_variance": ("unbiased", _CONV),
    "loss_agg": ("token-mean", _CONV),
    "value_loss_agg": (None, f"{_CONV}: the policy's loss_agg"),
    "value_loss": ("clipped", _CONV),
    "value_clip_form": ("around_old", _CONV),
    "dual_clip": (None, _CONV),
    "log_ratio_clamp": (None, _CONV),
    "score_clip": (None, _EXTRAS),
    "approx_kl": ("k1", _EXTRAS),
    "vf_mask": ("value", _EXTRAS),
    "whiten_eps_at": ("variance", _CONV),
    "whiten_rewards": ("none", _CONV),
    "gae_padding": ("masked", _CONV),
    "gae_holes": ("skip", _CONV),
    "whiten_holes": ("exclude", _CONV),
    "kl_loss_agg": (None, f"{_CONV}: the policy's loss_agg"),
    "entropy_agg": (None, f"{_CONV}: the policy's loss_agg"),
}

PRESET: Preset = make_preset(
    "refppo",
    CONVENTIONS,
    {},
    no_kl_clamps,
    ("refppo/pipeline.py::Convention (the defaults)",),
)

__all__ = ["CONVENTIONS", "PRESET"]
