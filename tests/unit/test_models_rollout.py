"""refppo.rollout: sampling (EOS, padding, determinism, distribution) and scoring."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from refppo.errors import HyperparameterError
from refppo.models import EOS_ID, PAD_ID, left_pad, make_reference, tiny_actor, tiny_critic
from refppo.rollout import RolloutConfig, generate_rollout, score_rollout

VOCAB = 32


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class Biased(nn.Module):
    """A real tiny model with ``bias`` added to its logits (makes EOS frequent)."""

    def __init__(self, inner: nn.Module, bias: Tensor) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("bias", bias)

    def forward(self, **kw: Any) -> Any:
        out = self.inner(**kw)
        return SimpleNamespace(logits=out.logits + self.bias)


class FixedLogits(nn.Module):
    """Logits that do not depend on the input: ``logits`` at every position."""

    def __init__(self, logits: Tensor) -> None:
        super().__init__()
        self.register_buffer("logits", logits)
        self.dummy = nn.Linear(1, 1)

    def forward(self, input_ids: Tensor, **kw: Any) -> Any:
        B, S = input_ids.shape
        return SimpleNamespace(logits=self.logits.expand(B, S, -1))


def eos_model() -> Biased:
    bias = torch.zeros(VOCAB)
    bias[EOS_ID] = 2.5
    return Biased(tiny_actor("gpt2", VOCAB, seed=0, hidden=32), bias)


def prompts(n: int) -> tuple[Tensor, Tensor]:
    return left_pad([[1, 3 + (i % 5)] + [4] * (i % 3) for i in range(n)], PAD_ID)


def test_stop_at_eos_and_padding() -> None:
    pids, pm = prompts(16)
    cfg = RolloutConfig(max_new_tokens=8)
    batch = generate_rollout(eos_model(), pids, pm, cfg, torch.Generator().manual_seed(0))
    assert batch.response_ids.shape == (16, 8)
    lengths = batch.response_mask.sum(1).tolist()
    assert 1 <= min(lengths) < 8 and max(lengths) == 8  # some stop early, some are truncated
    for b in range(16):
        L = lengths[b]
        ids = batch.response_ids[b].tolist()
        valid = ids[:L]
        assert batch.response_mask[b, :L].all() and not batch.response_mask[b, L:].any()
        assert all(t == PAD_ID for t in ids[L:])
        if EOS_ID in valid:
            assert valid.index(EOS_ID) == L - 1  # EOS is the last valid token
        else:
            assert L == 8  # truncated at max_new_tokens


def test_same_seed_same_tokens() -> None:
    pids, pm = prompts(6)
    model, cfg = eos_model(), RolloutConfig(max_new_tokens=6, temperature=0.8)
    a = generate_rollout(model, pids, pm, cfg, torch.Generator().manual_seed(5))
    b = generate_rollout(model, pids, pm, cfg, torch.Generator().manual_seed(5))
    c = generate_rollout(model, pids, pm, cfg, torch.Generator().manual_seed(6))
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
    assert not torch.equal(a.response_ids, c.response_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampler_draws_from_softmax_over_temperature(temperature: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, 0.0])
    model = FixedLogits(logits)
    n = 4000
    pids, pm = torch.ones(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.bool)
    cfg = RolloutConfig(max_new_tokens=1, temperature=temperature, eos_token_id=99)
    batch = generate_rollout(model, pids, pm, cfg, torch.Generator().manual_seed(1))
    freq = torch.bincount(batch.response_ids[:, 0], minlength=6).double() / n
    p = torch.softmax(logits.double() / temperature, -1)
    assert float((freq - p).abs().max()) < 0.03  # ~4 standard errors at n=4000


def test_top_k_restricts_support() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, 0.0])
    n = 500
    pids, pm = torch.ones(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.bool)
    cfg = RolloutConfig(max_new_tokens=1, top_k=2, eos_token_id=99)
    batch = generate_rollout(FixedLogits(logits), pids, pm, cfg, torch.Generator().manual_seed(1))
    assert set(batch.response_ids[:, 0].tolist()) == {0, 1}
    cfg = RolloutConfig(max_new_tokens=1, top_p=0.5, eos_token_id=99)
    batch = generate_rollout(FixedLogits(logits), pids, pm, cfg, torch.Generator().manual_seed(1))
    assert set(batch.response_ids[:, 0].tolist()) == {0}  # p(0) ≈ 0.50 > ... first entry alone


def test_missing_eos_penalty_and_reward_function() -> None:
    pids, pm = prompts(8)
    actor = eos_model()
    critic = tiny_critic("gpt2", VOCAB, seed=1, hidden=32)
    batch = generate_rollout(
        actor, pids, pm, RolloutConfig(max_new_tokens=5), torch.Generator().manual_seed(2)
    )

    def reward(p: list[int], r: list[int]) -> float:
        return float(len(r))

    ref = make_reference(actor)
    s0 = score_rollout(actor, ref, critic, reward, batch, missing_eos_penalty=None)
    s1 = score_rollout(actor, ref, critic, reward, batch, missing_eos_penalty=1.5)
    has_eos = [EOS_ID in batch.unpadded(b)[1] for b in range(8)]
    assert 0 < sum(has_eos) < 8
    assert s0.has_eos.tolist() == has_eos
    assert s0.raw_scores.tolist() == batch.response_mask.sum(1).float().tolist()
    assert torch.equal(s0.scores, s0.raw_scores)
    expected = [s - (0.0 if e else 1.5) for s, e in zip(s0.raw_scores.tolist(), has_eos, strict=True)]
    assert s1.scores.tolist() == expected
    with pytest.raises(HyperparameterError):
        RolloutConfig(missing_eos_penalty=-1.0)


def test_scoring_is_dropout_free_and_restores_modes() -> None:
    actor = tiny_actor("llama", VOCAB, seed=0, hidden=32, dropout=0.5)
    critic = tiny_critic("llama", VOCAB, seed=1, hidden=32, dropout=0.5)
    actor.train()
    critic.train()
    pids, pm = prompts(4)
    batch = generate_rollout(
        actor, pids, pm, RolloutConfig(max_new_tokens=5), torch.Generator().manual_seed(0)
    )
    ref = make_reference(actor)
    a = score_rollout(actor, ref, critic, lambda p, r: 0.0, batch)
    b = score_rollout(actor, ref, critic, lambda p, r: 0.0, batch)
    assert torch.equal(a.old_logprobs, b.old_logprobs) and torch.equal(a.old_values, b.old_values)
    assert torch.equal(a.old_logprobs, a.ref_logprobs)  # actor == its initial copy
    assert actor.training and critic.training
    assert not a.old_logprobs.requires_grad
