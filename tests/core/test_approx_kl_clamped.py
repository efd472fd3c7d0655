"""The ``approx_kl`` of the clamped log-ratio (refppo/core/approx_kl.py, ``ApproxKL.k1_clamped``, RLinf
0.3.0 ``compute_ppo_actor_loss``): equal to its naive twin, a hand-worked vector, equal to ``k1``
when the clamp does not bind, the pipeline stage and its naive twin agree, refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import Ragged, assert_twin_close, ragged_batches

from refppo.core.approx_kl import approx_kl_k1_clamped, approx_kl_k1_clamped_naive
from refppo.errors import HyperparameterError
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.stages import BY_NAME

pytestmark = pytest.mark.property

_KAPPA = st.one_of(st.none(), st.floats(0.05, 3.0))


@given(ragged_batches(), _KAPPA)
def test_k1_clamped_matches_naive(b: Ragged, kappa: float | None) -> None:
    lp, old = b.floats(-4.0, 0.0), b.floats(-4.0, 0.0)
    want = torch.tensor(approx_kl_k1_clamped_naive(lp, old, b.mask, kappa), dtype=torch.float64)
    assert_twin_close(approx_kl_k1_clamped(lp, old, b.mask, kappa), want, b.dtype, "k1_clamped")


@given(ragged_batches(dtypes=(torch.float64,)), st.floats(0.05, 3.0))
def test_k1_clamped_is_k1_where_the_clamp_does_not_bind(b: Ragged, kappa: float) -> None:
    lp, old = b.floats(-4.0, 0.0), b.floats(-4.0, 0.0)
    d = torch.where(b.mask, lp - old, 0.0)
    k1 = float(-d.sum() / b.mask.sum())
    assert abs(float(approx_kl_k1_clamped(lp, old, b.mask, None)) - k1) <= 1e-12
    wide = float(d.abs().max()) + kappa  # never binds
    assert abs(float(approx_kl_k1_clamped(lp, old, b.mask, wide)) - k1) <= 1e-12


def test_k1_clamped_hand_worked() -> None:
    # d = [2.0, -0.5, -3.0 | padding], κ = 1: clamp → [1.0, −0.5, −1.0], −Σ/3 = 0.5/3
    lp = torch.tensor([[2.0, -0.5], [-3.0, 99.0]], dtype=torch.float64)
    old = torch.zeros(2, 2, dtype=torch.float64)
    m = torch.tensor([[True, True], [True, False]])
    assert abs(float(approx_kl_k1_clamped(lp, old, m, 1.0)) - 0.5 / 3) <= 1e-15
    assert abs(float(approx_kl_k1_clamped(lp, old, m, None)) - 1.5 / 3) <= 1e-15  # unclamped: −(−1.5)/3
    assert float(approx_kl_k1_clamped(lp, old, torch.zeros(2, 2, dtype=torch.bool), 1.0)) == 0.0  # n = 0 → 1


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_k1_clamped_refuses_a_bad_clamp(bad: float) -> None:
    x = torch.zeros(1, 2, dtype=torch.float64)
    m = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(HyperparameterError, match="log_ratio_clamp"):
        approx_kl_k1_clamped(x, x, m, bad)
    with pytest.raises(HyperparameterError, match="log_ratio_clamp"):
        approx_kl_k1_clamped_naive(x, x, m, bad)


@given(ragged_batches(dtypes=(torch.float64,)), st.floats(0.05, 1.0))
def test_the_approx_kl_stage_reads_the_clamp_under_k1_clamped(b: Ragged, kappa: float) -> None:
    """The stage (vectorised and naive) under ``approx_kl=k1_clamped`` is the core function with
    ``κ = log_ratio_clamp``; under ``k1`` it is the policy stage's unclamped mean."""
    lp, old = b.floats(-4.0, 0.0), b.floats(-4.0, 0.0)
    q = {"logprobs": lp, "old_logprobs": old, "mask": b.mask, "pg_approx_kl": torch.tensor(12.5)}
    stage = BY_NAME["approx_kl"]
    conv = Convention.of(approx_kl="k1_clamped", log_ratio_clamp=kappa)
    want = float(approx_kl_k1_clamped(lp, old, b.mask, kappa))
    for naive in (False, True):
        got = stage.run(q, conv, Hyperparams(), naive=naive)["approx_kl"]
        assert abs(float(got) - want) <= 1e-12, naive
    k1 = Convention.of(approx_kl="k1", log_ratio_clamp=kappa)
    assert float(stage.run(q, k1, Hyperparams())["approx_kl"]) == 12.5
