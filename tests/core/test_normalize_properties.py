"""Properties of the peers' normalisations (refppo/core/normalize.py): centring gives a zero masked
mean, scaling a unit mean square, the eps forms order as they should, junk on padding never leaks,
and the vectorized function equals its naive twin."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from strategies import Ragged, assert_twin_close, ragged_batches

from refppo.core.normalize import normalize, normalize_naive

pytestmark = pytest.mark.property

KINDS = ("none", "masked", "masked_no_shift", "center", "scale")
EPS_AT = ("variance", "clamp", "std")


def _spread_ok(b: Ragged, x: torch.Tensor) -> bool:
    std = float(x[b.mask].double().std(unbiased=False)) if b.n_valid > 1 else 0.0
    return std >= (1e-9 if b.dtype == torch.float64 else 5e-2)


@given(ragged_batches(min_total_valid=2), st.sampled_from(KINDS), st.sampled_from(EPS_AT), st.booleans())
def test_normalize_matches_naive_and_ignores_junk(b: Ragged, kind: str, eps_at: str, unbiased: bool) -> None:
    x = b.floats(-3.0, 3.0)
    assume(_spread_ok(b, x))
    got = normalize(x, b.mask, kind, unbiased=unbiased, eps=1e-6, eps_at=eps_at)
    assert_twin_close(
        got, normalize_naive(x, b.mask, kind, unbiased=unbiased, eps=1e-6, eps_at=eps_at), b.dtype
    )
    other = normalize(b.with_junk(x, "huge"), b.mask, kind, unbiased=unbiased, eps=1e-6, eps_at=eps_at)
    assert torch.equal(got, other)  # padding junk changes nothing, bit for bit
    assert bool((got[~b.mask] == 0).all())


@given(ragged_batches(min_total_valid=2, dtypes=(torch.float64,)), st.sampled_from(EPS_AT))
def test_center_has_zero_mean_and_keeps_the_spread(b: Ragged, eps_at: str) -> None:
    x = b.floats(-3.0, 3.0)
    out = normalize(x, b.mask, "center", eps_at=eps_at)
    assert abs(float(out[b.mask].mean())) < 1e-12
    torch.testing.assert_close(out[b.mask] - out[b.mask][0], x[b.mask] - x[b.mask][0])


@given(ragged_batches(min_total_valid=2, dtypes=(torch.float64,)), st.booleans())
def test_scale_has_unit_mean_square_and_keeps_the_sign(b: Ragged, unbiased: bool) -> None:
    x = b.floats(-3.0, 3.0)
    assume(float(x[b.mask].abs().max()) > 1e-3)
    out = normalize(x, b.mask, "scale", unbiased=unbiased, eps=0.0)
    d = b.n_valid - 1 if unbiased else b.n_valid
    assert abs(float((out[b.mask] ** 2).sum()) / d - 1.0) < 1e-9
    assert bool(((out[b.mask] > 0) == (x[b.mask] > 0)).all())


@given(ragged_batches(min_total_valid=2, dtypes=(torch.float64,)), st.floats(1e-4, 1.0))
def test_eps_forms_shrink_in_order(b: Ragged, eps: float) -> None:
    """|std form| ≤ |variance form| ≤ |clamp form| ≤ |no eps|, since σ + ε ≥ sqrt(σ² + ε) ≥ max(σ, √ε)."""
    x = b.floats(-3.0, 3.0)
    assume(_spread_ok(b, x))
    a = {e: normalize(x, b.mask, "masked", eps=eps, eps_at=e)[b.mask].abs() for e in EPS_AT}
    raw = normalize(x, b.mask, "masked", eps=0.0)[b.mask].abs()
    tol = 1e-12
    assert bool((a["std"] <= a["variance"] + tol).all())
    assert bool((a["variance"] <= a["clamp"] + tol).all())
    assert bool((a["clamp"] <= raw + tol).all())
