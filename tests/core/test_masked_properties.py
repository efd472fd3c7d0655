"""Properties of the masked reductions and whitening (refppo/core/masked.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from strategies import Ragged, assert_exactly_equal, assert_twin_close, ragged_batches

from refppo.core.masked import (
    masked_mean,
    masked_mean_naive,
    masked_sum,
    masked_sum_naive,
    masked_var,
    masked_var_naive,
    masked_whiten,
    masked_whiten_naive,
)

pytestmark = pytest.mark.property


def _spread_ok(b: Ragged, x: torch.Tensor) -> bool:
    """Non-degenerate variance: float32 whitening amplifies the mean's rounding by 1/std."""
    std = float(x[b.mask].double().std(unbiased=False)) if b.n_valid > 1 else 0.0
    return std >= (1e-9 if b.dtype == torch.float64 else 5e-2)


@given(ragged_batches())
def test_masked_sum_and_mean_match_naive(b: Ragged) -> None:
    x = b.floats(-3.0, 3.0)
    for dim in (None, -1):
        assert_twin_close(
            masked_sum(x, b.mask, dim=dim), masked_sum_naive(x, b.mask, dim=dim), b.dtype, "sum"
        )
        assert_twin_close(
            masked_mean(x, b.mask, dim=dim), masked_mean_naive(x, b.mask, dim=dim), b.dtype, "mean"
        )


@given(ragged_batches(min_total_valid=2), st.booleans())
def test_masked_var_matches_naive(b: Ragged, unbiased: bool) -> None:
    x = b.floats(-3.0, 3.0)
    assert_twin_close(
        masked_var(x, b.mask, unbiased=unbiased),
        masked_var_naive(x, b.mask, unbiased=unbiased),
        b.dtype,
        "var",
    )


@given(ragged_batches(min_total_valid=2), st.booleans(), st.booleans())
def test_masked_whiten_matches_naive(b: Ragged, unbiased: bool, shift_mean: bool) -> None:
    x = b.floats(-3.0, 3.0)
    assume(_spread_ok(b, x))
    got = masked_whiten(x, b.mask, unbiased=unbiased, shift_mean=shift_mean)
    want = masked_whiten_naive(x, b.mask, unbiased=unbiased, shift_mean=shift_mean)
    assert_twin_close(got, want, b.dtype, "whiten")


@given(ragged_batches(min_total_valid=2), st.sampled_from(["nan", "inf", "-inf", "huge", "mixed"]))
def test_masked_steps_padding_invariant(b: Ragged, other_junk: str) -> None:
    x = b.valid(-3.0, 3.0)
    x1, x2 = b.with_junk(x), b.with_junk(x, other_junk)
    for dim in (None, -1):
        assert_exactly_equal(masked_sum(x1, b.mask, dim=dim), masked_sum(x2, b.mask, dim=dim), what="sum")
        assert_exactly_equal(masked_mean(x1, b.mask, dim=dim), masked_mean(x2, b.mask, dim=dim), what="mean")
    assert_exactly_equal(masked_var(x1, b.mask), masked_var(x2, b.mask), what="var")
    w1, w2 = masked_whiten(x1, b.mask), masked_whiten(x2, b.mask)
    assert_exactly_equal(w1, w2, what="whiten")
    assert bool((w1[~b.mask] == 0).all()), "whitened output must be 0 on padding"
    assert bool(torch.isfinite(w1).all())


@given(ragged_batches(min_total_valid=2))
def test_masked_steps_batch_permutation_equivariant(b: Ragged) -> None:
    x = b.floats(-3.0, 3.0)
    perm = torch.randperm(b.B, generator=b.gen)
    xp, mp = x[perm], b.mask[perm]
    # Row-wise results permute exactly; batch-wide reductions are permutation invariant up to
    # summation order (so within the twin tolerance).
    assert_exactly_equal(masked_sum(xp, mp, dim=-1), masked_sum(x, b.mask, dim=-1)[perm], what="sum_row")
    assert_exactly_equal(masked_mean(xp, mp, dim=-1), masked_mean(x, b.mask, dim=-1)[perm], what="mean_row")
    assert_twin_close(masked_sum(xp, mp), masked_sum(x, b.mask), b.dtype, "sum")
    assert_twin_close(masked_var(xp, mp), masked_var(x, b.mask), b.dtype, "var")
    assume(_spread_ok(b, x))
    assert_twin_close(masked_whiten(xp, mp), masked_whiten(x, b.mask)[perm], b.dtype, "whiten")


@given(ragged_batches(min_total_valid=2, dtypes=(torch.float64,)), st.booleans())
def test_whitened_advantages_have_zero_mean_unit_variance(b: Ragged, unbiased: bool) -> None:
    x = b.floats(-5.0, 5.0)
    assume(_spread_ok(b, x))
    v = x[b.mask]
    var = float(v.var(unbiased=unbiased))
    assume(var > 1e-4)
    w = masked_whiten(x, b.mask, unbiased=unbiased)[b.mask]
    assert abs(float(w.mean())) < 1e-10
    # With eps = 1e-8 the whitened variance is var/(var + eps) = 1 − eps/var + O(eps²).
    assert abs(float(w.var(unbiased=unbiased)) - var / (var + 1e-8)) < 1e-10
    assert abs(float(w.var(unbiased=unbiased)) - 1.0) < 1e-4


@given(ragged_batches(min_total_valid=2, dtypes=(torch.float64,)))
def test_whiten_without_mean_shift_keeps_the_mean(b: Ragged) -> None:
    x = b.floats(-5.0, 5.0)
    assume(_spread_ok(b, x) and float(x[b.mask].var()) > 1e-4)
    w = masked_whiten(x, b.mask, shift_mean=False)[b.mask]
    assert abs(float(w.mean()) - float(x[b.mask].mean())) < 1e-10
    assert abs(float(w.var()) - 1.0) < 1e-4
