"""The KL-coefficient controllers (refppo.train.kl_controller)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from refppo.errors import HyperparameterError
from refppo.train.kl_controller import AdaptiveKLController, FixedKLController, make_kl_controller


def _lm_human_preferences(
    value: float, target: float, horizon: float, kls: list[float], n: int
) -> list[float]:
    """lm-human-preferences train_policy.py AdaptiveKLController.update, transcribed with numpy."""
    out = []
    for current in kls:
        proportional_error = np.clip(current / target - 1, -0.2, 0.2)
        mult = 1 + proportional_error * n / horizon
        value *= mult
        out.append(float(value))
    return out


def test_adaptive_matches_lm_human_preferences_sequence() -> None:
    kls = [0.0, 0.5, 1.0, 5.9, 6.0, 6.1, 12.0, 100.0, 3.0, 7.2]
    ctl = AdaptiveKLController(0.15, target=6.0, horizon=10000.0)
    ours = [ctl.update(k, 512) for k in kls]
    ref = _lm_human_preferences(0.15, 6.0, 10000.0, kls, 512)
    assert ours == pytest.approx(ref, rel=1e-15, abs=0)


def test_adaptive_hand_computed_step() -> None:
    ctl = AdaptiveKLController(0.1, target=2.0, horizon=100.0)
    # error = 2.2/2 − 1 = 0.1 (inside the clip) → β = 0.1 · (1 + 0.1 · 10/100) = 0.101
    assert ctl.update(2.2, 10) == pytest.approx(0.101, rel=1e-12)


def test_adaptive_clips_proportional_error_both_ways() -> None:
    # error 1e6/1 − 1 clipped to +0.2 -> β = 1·(1 + 0.2·5/10) = 1.1; error −1 clipped to −0.2 -> 0.9.
    hi = AdaptiveKLController(1.0, target=1.0, horizon=10.0)
    assert hi.update(1e6, 5) == pytest.approx(1.1, rel=1e-15)
    lo = AdaptiveKLController(1.0, target=1.0, horizon=10.0)
    assert lo.update(0.0, 5) == pytest.approx(0.9, rel=1e-15)


def test_adaptive_moves_towards_target() -> None:
    above = AdaptiveKLController(0.05, target=1.0, horizon=1000.0)
    below = AdaptiveKLController(0.05, target=1.0, horizon=1000.0)
    assert above.update(1.5, 64) > 0.05
    assert below.update(0.5, 64) < 0.05
    at = AdaptiveKLController(0.05, target=1.0, horizon=1000.0)
    assert at.update(1.0, 64) == 0.05


def test_fixed_never_changes() -> None:
    ctl = FixedKLController(0.3)
    for kl in (0.0, 10.0, 1e9):
        assert ctl.update(kl, 100) == 0.3
    assert ctl.value == 0.3


def test_state_dict_roundtrip_continues_identically() -> None:
    a = AdaptiveKLController(0.2, target=3.0, horizon=500.0)
    for kl in (1.0, 4.0, 2.5):
        a.update(kl, 32)
    b = AdaptiveKLController(0.2, target=3.0, horizon=500.0)
    b.load_state_dict(a.state_dict())
    assert [a.update(k, 32) for k in (7.0, 0.1)] == [b.update(k, 32) for k in (7.0, 0.1)]
    f = FixedKLController(0.0)
    f.load_state_dict({"value": 0.7})
    assert f.value == 0.7


@pytest.mark.parametrize(
    ("value", "target", "horizon", "message"),
    [
        (-0.1, 1.0, 10.0, r"kl_coef: expected a finite β ≥ 0, got -0\.1"),
        (0.1, 0.0, 10.0, r"kl\.target: expected a finite value > 0, got 0\.0"),
        (0.1, 1.0, 0.0, r"kl\.horizon: expected a finite value > 0, got 0\.0"),
        (math.nan, 1.0, 10.0, r"kl_coef: expected a finite β ≥ 0, got nan"),
        (0.1, math.inf, 10.0, r"kl\.target: expected a finite value > 0, got inf"),
    ],
    ids=["negative-beta", "zero-target", "zero-horizon", "nan-beta", "inf-target"],
)
def test_invalid_parameters_raise(value: float, target: float, horizon: float, message: str) -> None:
    # each bad argument must be refused by its own check (named in the message)
    with pytest.raises(HyperparameterError, match=message):
        AdaptiveKLController(value, target=target, horizon=horizon)


def test_non_finite_kl_raises() -> None:
    with pytest.raises(HyperparameterError, match="not finite"):
        AdaptiveKLController(0.1, target=1.0, horizon=10.0).update(math.nan, 8)


def test_negative_n_steps_raises() -> None:
    with pytest.raises(HyperparameterError, match="n_steps must be ≥ 0, got -1"):
        AdaptiveKLController(0.1, target=1.0, horizon=10.0).update(1.0, -1)


def test_factory_picks_the_kind() -> None:
    assert isinstance(make_kl_controller(0.1, adaptive=True, target=1.0, horizon=10.0), AdaptiveKLController)
    assert isinstance(make_kl_controller(0.1, adaptive=False, target=1.0, horizon=10.0), FixedKLController)
