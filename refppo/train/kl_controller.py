"""KL-coefficient controllers: a fixed β, or the adaptive controller of Ziegler et al. (2019).

The adaptive rule (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences",
§2.2; lm-human-preferences ``lm_human_preferences/train_policy.py::AdaptiveKLController``;
verl ``verl/trainer/ppo/core_algos.py::AdaptiveKLController``; TRL ``AdaptiveKLController``)::

    e  = clip(KL / KL_target − 1, −0.2, 0.2)
    β ← β · (1 + e · n / horizon)

where ``KL`` is the measured KL of the last rollout and ``n`` the number of episodes (sequences)
it held — lm-human-preferences and verl both pass the batch size as ``n_steps``.
The controllers are pure Python (no tensors), so a checkpoint stores them as a small dict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from refppo.errors import HyperparameterError

CLIP = 0.2
"""The proportional error is clipped to [−CLIP, CLIP] (0.2 in every reference implementation)."""


class KLController(Protocol):
    """What the trainer needs from a controller: the current β, an update, and its state."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> float:
        """Update β from the measured KL of ``n_steps`` episodes; returns the new β."""
        ...

    def state_dict(self) -> dict[str, float]:
        """The controller's state (to checkpoint)."""
        ...

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore the state saved by :meth:`state_dict`."""
        ...


@dataclass
class FixedKLController:
    """β stays at its initial value (lm-human-preferences ``FixedKLController``)."""

    value: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.value) and self.value >= 0):
            raise HyperparameterError(f"kl_coef: expected a finite β ≥ 0, got {self.value!r}")

    def update(self, current_kl: float, n_steps: int) -> float:
        """No-op; returns β."""
        del current_kl, n_steps
        return self.value

    def state_dict(self) -> dict[str, float]:
        """``{"value": β}``."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore β (validated like the constructor)."""
        self.value = FixedKLController(float(state["value"])).value


@dataclass
class AdaptiveKLController:
    """β ← β·(1 + clip(KL/target − 1, −0.2, 0.2)·n/horizon) (Ziegler et al. 2019)."""

    value: float
    """Current β (starts at the initial coefficient)."""
    target: float
    """Target KL (in the units of the measured KL; lm-human-preferences: 6 nats per sequence)."""
    horizon: float
    """Horizon in episodes (lm-human-preferences: 10000)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.value) and self.value >= 0):
            raise HyperparameterError(f"kl_coef: expected a finite β ≥ 0, got {self.value!r}")
        if not (math.isfinite(self.target) and self.target > 0):
            raise HyperparameterError(f"kl.target: expected a finite value > 0, got {self.target!r}")
        if not (math.isfinite(self.horizon) and self.horizon > 0):
            raise HyperparameterError(f"kl.horizon: expected a finite value > 0, got {self.horizon!r}")

    def update(self, current_kl: float, n_steps: int) -> float:
        """One update from the measured KL of ``n_steps`` episodes; returns the new β."""
        if not math.isfinite(current_kl):
            raise HyperparameterError(f"adaptive KL controller: measured KL is not finite ({current_kl!r})")
        if n_steps < 0:
            raise HyperparameterError(f"adaptive KL controller: n_steps must be ≥ 0, got {n_steps}")
        error = min(max(current_kl / self.target - 1.0, -CLIP), CLIP)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        """β, target and horizon."""
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore β (and target/horizon, which must match the saved run's); validated like the
        constructor, so a corrupt checkpoint cannot make β silently NaN."""
        restored = AdaptiveKLController(
            float(state["value"]),
            float(state.get("target", self.target)),
            float(state.get("horizon", self.horizon)),
        )
        self.value, self.target, self.horizon = restored.value, restored.target, restored.horizon


def make_kl_controller(
    init_coef: float, *, adaptive: bool, target: float, horizon: float
) -> FixedKLController | AdaptiveKLController:
    """A fixed or adaptive controller starting at ``init_coef``."""
    if adaptive:
        return AdaptiveKLController(init_coef, target, horizon)
    return FixedKLController(init_coef)


__all__ = ["CLIP", "AdaptiveKLController", "FixedKLController", "KLController", "make_kl_controller"]
