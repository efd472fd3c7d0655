"""Unit tests of refppo/core/masked.py: hand-worked examples and every validation error path."""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from refppo.core.masked import masked_mean, masked_moments, masked_sum, masked_var, masked_whiten
from refppo.errors import DtypeError, MaskError, ShapeError

NAN = float("nan")
# Two rows: valid values 1, 2 | 4; padding holds NaN and inf.
X = torch.tensor([[1.0, 2.0, NAN], [4.0, float("inf"), NAN]], dtype=torch.float64)
M = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_masked_sum_and_mean_hand_example() -> None:
    # valid values 1, 2, 4: sum 7, mean 7/3; per row: sums 3 and 4, means 1.5 and 4.
    assert float(masked_sum(X, M)) == 7.0
    assert masked_sum(X, M, dim=-1).tolist() == [3.0, 4.0]
    assert float(masked_mean(X, M)) == pytest.approx(7 / 3, abs=1e-15)
    assert masked_mean(X, M, dim=-1).tolist() == [1.5, 4.0]


def test_masked_var_hand_example() -> None:
    # mean 7/3; deviations −4/3, −1/3, 5/3; squares 16/9 + 1/9 + 25/9 = 42/9 = 14/3.
    # unbiased: (14/3)/2 = 7/3; population: (14/3)/3 = 14/9.
    assert float(masked_var(X, M)) == pytest.approx(7 / 3, abs=1e-14)
    assert float(masked_var(X, M, unbiased=False)) == pytest.approx(14 / 9, abs=1e-14)


def test_masked_whiten_hand_example() -> None:
    # valid values 1, 3: mean 2, unbiased variance ((−1)² + 1²)/1 = 2 -> (x − 2)/sqrt(2 + 1e-8).
    x = torch.tensor([[1.0, NAN], [3.0, 5.0]], dtype=torch.float64)
    m = torch.tensor([[True, False], [True, False]])
    s = 1 / math.sqrt(2 + 1e-8)
    assert masked_whiten(x, m).flatten().tolist() == pytest.approx([-s, 0.0, s, 0.0], abs=1e-15)
    # shift_mean=False adds the mean back: 2 ∓ 1/sqrt(2).
    assert masked_whiten(x, m, shift_mean=False).flatten().tolist() == pytest.approx(
        [2 - s, 0.0, 2 + s, 0.0], abs=1e-15
    )


def test_mask_with_values_other_than_0_1_is_rejected() -> None:
    with pytest.raises(MaskError, match=r"mask: expected only 0/1 values, found 2\.0 at position \[0, 1\]"):
        masked_mean(X, torch.tensor([[1, 2, 0], [1, 0, 0]]))


def test_mask_with_nonfinite_float_entries_is_rejected() -> None:
    with pytest.raises(
        MaskError, match=re.escape("mask: expected only 0/1 values, found non-finite entries")
    ):
        masked_sum(X, torch.tensor([[1.0, NAN, 0.0], [1.0, 0.0, 0.0]]))


def test_mask_row_without_valid_token_is_rejected() -> None:
    with pytest.raises(MaskError, match=r"mask: rows \[1\] have no valid token"):
        masked_mean(X, torch.tensor([[1, 1, 0], [0, 0, 0]]))


def test_mask_with_wrong_number_of_dims_is_rejected() -> None:
    with pytest.raises(ShapeError, match=r"mask: expected 2 dims \[B, T\] \(batch, resp\), got shape \[6\]"):
        masked_sum(X.flatten(), M.flatten())


def test_mask_with_zero_response_positions_is_rejected() -> None:
    with pytest.raises(
        ShapeError, match=r"mask: expected at least one response position \(T >= 1\), got shape \[2, 0\]"
    ):
        masked_sum(torch.zeros(2, 0), torch.zeros(2, 0, dtype=torch.bool))


def test_mask_that_is_not_a_tensor_is_rejected() -> None:
    with pytest.raises(MaskError, match=re.escape("mask: expected a torch.Tensor, got list")):
        masked_sum(X, [[1, 1, 0], [1, 0, 0]])  # type: ignore[arg-type]  # the error path under test


def test_x_with_wrong_shape_names_tensor_and_shapes() -> None:
    with pytest.raises(
        ShapeError, match=r"x: expected shape \[B, T\] = \[2, 3\] \(batch, resp\), got \[2, 4\]"
    ):
        masked_mean(torch.zeros(2, 4), M)


def test_integer_x_is_rejected() -> None:
    with pytest.raises(
        DtypeError, match=re.escape("x: expected a floating-point tensor, got dtype torch.int64")
    ):
        masked_sum(torch.ones(2, 3, dtype=torch.int64), M)


def test_unbiased_variance_of_one_token_is_rejected() -> None:
    with pytest.raises(
        MaskError, match=re.escape("an unbiased variance needs at least 2 valid tokens, got 1")
    ):
        masked_var(X[:1], torch.tensor([[1, 0, 0]]))
    with pytest.raises(MaskError, match=re.escape("at least 2 valid tokens")):
        masked_whiten(X[:1], torch.tensor([[1, 0, 0]]))


# ----------------------------------------------------------------------------------------------
# all_reduce: global moments across ranks, simulated with one thread per rank.
# ----------------------------------------------------------------------------------------------


