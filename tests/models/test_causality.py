"""Causality and padding invariance of the one-pass read-outs (notes Q7/Q8), on GPT-2 and Llama.

- editing any future token y_{>t} never changes log π(y_t | x, y_<t) nor V(x, y_<t);
- editing y_t itself changes log π(y_t) but never V_t (the critic sees only (x, y_<t));
- adding left padding to prompts or right padding to responses changes nothing.

Tolerance ``atol = 1e-5`` (float32; measured ≤ 1e-6).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refppo.models.batch import SequenceBatch
from refppo.models.readout import response_logprobs, response_values
from refppo.models.roles import Critic, eval_mode
from refppo.models.tiny import Arch, tiny_actor, tiny_critic

pytestmark = pytest.mark.property

VOCAB = 64
ATOL = 1e-5
ARCHS: list[Arch] = ["gpt2", "llama"]
FEW = settings(max_examples=8, deadline=None)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@cache
def models(arch: Arch) -> tuple[torch.nn.Module, Critic]:
    actor = tiny_actor(arch, VOCAB, seed=0, hidden=32)
    critic = tiny_critic(arch, VOCAB, seed=1, hidden=32)
    actor.eval()
    critic.eval()
    return actor, critic


tokens = st.integers(min_value=0, max_value=VOCAB - 1)
seqs = st.lists(
    st.tuples(st.lists(tokens, min_size=1, max_size=5), st.lists(tokens, min_size=1, max_size=6)),
    min_size=1,
    max_size=3,
)


def maxabs(x: torch.Tensor) -> float:
    return float(x.abs().max()) if x.numel() else 0.0


def readouts(arch: Arch, batch: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
    actor, critic = models(arch)
    with torch.no_grad(), eval_mode(actor, critic):
        return response_logprobs(actor, batch)[0], response_values(critic, batch)


@pytest.mark.parametrize("arch", ARCHS)
@FEW
@given(rows=seqs, data=st.data())
def test_future_tokens_never_change_past_readouts(
    arch: Arch, rows: list[tuple[list[int], list[int]]], data: st.DataObject
) -> None:
    prompts = [p for p, _ in rows]
    resps = [r for _, r in rows]
    b = data.draw(st.integers(0, len(rows) - 1), label="row")
    t = data.draw(st.integers(0, len(resps[b]) - 1), label="t")
    edited = [list(r) for r in resps]
    new_tail = data.draw(
        st.lists(tokens, min_size=len(resps[b]) - t, max_size=len(resps[b]) - t), label="tail"
    )
    edited[b][t:] = new_tail  # y_t and everything after it
    base = SequenceBatch.from_lists(prompts, resps, response_width=6)
    other = SequenceBatch.from_lists(prompts, edited, response_width=6)
    lp0, v0 = readouts(arch, base)
    lp1, v1 = readouts(arch, other)
    # y_{>t} edited: log π(y_0..y_t-1) and V_0..V_t unchanged (V_t sees only y_<t)
    assert maxabs(lp0[b, :t] - lp1[b, :t]) <= ATOL
    assert maxabs(v0[b, : t + 1] - v1[b, : t + 1]) <= ATOL
    # the other rows are untouched
    keep = [i for i in range(len(rows)) if i != b]
    assert maxabs(lp0[keep] - lp1[keep]) <= ATOL
    if new_tail[0] != resps[b][t]:
        assert float((lp0[b, t] - lp1[b, t]).abs()) > 0.0  # y_t itself is scored at t


@pytest.mark.parametrize("arch", ARCHS)
@FEW
@given(rows=seqs, extra_left=st.integers(0, 4), extra_right=st.integers(0, 4))
def test_padding_amount_changes_nothing(
    arch: Arch, rows: list[tuple[list[int], list[int]]], extra_left: int, extra_right: int
) -> None:
    prompts = [p for p, _ in rows]
    resps = [r for _, r in rows]
    P = max(len(p) for p in prompts)
    T = max(len(r) for r in resps)
    tight = SequenceBatch.from_lists(prompts, resps)
    loose = SequenceBatch.from_lists(
        prompts, resps, prompt_width=P + extra_left, response_width=T + extra_right
    )
    lp0, v0 = readouts(arch, tight)
    lp1, v1 = readouts(arch, loose)
    assert float((lp0 - lp1[:, :T]).abs().max()) <= ATOL
    assert float((v0 - v1[:, :T]).abs().max()) <= ATOL
    assert bool((lp1[:, T:] == 0).all())
