"""``refppo.pipeline.blocks.gae_by_rows`` (issue #9, memory): GAE over blocks of rows equals the core's
``gae`` called once on the whole batch, bit for bit, for every ``gae_holes`` convention and masks
with padding, holes and left padding; and it is what the rollout step computes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle_helpers import make_inputs, setup_for

from refppo.core.gae import gae
from refppo.pipeline import blocks as m_blocks
from refppo.pipeline.blocks import gae_by_rows
from refppo.pipeline.step import rollout_quantities

pytestmark = pytest.mark.property


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    B=st.integers(1, 9),
    T=st.integers(1, 12),
    block=st.sampled_from([1, 7, 24, 1 << 20]),
    holes=st.sampled_from(["skip", "zero", "through"]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    gamma=st.sampled_from([1.0, 0.99]),
    lam=st.sampled_from([1.0, 0.95, 0.0]),
)
def test_gae_by_rows_equals_the_core_on_the_whole_batch(
    seed: int, B: int, T: int, block: int, holes: str, dtype: torch.dtype, gamma: float, lam: float
) -> None:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.7  # holes, left padding and right padding alike
    mask[:, int(torch.randint(T, (1,), generator=g))] = True  # no empty row
    r = torch.randn(B, T, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, T, generator=g, dtype=torch.float64).to(dtype)
    want = gae(r, v, mask, gamma=gamma, lam=lam, holes=holes)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(m_blocks, "ROW_BLOCK_ELEMENTS", block)
        got = gae_by_rows(r, v, mask, gamma=gamma, lam=lam, holes=holes)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        assert torch.equal(a, b)


def test_rollout_quantities_uses_row_blocks_for_a_large_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rollout step goes through the blocks (one ``gae`` call per block of rows) and its
    advantages still equal the core's ``gae`` on the whole batch."""
    calls: list[int] = []

    def counting(*a: Any, **k: Any) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        return gae(*a, **k)

    inp = make_inputs(B=6, T=12)
    s = setup_for("trl", {"whiten_advantages": "none"})
    monkeypatch.setattr(m_blocks, "gae", counting)
    monkeypatch.setattr(m_blocks, "ROW_BLOCK_ELEMENTS", 24)  # two rows per block: three calls
    m = inp["response_mask"].bool()
    q = rollout_quantities(
        scores=inp["scores"], old_logprobs=inp["old_logprobs"], ref_logprobs=inp["ref_logprobs"],
        old_values=inp["old_values"], mask=m, hp=s.hp, conv=s.conv,
    )  # fmt: skip
    assert len(calls) == 3
    want, _ = gae(q.token_rewards, inp["old_values"], q.value_mask, gamma=s.hp.gamma, lam=s.hp.lam)
    assert torch.equal(q.advantages_raw, want)
