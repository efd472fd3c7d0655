"""The chunked path of refppo/core/logprobs.py (``_by_position_chunks``), which the other tests never reach.

On CPU the valid positions are processed ``max(64, _CHUNK_ELEMENTS // V)`` rows at a time; with the
default 2**18 logits a chunk only splits batches of more than 4096 positions at V = 64. Here
``_CHUNK_ELEMENTS`` is patched down so that every example spans several chunks (and a last, partial
one), including a vocabulary *above* the threshold (``_CHUNK_ELEMENTS // V == 0``: 64 rows).
Checked against references that do not go through the code under test:

- log-probs and entropy: the naive twins (one position, one vocabulary entry at a time);
- their gradients w.r.t. the logits: the closed forms (``z = logits/τ``, ``p = softmax(z)``)
  ``∂ log p_y/∂logits = (onehot(y) − p)/τ`` and ``∂H/∂logits = −p ⊙ (log p + H)/τ``, in float64;
- padded positions (junk logits, out-of-range ids): value 0 and gradient exactly 0, never NaN;
- an all-padding batch: zeros, and zero gradients.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from strategies import Ragged, assert_exactly_equal, assert_twin_close, junk_like, ragged_batches

import refppo.core.logprobs as lp
from refppo.core.logprobs import (
    entropy_from_logits,
    entropy_from_logits_naive,
    logprobs_from_logits,
    logprobs_from_logits_naive,
)

pytestmark = pytest.mark.property

MIN_ROWS = 64  # the floor of the chunk size in rows (logprobs._by_position_chunks)


@contextmanager
def _chunk_elements(n: int) -> Iterator[None]:
    with mock.patch.object(lp, "_CHUNK_ELEMENTS", n):
        yield


def _inputs(b: Ragged, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = b.normal(b.B, b.T, V, scale=3.0)
    tokens = torch.randint(0, V, (b.B, b.T), generator=b.gen)
    j = torch.stack([junk_like(b.mask, b.dtype, b.junk, b.gen) for _ in range(V)], dim=-1)
    logits = torch.where(b.mask.unsqueeze(-1), logits, j)
    bad_ids = torch.randint(-(10**6), 10**6, (b.B, b.T), generator=b.gen)
    return logits, torch.where(b.mask, tokens, bad_ids)


def _reference_grads(
    logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, temperature: float, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form gradients of ``Σ w·logp`` and ``Σ w·H`` w.r.t. the logits (float64, 0 on padding)."""
    m3 = mask.unsqueeze(-1)
    z = torch.where(m3, logits.double(), torch.zeros((), dtype=torch.float64)) / temperature
    p = torch.softmax(z, dim=-1)
    logp = torch.log_softmax(z, dim=-1)
    ids = torch.where(mask, tokens, torch.zeros((), dtype=tokens.dtype))
    onehot = torch.nn.functional.one_hot(ids.long(), logits.shape[-1]).double()
    h = -(p * logp).sum(-1, keepdim=True)
    wd = w.double().unsqueeze(-1)
    g_logp = torch.where(m3, wd * (onehot - p) / temperature, 0.0)
    g_ent = torch.where(m3, wd * (-p * (logp + h)) / temperature, 0.0)
    return g_logp, g_ent


chunk_sizes = st.one_of(st.integers(MIN_ROWS, 100), st.just(0))  # rows per chunk; 0: V above threshold


@settings(max_examples=20)  # each example spans 2-5 chunks of >= 64 positions: fewer, larger examples
@given(
    ragged_batches(min_B=2, max_B=8, min_T=8, max_T=24, min_total_valid=2 * MIN_ROWS + 3),
    st.integers(2, 12),
    st.sampled_from([1.0, 0.7, 1.3, 0.25]),
    chunk_sizes,
)
def test_chunked_logprobs_and_entropy_match_naive_and_closed_form_gradients(
    b: Ragged, V: int, temperature: float, rows: int
) -> None:
    assume(b.dtype == torch.float64 or temperature >= 0.7)
    n = b.n_valid
    elements = rows * V if rows else V - 1  # rows = 0: a vocabulary above the chunk threshold
    expected_rows = max(MIN_ROWS, elements // V)
    assert n > expected_rows  # several chunks, the last one partial unless n divides evenly
    logits, tokens = _inputs(b, V)
    w = b.normal(b.B, b.T)
    x1 = logits.clone().requires_grad_(True)
    x2 = logits.clone().requires_grad_(True)
    with _chunk_elements(elements):
        got_lp = logprobs_from_logits(x1, tokens, b.mask, temperature=temperature)
        got_h = entropy_from_logits(x2, b.mask, temperature=temperature)
    assert_twin_close(
        got_lp, logprobs_from_logits_naive(logits, tokens, b.mask, temperature=temperature), b.dtype
    )
    assert_twin_close(got_h, entropy_from_logits_naive(logits, b.mask, temperature=temperature), b.dtype)
    # Chunking changes no value: bit for bit the one-chunk result.
    with _chunk_elements(10**12):
        assert_exactly_equal(
            got_lp.detach(), logprobs_from_logits(logits, tokens, b.mask, temperature=temperature)
        )
        assert_exactly_equal(got_h.detach(), entropy_from_logits(logits, b.mask, temperature=temperature))
    (got_lp * w).sum().backward()
    (got_h * w).sum().backward()
    assert x1.grad is not None and x2.grad is not None
    g_lp, g_h = _reference_grads(logits, tokens, b.mask, temperature, w)
    pad = ~b.mask
    for g, ref in ((x1.grad, g_lp), (x2.grad, g_h)):
        assert bool(torch.isfinite(g).all())
        assert bool((g[pad] == 0).all())  # padded logits: exactly 0, never NaN
        assert_twin_close(g, ref.to(b.dtype), b.dtype, "gradient")


@given(
    st.integers(1, 5), st.integers(1, 70), st.integers(2, 9), st.sampled_from([torch.float32, torch.float64])
)
def test_all_padding_batch_gives_zeros_and_zero_gradients(B: int, T: int, V: int, dtype: torch.dtype) -> None:
    mask = torch.zeros(B, T, dtype=torch.bool)
    logits = torch.full((B, T, V), math.nan, dtype=dtype, requires_grad=True)
    tokens = torch.full((B, T), 10**6, dtype=torch.long)  # out of range: ignored on padding
    for elements in (V - 1, 10**12):
        with _chunk_elements(elements):
            logp = logprobs_from_logits(logits, tokens, mask)
            ent = entropy_from_logits(logits, mask)
        assert logp.shape == (B, T) and ent.shape == (B, T)
        assert logp.dtype == dtype and ent.dtype == dtype
        assert bool((logp == 0).all()) and bool((ent == 0).all())
        (logp.sum() + ent.sum()).backward()
        assert logits.grad is not None
        assert bool((logits.grad == 0).all())
        logits.grad = None
