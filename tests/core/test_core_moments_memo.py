"""``refppo/core/moments_memo.py``: within ``remembered_moments`` the normalisations of one tensor
share its batch moments and their bit-identical outputs; every output is the one computed without
the memo, bit for bit (the ``--detect`` reward step relies on it: spec/conventions.md, "How
`--detect` whitens one raw reward many ways")."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import refppo.core.moments_memo as mm
from refppo.conventions import Variance, WhitenEps, Whitening
from refppo.core.normalize import normalize, normalize_naive
from refppo.errors import MaskError

KINDS = [w.value for w in Whitening]
OPTS = [(k, v is Variance.UNBIASED, e.value) for k in KINDS for v in Variance for e in WhitenEps]


def _bits(t: torch.Tensor) -> bytes:
    """The tensor's bytes (``torch.equal`` does not tell -0.0 from 0.0)."""
    return t.contiguous().numpy().tobytes()


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    scale=st.sampled_from([1e-5, 1e-3, 1.0, 1e4]),
    eps=st.sampled_from([0.0, 1e-8, 1e-5, 1.0]),
)
def test_every_normalisation_under_the_memo_is_the_one_without_it(
    seed: int, dtype: torch.dtype, scale: float, eps: float
) -> None:
    """Every kind × variance × eps placement, in a shuffled order and each twice, on one tensor: the
    memo's outputs equal the plain calls' bytes (and the naive twin's values), and it did share."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(5, 9, generator=g, dtype=torch.float64) * scale).to(dtype)
    x[0, 0] = -0.0
    m = torch.rand(5, 9, generator=g) < 0.7
    m[:, 0] = True
    order = OPTS * 2
    random.Random(seed).shuffle(order)
    memo: mm.Memo = {}
    n_calls = 0
    real = mm.memoized

    def counting(*a: object, **k: object) -> object:
        nonlocal n_calls
        n_calls += 1
        return real(*a, **k)  # type: ignore[arg-type]  # a pass-through spy

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("refppo.core.normalize.memoized", counting)
        for kind, unbiased, at in order:
            with mm.remembered_moments(memo):
                got = normalize(x, m, kind, unbiased=unbiased, eps=eps, eps_at=at)
            plain = normalize(x, m, kind, unbiased=unbiased, eps=eps, eps_at=at)
            assert _bits(got) == _bits(plain), (kind, unbiased, at)
            naive = normalize_naive(x.double(), m, kind, unbiased=unbiased, eps=eps, eps_at=at)
            close = torch.isclose(got.double(), naive, rtol=1e-4, atol=1e-6 * scale) | ~m
            assert bool(close.all()) or not bool(torch.isfinite(naive).all()), (kind, unbiased, at)
    assert n_calls > 0
    assert (
        sum(1 for v in memo.values() if v[3].__class__ is torch.Tensor and v[3].dim() > 0) <= mm.KEEP_OUTPUTS
    )


def test_an_in_place_change_is_not_answered_from_the_memo() -> None:
    """The memo keys the tensor objects by identity: a change in place (its version counter moves)
    makes the moments and the output again."""
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
    m = torch.ones(2, 3, dtype=torch.bool)
    memo: mm.Memo = {}
    with mm.remembered_moments(memo):
        before = normalize(x, m, "center")
        x.add_(1.0)
        after = normalize(x, m, "center")
        out = normalize(x, m, "masked")
        out.mul_(0.0)  # a caller that writes into an output: the next call makes it again
        again = normalize(x, m, "masked")
    assert torch.equal(before, after)  # centring removes the shift: the same values, made again
    assert float(after[0, 0]) == -2.5
    assert torch.equal(again, normalize(x, m, "masked"))
    assert float(again.abs().sum()) > 0.0


def test_the_center_output_is_shared_across_variances_and_the_checks_still_run() -> None:
    """``center`` reads no variance: the six center options of one tensor return one output; an
    unbiased variance of one valid token is still refused on every call (errors are not
    remembered)."""
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    m = torch.tensor([[True, True], [True, False]])
    memo: mm.Memo = {}
    with mm.remembered_moments(memo):
        outs = [normalize(x, m, "center", unbiased=u, eps_at=e.value) for u, e in itertools.product(
            (True, False), WhitenEps)]  # fmt: skip
    assert all(o is outs[0] for o in outs)
    x1, one = x[:1], torch.tensor([[True, False]])
    with mm.remembered_moments({}):
        for _ in range(2):
            with pytest.raises(MaskError, match="unbiased"):
                normalize(x1, one, "center", unbiased=True)
