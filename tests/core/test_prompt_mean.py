"""The prompt-level mean (refppo/core/aggregate.py ``prompt_mean_loss``, SkyRL 0.4.0 ``prompt_mean``):
its naive twin, its gradient, a hand-worked vector, the two modes it reduces to, and its refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import Ragged, assert_twin_close, ragged_batches

from refppo.core.aggregate import (
    aggregate_loss,
    prompt_mean_loss,
    prompt_mean_loss_naive,
    prompt_mean_weights_naive,
)
from refppo.errors import DtypeError, RefPPOError, ShapeError

pytestmark = pytest.mark.property


def _groups(b: Ragged, n_prompts: int) -> torch.Tensor:
    """A random prompt id per row (ids scattered, rows of a prompt not adjacent)."""
    return torch.randint(0, n_prompts, (b.B,), generator=b.gen) * 7 - 3


@given(ragged_batches(), st.integers(1, 5), st.booleans())
def test_prompt_mean_matches_naive(b: Ragged, n_prompts: int, global_count: bool) -> None:
    x, g = b.floats(-3.0, 3.0), _groups(b, n_prompts)
    kw = {"prompt_count": 11.0} if global_count else {}
    assert_twin_close(
        prompt_mean_loss(x, b.mask, g, **kw),
        prompt_mean_loss_naive(x, b.mask, g, **kw),
        b.dtype,
        "prompt-mean",
    )


@given(ragged_batches(dtypes=(torch.float64,)), st.integers(1, 5))
def test_prompt_mean_gradient_is_the_naive_weights(b: Ragged, n_prompts: int) -> None:
    x = b.floats(-3.0, 3.0).requires_grad_(True)
    g = _groups(b, n_prompts)
    prompt_mean_loss(x, b.mask, g).backward()
    assert x.grad is not None
    want = torch.tensor(prompt_mean_weights_naive(b.mask, g), dtype=torch.float64)
    torch.testing.assert_close(torch.where(b.mask, x.grad, 0.0), want, rtol=1e-12, atol=1e-15)


@given(ragged_batches(dtypes=(torch.float64,)))
def test_one_row_per_prompt_is_seq_mean_token_mean_and_one_prompt_is_token_mean(b: Ragged) -> None:
    x = b.floats(-3.0, 3.0)
    own = torch.arange(b.B)
    torch.testing.assert_close(
        prompt_mean_loss(x, b.mask, own), aggregate_loss(x, b.mask, "seq-mean-token-mean")
    )
    one = torch.zeros(b.B, dtype=torch.long)
    torch.testing.assert_close(prompt_mean_loss(x, b.mask, one), aggregate_loss(x, b.mask, "token-mean"))


def test_hand_worked_vector() -> None:
    # prompt 5: rows 0 and 1, tokens 1, 2, 3 -> 6/3 = 2; prompt 9: row 2, tokens 6, 6 -> 6; mean 4
    # (token-mean 3.6, seq-mean-token-mean 3.5: the prompt grouping is what is read)
    x = torch.tensor([[1.0, 2.0, 99.0], [3.0, 99.0, 99.0], [6.0, 6.0, 99.0]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    g = torch.tensor([5, 5, 9])
    for f in (prompt_mean_loss, prompt_mean_loss_naive):
        assert float(f(x, m, g)) == 4.0
        assert float(f(x, m, g, prompt_count=4.0)) == 2.0
    assert prompt_mean_weights_naive(m, g) == [[1 / 6, 1 / 6, 0.0], [1 / 6, 0.0, 0.0], [0.25, 0.25, 0.0]]


@pytest.mark.parametrize(
    ("groups", "prompt_count", "err"),
    [
        (torch.tensor([0.0, 1.0]), None, DtypeError),
        (torch.tensor([0, 1, 2]), None, ShapeError),
        ([0, 1], None, DtypeError),
        (torch.tensor([0, 1]), 0.0, RefPPOError),
    ],
)
def test_refusals_are_the_same_in_both(
    groups: object, prompt_count: float | None, err: type[Exception]
) -> None:
    x, m = torch.zeros(2, 3, dtype=torch.float64), torch.ones(2, 3, dtype=torch.bool)
    for f in (prompt_mean_loss, prompt_mean_loss_naive):
        with pytest.raises(err) as info:
            f(x, m, groups, prompt_count=prompt_count)  # type: ignore[arg-type]  # a bad input on purpose
        assert "group_index" in str(info.value) or "prompt_count" in str(info.value)
