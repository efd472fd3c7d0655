"""Shared Hypothesis strategies: ragged, right-padded ``[B, T]`` batches with junk on the padding.

Hypothesis draws the *structure* (B in 1..16, T in 1..64, every row's length — biased towards
length-1 and full rows —, the dtype, the kind of junk, a seed); the float values themselves come
from a seeded ``torch.Generator``. That keeps generation fast at T=64 and every example
reproducible from what Hypothesis prints, and shrinking still works on B, T, the lengths and the
seed.

Junk kinds written into padded positions: ``nan``, ``inf``, ``-inf``, ``huge`` (±1e30) and
``mixed`` (a random mix of all of those and large random numbers).

Also here: :func:`assert_twin_close`, the one comparison every "vectorized == naive twin" test
uses. Its tolerances are :data:`refppo.verify.tolerance.TOLERANCES` (also used by ``refppo verify``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st
from torch import Tensor

from refppo.verify.tolerance import compare, tolerance_for

DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64)
JUNK_KINDS: tuple[str, ...] = ("nan", "inf", "-inf", "huge", "mixed")


def junk_like(mask: Tensor, dtype: torch.dtype, kind: str, gen: torch.Generator) -> Tensor:
    """A ``[B, T]`` tensor of junk of the given ``kind`` (only meant for padded positions)."""
    shape = tuple(mask.shape)
    if kind == "nan":
        return torch.full(shape, math.nan, dtype=dtype)
    if kind == "inf":
        return torch.full(shape, math.inf, dtype=dtype)
    if kind == "-inf":
        return torch.full(shape, -math.inf, dtype=dtype)
    if kind == "huge":
        sign = torch.randint(0, 2, shape, generator=gen).to(torch.float64) * 2 - 1
        return (sign * 1e30).to(dtype)
    if kind == "mixed":
        choices = torch.tensor([math.nan, math.inf, -math.inf, 1e30, -1e30, 0.0], dtype=torch.float64)
        pick = choices[torch.randint(0, len(choices), shape, generator=gen)]
        big = torch.randn(shape, generator=gen, dtype=torch.float64) * 1e6
        return torch.where(pick == 0.0, big, pick).to(dtype)
    raise ValueError(f"unknown junk kind {kind!r}")


@dataclass
class Ragged:
    """A drawn ragged batch. ``mask`` is bool ``[B, T]``, right-padded, every row non-empty."""

    lengths: tuple[int, ...]
    T: int
    dtype: torch.dtype
    junk: str
    seed: int
    gen: torch.Generator = field(init=False, repr=False)
    mask: Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.gen = torch.Generator().manual_seed(self.seed)
        lengths = torch.tensor(self.lengths)
        self.mask = torch.arange(self.T).unsqueeze(0) < lengths.unsqueeze(1)

    @property
    def B(self) -> int:  # noqa: N802  (B is the batch axis name used everywhere)
        return len(self.lengths)

    @property
    def n_valid(self) -> int:
        return int(sum(self.lengths))

    def valid(self, low: float = -1.0, high: float = 1.0) -> Tensor:
        """``[B, T]`` uniform in ``[low, high)`` everywhere (no junk), in :attr:`dtype`."""
        x = torch.rand((self.B, self.T), generator=self.gen, dtype=torch.float64) * (high - low) + low
        return x.to(self.dtype)

    def floats(self, low: float = -1.0, high: float = 1.0, junk: str | None = None) -> Tensor:
        """Uniform ``[low, high)`` at valid positions, junk (``junk`` or the drawn kind) on padding."""
        x = self.valid(low, high)
        return self.with_junk(x, junk)

    def with_junk(self, x: Tensor, junk: str | None = None) -> Tensor:
        """``x`` with its padded positions overwritten by junk (a new tensor)."""
        j = junk_like(self.mask, x.dtype, junk or self.junk, self.gen)
        return torch.where(self.mask, x, j)

    def scores(self, low: float = -5.0, high: float = 5.0) -> Tensor:
        """``[B]`` uniform scores."""
        x = torch.rand(self.B, generator=self.gen, dtype=torch.float64) * (high - low) + low
        return x.to(self.dtype)

    def normal(self, *shape: int, scale: float = 1.0) -> Tensor:
        """Gaussian tensor of any shape in :attr:`dtype`."""
        return (torch.randn(shape, generator=self.gen, dtype=torch.float64) * scale).to(self.dtype)


@st.composite
def ragged_batches(
    draw: st.DrawFn,
    *,
    min_B: int = 1,
    max_B: int = 16,
    min_T: int = 1,
    max_T: int = 64,
    dtypes: tuple[torch.dtype, ...] = DTYPES,
    min_total_valid: int = 1,
) -> Ragged:
    """Ragged right-padded batches: B in [min_B, max_B], T in [min_T, max_T], lengths in 1..T.

    Lengths are biased towards 1 and T so that length-1 responses and full rows show up often.
    ``min_total_valid`` (e.g. 2 for an unbiased variance) is enforced by lengthening rows.
    """
    B = draw(st.integers(min_B, max_B), label="B")
    T = draw(st.integers(min_T, max_T), label="T")
    T = max(T, -(-min_total_valid // B))  # room for min_total_valid tokens
    length = st.one_of(st.just(1), st.just(T), st.integers(1, T))
    lengths = draw(st.lists(length, min_size=B, max_size=B), label="lengths")
    for i in range(B):  # lengthen rows in order until min_total_valid tokens are valid
        lengths[i] = min(T, lengths[i] + max(0, min_total_valid - sum(lengths)))
    dtype = draw(st.sampled_from(dtypes), label="dtype")
    junk = draw(st.sampled_from(JUNK_KINDS), label="junk")
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    return Ragged(lengths=tuple(lengths), T=T, dtype=dtype, junk=junk, seed=seed)


def assert_twin_close(actual: Tensor, expected: Tensor, dtype: torch.dtype, what: str = "") -> None:
    """Vectorized ``actual`` equals naive ``expected`` within :data:`refppo.verify.tolerance.TOLERANCES`."""
    c = compare(actual, expected, dtype)
    tol = tolerance_for(dtype)
    assert c.ok, (
        f"{what}: vectorized vs naive differ beyond {tol} for {dtype}: "
        f"max abs {c.max_abs:.3e}, max rel {c.max_rel:.3e}\nvectorized={actual}\nnaive={expected}"
    )


def assert_exactly_equal(a: Tensor, b: Tensor, mask: Tensor | None = None, what: str = "") -> None:
    """Bitwise-equal values (at ``mask`` positions if given); NaN equals NaN."""
    x, y = a.detach(), b.detach()
    if mask is not None:
        x, y = x[mask], y[mask]
    assert x.shape == y.shape, f"{what}: shapes {tuple(x.shape)} vs {tuple(y.shape)}"
    assert torch.equal(torch.isnan(x), torch.isnan(y)), f"{what}: NaN patterns differ"
    nn = ~torch.isnan(x)
    assert torch.equal(x[nn], y[nn]), f"{what}: not exactly equal\n{x}\n{y}"


def assert_grad_close(
    auto: Tensor | None, twin: Tensor, mask: Tensor, dtype: torch.dtype, what: str, ties: Tensor | None = None
) -> None:
    """Autograd gradient ``auto`` equals a closed-form twin (refppo/core/grad.py).

    Exactly 0 on both sides where ``mask`` is False; elsewhere :func:`assert_twin_close` after
    dividing both by ``max|twin|`` (gradients are ``O(1/N)``: the tolerance is taken relative to the
    largest entry); at ``ties`` (forced exact ties), per token ``|auto − twin| ≤ rtol·|twin|``, so a
    half where the twin says whole (or the reverse) fails even on a small entry.
    """
    assert auto is not None, f"{what}: autograd gave no gradient"
    assert bool((auto[~mask] == 0).all()), f"{what}: autograd gradient on padding"
    assert bool((twin[~mask] == 0).all()), f"{what}: twin gradient on padding"
    scale = float(twin.abs().max()) or 1.0
    assert_twin_close(auto.to(torch.float64) / scale, twin / scale, dtype, what)
    if ties is not None and bool(ties.any()):
        rtol = tolerance_for(dtype).rtol
        a, e = auto.to(torch.float64)[ties], twin[ties]
        bad = (a - e).abs() > rtol * e.abs()
        assert not bool(bad.any()), (
            f"{what}: at forced ties autograd {a[bad].tolist()} vs twin {e[bad].tolist()}"
        )
