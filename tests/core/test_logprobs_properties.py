"""Properties of log-probs and entropy from logits (refppo/core/logprobs.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from strategies import Ragged, assert_exactly_equal, assert_twin_close, junk_like, ragged_batches

from refppo.core.logprobs import (
    entropy_from_logits,
    entropy_from_logits_naive,
    logprobs_from_logits,
    logprobs_from_logits_naive,
)

pytestmark = pytest.mark.property

temperatures = st.sampled_from([1.0, 0.7, 1.3, 0.25, 1e-2])


def _well_conditioned(b: Ragged, temperature: float) -> bool:
    # In float32, z = logits/τ is itself rounded by |z|·u; at τ = 0.01 (|z| ~ 1e3) that input
    # perturbation alone exceeds the float32 tolerance, whatever the implementation. float64 only.
    return b.dtype == torch.float64 or temperature >= 0.25


vocab_sizes = st.integers(2, 16)


def _logits_and_tokens(b: Ragged, V: int, junk: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    logits = b.normal(b.B, b.T, V, scale=3.0)
    tokens = torch.randint(0, V, (b.B, b.T), generator=b.gen)
    return _junk_padding(b, logits, tokens, junk)


def _junk_padding(
    b: Ragged, logits: torch.Tensor, tokens: torch.Tensor, junk: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    V = logits.shape[-1]
    pad = ~b.mask
    j = torch.stack([junk_like(b.mask, b.dtype, junk or b.junk, b.gen) for _ in range(V)], dim=-1)
    logits = torch.where(b.mask.unsqueeze(-1), logits, j)
    bad_ids = torch.randint(-(10**6), 10**6, (b.B, b.T), generator=b.gen)
    tokens = torch.where(pad, bad_ids, tokens)  # out-of-range ids on padding must be ignored
    return logits, tokens


@given(ragged_batches(max_B=8, max_T=32), vocab_sizes, temperatures)
def test_logprobs_match_naive(b: Ragged, V: int, temperature: float) -> None:
    assume(_well_conditioned(b, temperature))
    logits, tokens = _logits_and_tokens(b, V)
    got = logprobs_from_logits(logits, tokens, b.mask, temperature=temperature)
    want = logprobs_from_logits_naive(logits, tokens, b.mask, temperature=temperature)
    assert_twin_close(got, want, b.dtype, "logprobs")


@given(ragged_batches(max_B=8, max_T=32), vocab_sizes, temperatures)
def test_entropy_matches_naive(b: Ragged, V: int, temperature: float) -> None:
    assume(_well_conditioned(b, temperature))
    logits, _ = _logits_and_tokens(b, V)
    got = entropy_from_logits(logits, b.mask, temperature=temperature)
    want = entropy_from_logits_naive(logits, b.mask, temperature=temperature)
    assert_twin_close(got, want, b.dtype, "entropy")


@given(
    ragged_batches(max_B=8, max_T=32), vocab_sizes, st.sampled_from(["nan", "inf", "-inf", "huge", "mixed"])
)
def test_logprobs_and_entropy_padding_invariant(b: Ragged, V: int, other_junk: str) -> None:
    logits = b.normal(b.B, b.T, V, scale=3.0)
    tokens = torch.randint(0, V, (b.B, b.T), generator=b.gen)
    l1, t1 = _junk_padding(b, logits, tokens, None)
    l2, t2 = _junk_padding(b, logits, tokens, other_junk)
    lp1 = logprobs_from_logits(l1, t1, b.mask)
    assert_exactly_equal(lp1, logprobs_from_logits(l2, t2, b.mask), what="logprobs")
    e1 = entropy_from_logits(l1, b.mask)
    assert_exactly_equal(e1, entropy_from_logits(l2, b.mask), what="entropy")
    assert bool((lp1[~b.mask] == 0).all() and (e1[~b.mask] == 0).all()), "outputs are 0 on padding"


@given(ragged_batches(max_B=8, max_T=32), vocab_sizes)
def test_logprobs_and_entropy_batch_permutation_equivariant(b: Ragged, V: int) -> None:
    logits, tokens = _logits_and_tokens(b, V)
    perm = torch.randperm(b.B, generator=b.gen)
    assert_exactly_equal(
        logprobs_from_logits(logits[perm], tokens[perm], b.mask[perm]),
        logprobs_from_logits(logits, tokens, b.mask)[perm],
        what="logprobs",
    )
    assert_exactly_equal(
        entropy_from_logits(logits[perm], b.mask[perm]),
        entropy_from_logits(logits, b.mask)[perm],
        what="entropy",
    )


@given(ragged_batches(max_B=8, max_T=32, dtypes=(torch.float64,)), vocab_sizes, temperatures)
def test_logprobs_nonpositive_normalised_and_entropy_bounded(b: Ragged, V: int, temperature: float) -> None:
    logits, _ = _logits_and_tokens(b, V)
    # log-probs of every vocabulary entry: exp sums to 1 over the vocabulary at valid positions.
    all_lp = torch.stack(
        [
            logprobs_from_logits(logits, torch.full((b.B, b.T), v), b.mask, temperature=temperature)
            for v in range(V)
        ],
        dim=-1,
    )[b.mask]
    assert bool((all_lp <= 0).all())
    assert torch.allclose(all_lp.exp().sum(-1), torch.ones((), dtype=torch.float64), atol=1e-12)
    ent = entropy_from_logits(logits, b.mask, temperature=temperature)[b.mask]
    assert bool((ent >= -1e-12).all() and (ent <= math.log(V) + 1e-12).all())