def _run_ranks(shards: list[tuple[torch.Tensor, torch.Tensor]], fn: Any) -> list[Any]:
    """Call ``fn(x, mask, all_reduce)`` on every shard, one thread per simulated rank.

    ``all_reduce`` is a blocking SUM collective over the threads (rank order, so every rank gets
    the same bits), like ``torch.distributed.all_reduce`` on a process group.
    """
    world = len(shards)
    barrier = threading.Barrier(world, timeout=30)
    slots: list[torch.Tensor | None] = [None] * world
    calls = [0] * world

    def hook(rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            calls[rank] += 1
            slots[rank] = t.clone()
            barrier.wait()
            total = slots[0]
            assert total is not None
            for s in slots[1:]:
                assert s is not None
                total = total + s
            barrier.wait()  # every rank has read every slot before any is overwritten
            t.copy_(total)
            return t

        return all_reduce

    with ThreadPoolExecutor(world) as pool:
        futures = [pool.submit(fn, x, m, hook(r)) for r, (x, m) in enumerate(shards)]
        out = [f.result() for f in futures]
    assert len(set(calls)) == 1 and calls[0] > 0  # same number of collectives on every rank
    return out


def _sharded_batch(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """7 ragged rows (NaN padding), split 3 | 4 with different token counts and distributions."""
    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 3, 2, 6, 4, 1]
    T = max(lengths)
    m = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    x = torch.randn(len(lengths), T, generator=g, dtype=torch.float64)
    x[3:] = 3.0 + 2.5 * x[3:]  # rank 1's shard: another mean and scale, so per-rank whitening differs
    x = torch.where(m, x, torch.full_like(x, NAN)).to(dtype)
    return x, m, [3, 4]


# Measured on this batch: the sharded result is bit-identical to the whole-batch one in both dtypes.
# The tolerances allow the few ulps of μ and σ² that another summation order (per-rank partial
# sums) may cost, scaled by |x − μ|/σ ≲ 3: ~1e-15 (float64), ~5e-7 (float32). A real error (local
# moments, N instead of N − 1) is ≥ 1e-2 here.
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-14), (torch.float32, 1e-6)])
@pytest.mark.parametrize("shift_mean", [True, False])
@pytest.mark.parametrize("unbiased", [True, False])
def test_masked_whiten_with_all_reduce_equals_whitening_the_concatenated_batch(
    unbiased: bool, shift_mean: bool, dtype: torch.dtype, tol: float
) -> None:
    x, m, sizes = _sharded_batch(dtype)
    cut = sizes[0]
    shards = [(x[:cut], m[:cut]), (x[cut:], m[cut:])]
    whole = masked_whiten(x, m, shift_mean=shift_mean, unbiased=unbiased)

    def whiten(xs: torch.Tensor, ms: torch.Tensor, ar: Any) -> torch.Tensor:
        return masked_whiten(xs, ms, shift_mean=shift_mean, unbiased=unbiased, all_reduce=ar)

    glob = torch.cat(_run_ranks(shards, whiten))
    assert glob.dtype == dtype
    assert float((glob - whole).abs().max()) <= tol
    assert bool((glob[~m] == 0).all())
    # moments: the global mean/variance are those of the concatenated batch
    mu, var = masked_moments(x, m, unbiased=unbiased)
    for mu_r, var_r in _run_ranks(
        shards, lambda a, b, ar: masked_moments(a, b, unbiased=unbiased, all_reduce=ar)
    ):
        assert abs(float(mu_r - mu)) <= tol and abs(float(var_r - var)) <= tol * float(var)
    for var_r in _run_ranks(shards, lambda a, b, ar: masked_var(a, b, unbiased=unbiased, all_reduce=ar)):
        assert abs(float(var_r - masked_var(x, m, unbiased=unbiased))) <= tol * float(var)
    # control: per-rank whitening (no hook) is NOT the global whitening
    local = torch.cat([masked_whiten(a, b, shift_mean=shift_mean, unbiased=unbiased) for a, b in shards])
    assert float((local - whole).abs().max()) > 0.1


def test_masked_moments_without_all_reduce_is_bit_identical_to_the_single_process_formulas() -> None:
    x, m, _ = _sharded_batch(torch.float64)
    for unbiased in (True, False):
        mu, var = masked_moments(x, m, unbiased=unbiased)
        assert torch.equal(mu, masked_sum(x, m) / m.sum().to(x.dtype))
        assert torch.equal(var, masked_var(x, m, unbiased=unbiased))
        out = masked_whiten(x, m, unbiased=unbiased)
        assert torch.equal(out, torch.where(m, (x - mu) * torch.rsqrt(var + 1e-8), torch.zeros(())))


def test_unbiased_variance_with_all_reduce_counts_tokens_over_all_ranks() -> None:
    one = (X[:1], torch.tensor([[1, 0, 0]]))
    # one token on each of 2 ranks: 2 valid tokens globally, so the unbiased variance exists
    (v0, v1) = _run_ranks([one, one], lambda a, b, ar: masked_var(a, b, all_reduce=ar))
    assert float(v0) == float(v1) == 0.0
    # one token in all (a single rank): rejected, naming the global count
    with pytest.raises(MaskError, match=re.escape("at least 2 valid tokens (over all ranks), got 1")):
        _run_ranks([one], lambda a, b, ar: masked_whiten(a, b, all_reduce=ar))
