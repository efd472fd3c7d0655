"""The preset's type and the peers' KL-clamp rules (split out of :mod:`refppo.oracle.presets.registry`).

A :class:`Preset` fixes convention keys, supplies the peer's default hyperparameters and names its
sources; its ``kl_clamps`` rule gives the KL clamps of an estimator (verl and OpenRLHF clamp
per estimator), applied by :func:`refppo.oracle.presets.registry.resolve_preset`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

KlClamps = dict[str, Any]
"""A rule's output: ``kl_log_ratio_clamp`` and ``kl_value_clamp``."""


def _no_kl_clamps(estimator: str) -> KlClamps:
    return {"kl_log_ratio_clamp": None, "kl_value_clamp": None}


def _verl_kl_clamps(estimator: str) -> KlClamps:
    """verl 0.9.1 ``verl/trainer/ppo/core_algos.py::kl_penalty_forward``: only ``low_var_kl`` (k3)
    clamps — the log-ratio ``log π_ref − log π`` to [−20, 20] and the estimate to [−10, 10]."""
    if estimator == "k3":
        return {"kl_log_ratio_clamp": (-20.0, 20.0), "kl_value_clamp": 10.0}
    return _no_kl_clamps(estimator)


def _openrlhf_kl_clamps(estimator: str) -> KlClamps:
    """OpenRLHF 0.11.2 ``openrlhf/models/utils.py::compute_approx_kl``: every estimator's value is
    clamped to [−10, 10]; k3 first clamps ``log π − log π_ref`` from below at −10."""
    if estimator == "k3":
        return {"kl_log_ratio_clamp": (-10.0, None), "kl_value_clamp": 10.0}
    return {"kl_log_ratio_clamp": None, "kl_value_clamp": 10.0}


def _areal_kl_clamps(estimator: str) -> KlClamps:
    """AReaL 1.0.4 ``areal/utils/data.py::KLEstimator._compute_approx_kl`` (``apply_clamp=True``):
    every estimate is clamped to [−10, 10]; the log-ratio is not clamped."""
    return {"kl_log_ratio_clamp": None, "kl_value_clamp": 10.0}


@dataclass(frozen=True)
class Preset:
    """One peer: fixed convention keys, a KL-clamp rule, default hyperparameters, sources."""

    name: str
    conventions: dict[str, Any]
    hparams: dict[str, Any]
    kl_clamps: Callable[[str], KlClamps]
    sources: tuple[str, ...] = field(default_factory=tuple)


__all__ = ["KlClamps", "Preset"]
