"""Model roles and read-outs (refppo.models) against the per-prefix naive twins (refppo.models.naive).

Tolerance: float32, ``atol = 1e-5`` on log-probs/entropies/values/scores (measured max deviation
≈ 1e-6 on GPT-2, 5e-7 on Llama; the twin computes the log-softmax in float64 Python arithmetic).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache

import pytest
import torch

from refppo.errors import ShapeError
from refppo.models.batch import SequenceBatch, position_ids_from_mask
from refppo.models.loading import load_actor, load_critic, load_reference, load_reward_model
from refppo.models.naive import response_logprobs_naive, response_values_naive, reward_scores_naive
from refppo.models.readout import response_logits, response_logprobs, response_values, reward_scores
from refppo.models.roles import Critic, RewardModel, eval_mode, make_reference
from refppo.models.tiny import Arch, tiny_actor, tiny_critic, tiny_gpt2, tiny_llama, tiny_reward_model

ARCHS: list[Arch] = ["gpt2", "llama"]
ATOL = 1e-5
VOCAB = 64


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny models on a shared 2-core machine: 1 thread is ~30x faster and deterministic."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@cache
def roles(arch: Arch) -> tuple[torch.nn.Module, Critic, RewardModel]:
    kw = {"hidden": 32, "dropout": 0.1}
    actor = tiny_actor(arch, VOCAB, seed=0, **kw)
    critic = tiny_critic(arch, VOCAB, seed=1, **kw)
    rm = tiny_reward_model(arch, VOCAB, seed=2, **kw)
    return actor, critic, rm


def ragged_batch() -> SequenceBatch:
    """Prompts of 1..5 tokens, responses of 1..6 tokens (token 0 = pad id used as a REAL token)."""
    prompts = [[1, 5, 6], [1, 7, 8, 9, 10], [9], [1, 11, 0, 13]]
    responses = [[3, 4, 2], [5, 6, 7, 8, 9, 10], [2], [0, 12, 0]]
    return SequenceBatch.from_lists(prompts, responses, prompt_width=7, response_width=8)


def test_tiny_factories_sizes_and_seeding() -> None:
    g, ll = tiny_gpt2(128), tiny_llama(128)
    for m in (g, ll):
        n = sum(p.numel() for p in m.parameters())
        assert 5e4 < n < 1e6, n
    a, b, c = tiny_gpt2(128, seed=3), tiny_gpt2(128, seed=3), tiny_gpt2(128, seed=4)
    pa, pb, pc = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb)
    assert not torch.equal(pa, pc)
    assert tiny_gpt2(64, dropout=0.25).config.resid_pdrop == 0.25


def test_sequence_batch_padding_and_positions() -> None:
    b = SequenceBatch.from_lists([[4, 5], [6]], [[7], [8, 9]], prompt_width=3, response_width=3)
    assert b.prompt_ids.tolist() == [[0, 4, 5], [0, 0, 6]]
    assert b.prompt_mask.tolist() == [[False, True, True], [False, False, True]]
    assert b.response_ids.tolist() == [[7, 0, 0], [8, 9, 0]]
    assert b.attention_mask.tolist() == [[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0]]
    assert b.position_ids.tolist() == [[0, 0, 1, 2, 2, 2], [0, 0, 0, 1, 2, 2]]
    assert (b.B, b.P, b.T) == (2, 3, 3)
    assert position_ids_from_mask(torch.tensor([[0, 0, 1, 1]])).tolist() == [[0, 0, 0, 1]]
    with pytest.raises(ShapeError, match="LEFT-padded"):
        SequenceBatch(
            torch.ones(1, 3, dtype=torch.long),
            torch.tensor([[1, 1, 0]]),
            b.response_ids[:1],
            b.response_mask[:1],
        )
    with pytest.raises(ShapeError, match="RIGHT-padded"):
        SequenceBatch(b.prompt_ids[:1], b.prompt_mask[:1], b.response_ids[:1], torch.tensor([[0, 1, 1]]))


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_and_entropy_batched_equal_naive(arch: Arch) -> None:
    actor, _, _ = roles(arch)
    batch = ragged_batch()
    with torch.no_grad(), eval_mode(actor):
        logp, ent = response_logprobs(actor, batch, temperature=0.7)
        logp_n, ent_n = response_logprobs_naive(actor, batch, temperature=0.7)
    m = batch.response_mask
    dev = max(float((logp - logp_n).abs().max()), float((ent - ent_n).abs().max()))
    print(f"{arch}: max |batched - naive| log-prob/entropy = {dev:.2e}")
    assert dev <= ATOL
    assert bool((logp[~m] == 0).all()) and bool((ent[~m] == 0).all())
    assert bool((logp[m] < 0).all())


@pytest.mark.parametrize("arch", ARCHS)
def test_values_batched_equal_naive(arch: Arch) -> None:
    _, critic, _ = roles(arch)
    batch = ragged_batch()
    with torch.no_grad(), eval_mode(critic):
        v = response_values(critic, batch)
        v_n = response_values_naive(critic, batch)
    dev = float((v - v_n).abs().max())
    print(f"{arch}: max |batched - naive| value = {dev:.2e}")
    assert dev <= ATOL
    # the slot after the last valid token holds V(x, y) (used by score_at=after_last_valid)
    assert float(v[0, 3].abs()) > 0 and float(v[0, 4]) == 0.0


@pytest.mark.parametrize("arch", ARCHS)
def test_reward_read_at_last_real_token_equals_naive(arch: Arch) -> None:
    _, _, rm = roles(arch)
    batch = ragged_batch()
    s = reward_scores(rm, batch)
    s_n = reward_scores_naive(rm, batch)
    assert float((s - s_n).abs().max()) <= ATOL
    # transformers' own pooling locates the last token through pad_token_id: row 3 ends with a
    # REAL token 0 (= pad id, as when pad == eos), so its read-out lands on an earlier position.
    with torch.no_grad(), eval_mode(rm):
        hf = rm.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.squeeze(-1)
    assert abs(float(hf[3]) - float(s_n[3])) > 1e-4
    # control: no left padding and no real pad-id token -> transformers' pooling agrees
    one = SequenceBatch.from_lists([[1, 5, 6]], [[3, 4, 2]], response_width=5)
    with torch.no_grad(), eval_mode(rm):
        hf1 = rm.model(input_ids=one.input_ids, attention_mask=one.attention_mask).logits.squeeze(-1)
    assert abs(float(hf1[0]) - float(reward_scores(rm, one)[0])) <= ATOL


@pytest.mark.parametrize("arch", ARCHS)
def test_off_by_one_slice_is_caught(arch: Arch) -> None:
    """The naive comparison can fail: reading logits at [P, P+T) instead of [P-1, P+T-1) is caught."""
    actor, _, _ = roles(arch)
    batch = ragged_batch()
    with torch.no_grad(), eval_mode(actor):
        full = actor(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).logits
        P, T = batch.P, batch.T
        right = response_logits(actor, batch)
        logp_n, _ = response_logprobs_naive(actor, batch)
    assert torch.equal(right, full[:, P - 1 : P + T - 1])
    shifted = torch.cat([full[:, P : P + T - 1], full[:, -1:]], dim=1)
    wrong = torch.log_softmax(shifted, -1).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    m = batch.response_mask
    assert float((wrong - logp_n)[m].abs().max()) > 1e-2


def test_position_ids_matter_for_absolute_positions() -> None:
    """GPT-2 (learned absolute positions): omitting position_ids with left padding changes the
    logits; passing them makes the padded result equal the unpadded naive one. (Rotary Llama is
    invariant to a constant position shift, so there the difference is float noise.)"""
    actor, _, _ = roles("gpt2")
    batch = ragged_batch()
    with torch.no_grad(), eval_mode(actor):
        default = actor(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        ours = response_logits(actor, batch)
        logp_n, _ = response_logprobs_naive(actor, batch)
    P, T = batch.P, batch.T
    wrong = torch.log_softmax(default[:, P - 1 : P + T - 1], -1)
    wrong = wrong.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    right = torch.log_softmax(ours, -1).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    m = batch.response_mask
    assert float((wrong - logp_n)[m].abs().max()) > 1e-3
    assert float((right - logp_n)[m].abs().max()) <= ATOL


@pytest.mark.parametrize("arch", ARCHS)
def test_save_and_load_local_dir(arch: Arch, tmp_path: object) -> None:
    import pathlib

    root = pathlib.Path(str(tmp_path))
    actor, critic, rm = roles(arch)
    actor.save_pretrained(root / "actor")
    critic.save_pretrained(root / "critic")
    rm.model.save_pretrained(root / "reward")
    batch = ragged_batch()
    a2, r2 = load_actor(root / "actor"), load_reference(root / "actor")
    c2, rm2 = load_critic(root / "critic"), load_reward_model(root / "reward")
    # reloaded configs use transformers' default attention kernel (sdpa, not eager): float noise
    close = {"atol": 1e-6, "rtol": 0.0}
    with torch.no_grad(), eval_mode(actor, critic, a2, c2):
        lp = response_logprobs(actor, batch)[0]
        torch.testing.assert_close(response_logprobs(a2, batch)[0], lp, **close)
        torch.testing.assert_close(response_logprobs(r2, batch)[0], lp, **close)
        torch.testing.assert_close(response_values(c2, batch), response_values(critic, batch), **close)
    torch.testing.assert_close(reward_scores(rm2, batch), reward_scores(rm, batch), **close)
    assert not r2.training and not any(p.requires_grad for p in r2.parameters())
    # any local causal-LM dir gives a critic backbone (value head freshly initialised, seeded)
    c3 = load_critic(root / "actor", seed=5)
    c4 = load_critic(root / "actor", seed=5)
    assert torch.equal(c3.value_head.weight, c4.value_head.weight)
    emb = next(iter(c3.backbone.get_input_embeddings().parameters()))
    assert torch.equal(emb, next(iter(actor.get_input_embeddings().parameters())))


def test_reference_is_a_frozen_copy() -> None:
    actor = tiny_actor("llama", VOCAB, seed=0, hidden=32)
    ref = make_reference(actor)
    batch = ragged_batch()
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    with torch.no_grad():
        before = response_logprobs(ref, batch)[0]
    opt = torch.optim.SGD(actor.parameters(), lr=0.5)
    response_logprobs(actor, batch)[0].sum().backward()
    opt.step()
    with torch.no_grad():
        assert torch.equal(response_logprobs(ref, batch)[0], before)
        assert not torch.equal(response_logprobs(actor, batch)[0], before)


def test_eval_mode_restores_training_flags() -> None:
    actor = tiny_actor("gpt2", VOCAB, seed=0, hidden=32, dropout=0.5)
    actor.train()
    batch = ragged_batch()
    with torch.no_grad(), eval_mode(actor):
        assert not any(m.training for m in actor.modules())
        a, b = response_logprobs(actor, batch)[0], response_logprobs(actor, batch)[0]
    assert torch.equal(a, b)
    assert all(m.training for m in actor.modules())
    with torch.no_grad():
        c = response_logprobs(actor, batch)[0]
    assert not torch.equal(a, c)  # dropout active again


def test_reward_function_gets_unpadded_ids() -> None:
    seen: list[tuple[list[int], list[int]]] = []

    def fn(prompt: list[int], response: list[int]) -> float:
        seen.append((prompt, response))
        return float(len(response))

    batch = ragged_batch()
    s = reward_scores(fn, batch)
    assert s.tolist() == [3.0, 6.0, 1.0, 3.0]
    assert seen[2] == ([9], [2]) and seen[3] == ([1, 11, 0, 13], [0, 12, 0])


@pytest.mark.parametrize("arch", ARCHS)
def test_readouts_are_at_least_float32_under_bfloat16_autocast(arch: Arch) -> None:
    """Under bf16 autocast the read-outs (log-probs, entropy, values) come out float32, on every
    device: the PPO core never computes in bf16 (CUDA's autocast already returns float32 log-probs,
    CPU's returned bf16, and both returned bf16 values); float64 models keep float64."""
    torch.manual_seed(0)
    b = SequenceBatch.from_lists([[4, 5], [6]], [[7], [8, 9]], prompt_width=3, response_width=3)
    actor, critic = tiny_actor(arch), tiny_critic(arch)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        logp, ent = response_logprobs(actor, b)
        v = response_values(critic, b)
    assert (logp.dtype, ent.dtype, v.dtype) == (torch.float32, torch.float32, torch.float32)
    actor64, critic64 = tiny_actor(arch).double(), tiny_critic(arch).double()
    logp64, _ = response_logprobs(actor64, b)
    assert (logp64.dtype, response_values(critic64, b).dtype) == (torch.float64, torch.float64)
