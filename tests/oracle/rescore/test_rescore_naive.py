"""Re-scoring (one teacher-forced pass through refppo.oracle.rescore.readouts) equals the per-prefix naive
twins of refppo.models.naive on random left/right paddings, for the actor (with temperature), a
token-classification critic and a reward model, GPT-2 and Llama."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refppo.dump.sequences import LabelCritic
from refppo.models.batch import SequenceBatch
from refppo.models.naive import response_logprobs_naive, response_values_naive, reward_scores_naive
from refppo.models.roles import RewardModel
from refppo.models.tiny import tiny_actor, tiny_config, tiny_reward_model
from refppo.oracle.rescore.readouts import Rescorer, Variant

pytestmark = pytest.mark.property

V = 64


def _critic(arch: Any) -> LabelCritic:
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(3)
    cfg = tiny_config(arch, V, hidden=16, layers=2, heads=2, num_labels=1)
    return LabelCritic(AutoModelForTokenClassification.from_config(cfg), "token").eval()


MODELS = {
    arch: (
        tiny_actor(arch, V, hidden=16, layers=2, heads=2).eval(),
        _critic(arch),
        tiny_reward_model(arch, V, hidden=16, layers=2, heads=2).eval(),
    )
    for arch in ("gpt2", "llama")
}

rows = st.lists(
    st.tuples(
        st.lists(st.integers(3, V - 1), min_size=1, max_size=4),
        st.lists(st.integers(2, V - 1), min_size=1, max_size=4),
    ),
    min_size=1,
    max_size=3,
)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@settings(max_examples=8, deadline=None)
@given(data=rows, tau=st.sampled_from([1.0, 0.7]), extra_p=st.integers(0, 2))
def test_rescore_equals_per_prefix_naive(arch: str, data: list[Any], tau: float, extra_p: int) -> None:
    actor, critic, rm = MODELS[arch]
    prompts, responses = [d[0] for d in data], [d[1] for d in data]
    width = max(len(p) for p in prompts) + extra_p
    batch = SequenceBatch.from_lists(prompts, responses, prompt_width=width)
    dev = torch.device("cpu")
    m = batch.response_mask
    lp = Rescorer("actor", actor, batch, dev).run(Variant(tau))
    lp_naive, _ = response_logprobs_naive(actor, batch, temperature=tau)
    assert torch.allclose(lp[m], lp_naive.double()[m], atol=2e-5, rtol=0)
    vals = Rescorer("critic", critic, batch, dev).run(Variant(tau))
    with torch.no_grad():
        vals_naive = response_values_naive(critic, batch)
    assert torch.allclose(vals[m], vals_naive.double()[m], atol=2e-5, rtol=0)
    assert isinstance(rm, RewardModel)
    sc = Rescorer("reward-model", rm, batch, dev).run(Variant(tau))
    assert torch.allclose(sc, reward_scores_naive(rm, batch).double(), atol=2e-5, rtol=0)
