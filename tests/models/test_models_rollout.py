"""refppo.models.rollout: sampling (EOS, padding, determinism, distribution) and scoring."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from refppo.errors import HyperparameterError
from refppo.models.batch import EOS_ID, PAD_ID, left_pad
from refppo.models.roles import make_reference
from refppo.models.rollout import RolloutConfig, generate_rollout, score_rollout
from refppo.models.tiny import Arch, tiny_actor, tiny_critic

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
    # softmax: e² = 7.389 of Σ = 7.389 + 2.718 + 1 + 0.368 + 1.649 + 1 = 14.124, so p(0) ≈ 0.523 ≥ 0.5:
    # the nucleus is token 0 alone
    assert set(batch.response_ids[:, 0].tolist()) == {0}


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


# ----------------------------------------------------------------------------------------------
# KV cache: the cached sampler (one new token per step) equals the full-prefix sampler
# ----------------------------------------------------------------------------------------------


class Recorder(nn.Module):
    """Wraps a real causal LM: records each call's input width and last-position logits, adds
    ``bias`` to the logits (EOS made likely) and KEEPS ``past_key_values``. ``corrupt`` injects a
    bug into the incremental (one-token) calls: ``"positions"`` uses the padded width − 1 as the
    position (ignores the left padding, the classic cache bug), ``"mask"`` attends to the pads."""

    def __init__(self, inner: nn.Module, bias: Tensor, corrupt: str | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("bias", bias)
        self.corrupt = corrupt
        self.widths: list[int] = []
        self.cached_calls = 0
        self.logits: list[Tensor] = []
        self.keywords: set[str] = set()

    def forward(self, **kw: Any) -> Any:
        self.keywords |= set(kw)
        width = kw["input_ids"].shape[1]
        self.widths.append(width)
        self.cached_calls += kw.get("past_key_values") is not None
        if width == 1 and kw.get("past_key_values") is not None:
            if self.corrupt == "positions":
                kw["position_ids"] = torch.full_like(kw["position_ids"], kw["attention_mask"].shape[1] - 1)
            elif self.corrupt == "mask":
                kw["attention_mask"] = torch.ones_like(kw["attention_mask"])
        out = self.inner(**kw)
        logits = out.logits[:, -1:, :] + self.bias
        self.logits.append(logits[:, -1, :].clone())
        return SimpleNamespace(logits=logits, past_key_values=getattr(out, "past_key_values", None))


def ragged_prompts() -> tuple[Tensor, Tensor]:
    """Left-padded prompts of lengths 1..7 (row 0: six pads; the longest row: none)."""
    return left_pad([[1, *[3 + (i * j) % 9 for j in range(i)]] for i in range(7)] * 2, PAD_ID)


def cached_and_uncached(
    arch: Arch, seed: int, corrupt: str | None = None
) -> tuple[Recorder, Recorder, Any, Any]:
    bias = torch.zeros(VOCAB)
    bias[EOS_ID] = 1.5  # some rows stop early, so finished rows (mask 0) enter the cache too
    model = tiny_actor(arch, VOCAB, seed=0, hidden=32)
    pids, pm = ragged_prompts()
    runs = []
    for use_cache in (True, False):
        rec = Recorder(model, bias, corrupt if use_cache else None)
        cfg = RolloutConfig(max_new_tokens=12, temperature=0.7, use_cache=use_cache)
        runs.append((rec, generate_rollout(rec, pids, pm, cfg, torch.Generator().manual_seed(seed))))
    (rc, bc), (ru, bu) = runs
    return rc, ru, bc, bu


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kv_cache_same_tokens_as_full_prefix(arch: Arch, seed: int) -> None:
    rc, ru, bc, bu = cached_and_uncached(arch, seed)
    steps = len(ru.widths)
    # the cache is really used: prompt once, then one token per step; the reference re-runs all
    assert rc.widths == [7] + [1] * (steps - 1) and rc.cached_calls == steps - 1
    assert ru.widths == list(range(7, 7 + steps)) and ru.cached_calls == 0
    plain = {"input_ids", "attention_mask", "position_ids"}
    assert rc.keywords == plain | {"past_key_values", "use_cache", "logits_to_keep"}
    assert ru.keywords == plain  # use_cache=False: the plain reference call
    lengths = bu.response_mask.sum(1)
    assert int(lengths.min()) < int(lengths.max())  # ragged: rows finish at different steps
    # per-step next-token logits agree to float rounding (different matmul shapes) ...
    assert len(rc.logits) == steps
    for a, b in zip(rc.logits, ru.logits, strict=True):
        assert a.shape == b.shape == (14, VOCAB)  # logits_to_keep=1: only the last position
        torch.testing.assert_close(a, b, rtol=0.0, atol=1e-5)
    # ... and the tokens and masks are identical (on these seeds; a float64 uniform landing within
    # ~1e-7 of a CDF boundary could flip a token, which none of these seeds does)
    assert torch.equal(bc.response_ids, bu.response_ids)
    assert torch.equal(bc.response_mask, bu.response_mask)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("corrupt", ["positions", "mask"])
def test_kv_cache_check_detects_wrong_positions_or_mask(arch: Arch, corrupt: str) -> None:
    """The comparison above can fail: a cache step with the position ignoring the left padding
    (GPT-2: wrong learned embedding; Llama: wrong rotary offset to the prompt) or a mask that
    attends to the pads changes the logits of the padded rows, and the sampled tokens."""
    rc, ru, bc, bu = cached_and_uncached(arch, 0, corrupt)
    padded = torch.arange(14) % 7 != 6  # every row but the longest prompt's
    diff = (rc.logits[1] - ru.logits[1]).abs().amax(dim=1)
    assert float(diff[padded].min()) > 1e-4  # >= 10x the 1e-5 tolerance (Llama: ~3e-4 at least)
    assert float(diff[~padded].max()) < 1e-5  # unpadded rows are unaffected by this bug
    if arch == "llama" and corrupt == "positions":
        # a wrong rotary offset moves this random-init Llama's logits by only ~3e-4: no token
        # flips on this seed. The tokens alone would miss the bug; the per-step logits catch it.
        assert torch.equal(bc.response_ids, bu.response_ids)
    else:
        assert not torch.equal(bc.response_ids, bu.response_ids)


def test_model_without_cache_falls_back_to_full_prefix() -> None:
    """A model that returns no ``past_key_values`` (``Biased`` drops them) re-runs the prefix."""
    pids, pm = ragged_prompts()
    model = eos_model()
    widths: list[int] = []
    real_forward = model.forward

    def forward(**kw: Any) -> Any:
        widths.append(kw["input_ids"].shape[1])
        assert kw.get("past_key_values") is None
        return real_forward(**kw)

    model.forward = forward  # type: ignore[method-assign]  # instance-level spy on the calls
    a = generate_rollout(model, pids, pm, RolloutConfig(max_new_tokens=6), torch.Generator().manual_seed(3))
    assert widths == list(range(7, 7 + len(widths))) and len(widths) > 1
    b = generate_rollout(
        model, pids, pm, RolloutConfig(max_new_tokens=6, use_cache=False), torch.Generator().manual_seed(3)
    )
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
