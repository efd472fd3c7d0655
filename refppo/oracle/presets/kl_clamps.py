"""The peers' KL clamps: the bundles of ``kl_log_ratio_clamp`` and ``kl_value_clamp`` their code
applies, and each peer's rule choosing one from its KL estimator (verl and OpenRLHF clamp per
estimator). A rule is applied by :func:`refppo.oracle.presets.registry.resolve_preset`; the oracle's
diagnosis and ``--detect`` try every bundle (:data:`CLAMP_BUNDLES`).
"""

from __future__ import annotations

from typing import Any

KlClamps = dict[str, Any]
"""A rule's output: ``kl_log_ratio_clamp`` and ``kl_value_clamp``."""

CLAMP_BUNDLES: dict[str, KlClamps] = {
    "none": {"kl_log_ratio_clamp": None, "kl_value_clamp": None},
    "verl-k3": {"kl_log_ratio_clamp": (-20.0, 20.0), "kl_value_clamp": 10.0},
    "openrlhf": {"kl_log_ratio_clamp": None, "kl_value_clamp": 10.0},
    "openrlhf-k3": {"kl_log_ratio_clamp": (-10.0, None), "kl_value_clamp": 10.0},
}
"""The KL clamp combinations the peers use, by name."""

CLAMP_SOURCES: dict[str, str] = {
    "none": "verl/trainer/ppo/core_algos.py::kl_penalty_forward (k1, k2, abs: no clamp); "
    "trl/trainer/ppo_trainer.py::PPOTrainer.train; dschat/rlhf/ppo_trainer.py::compute_rewards",
    "verl-k3": "verl/trainer/ppo/core_algos.py::kl_penalty_forward (low_var_kl: log π_ref − log π to "
    "[−20, 20], the estimate to [−10, 10]); skyrl_train/utils/ppo_utils.py::compute_approx_kl (k3)",
    "openrlhf": "openrlhf/models/utils.py::compute_approx_kl (every estimate clamped to [−10, 10]); "
    "areal/utils/data.py::KLEstimator._compute_approx_kl (apply_clamp=True)",
    "openrlhf-k3": "openrlhf/models/utils.py::compute_approx_kl (k3: log π − log π_ref clamped from "
    "below at −10, the estimate to [−10, 10])",
}
"""Where each bundle comes from (repository file and function)."""


def _bundle(name: str) -> KlClamps:
    return dict(CLAMP_BUNDLES[name])


def no_kl_clamps(estimator: str) -> KlClamps:
    """No clamp, whatever the estimator (refppo, TRL, DeepSpeed-Chat)."""
    return _bundle("none")


def verl_kl_clamps(estimator: str) -> KlClamps:
    """verl 0.9.1 ``verl/trainer/ppo/core_algos.py::kl_penalty_forward``: only ``low_var_kl`` (k3)
    clamps — the log-ratio ``log π_ref − log π`` to [−20, 20] and the estimate to [−10, 10]
    (SkyRL-train 0.3.1's ``compute_approx_kl`` alike)."""
    return _bundle("verl-k3" if estimator == "k3" else "none")


def openrlhf_kl_clamps(estimator: str) -> KlClamps:
    """OpenRLHF 0.11.2 ``openrlhf/models/utils.py::compute_approx_kl``: every estimator's value is
    clamped to [−10, 10]; k3 first clamps ``log π − log π_ref`` from below at −10."""
    return _bundle("openrlhf-k3" if estimator == "k3" else "openrlhf")


def areal_kl_clamps(estimator: str) -> KlClamps:
    """AReaL 1.0.4 ``areal/utils/data.py::KLEstimator._compute_approx_kl`` (``apply_clamp=True``):
    every estimate is clamped to [−10, 10]; the log-ratio is not clamped."""
    return _bundle("openrlhf")


__all__ = [
    "CLAMP_BUNDLES",
    "CLAMP_SOURCES",
    "KlClamps",
    "areal_kl_clamps",
    "no_kl_clamps",
    "openrlhf_kl_clamps",
    "verl_kl_clamps",
]
