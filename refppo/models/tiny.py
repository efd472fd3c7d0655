"""Tiny models built from configs with a seeded random init (nothing is downloaded).

GPT-2 (learned absolute positions) or Llama (rotary, RMSNorm, SwiGLU); pad/bos/eos = 0/1/2,
eager attention. Each builder forks the CPU RNG, so building a model leaves the global RNG as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeAlias

import torch

from refppo.models.batch import BOS_ID, EOS_ID, PAD_ID
from refppo.models.roles import Critic, RewardModel

Arch: TypeAlias = Literal["gpt2", "llama"]


def tiny_config(
    arch: Arch,
    vocab_size: int = 128,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 2,
    max_positions: int = 128,
    dropout: float = 0.0,
    num_labels: int | None = None,
) -> Any:
    """A ``GPT2Config`` or ``LlamaConfig`` with tiny sizes, pad/bos/eos = 0/1/2, eager attention."""
    from transformers import GPT2Config, LlamaConfig

    cfg: Any
    ids: dict[str, Any] = {"pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID}
    if num_labels is not None:
        ids["num_labels"] = num_labels
        ids["id2label"] = {i: f"LABEL_{i}" for i in range(num_labels)}
        ids["label2id"] = {f"LABEL_{i}": i for i in range(num_labels)}
    if arch == "gpt2":
        cfg = GPT2Config(
            vocab_size=vocab_size,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            n_positions=max_positions,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            summary_first_dropout=dropout,
            **ids,
        )
    elif arch == "llama":
        cfg = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            max_position_embeddings=max_positions,
            attention_dropout=dropout,
            tie_word_embeddings=False,
            **ids,
        )
    else:
        raise ValueError(f"arch: unknown {arch!r}; valid: 'gpt2', 'llama'")
    cfg._attn_implementation = "eager"
    return cfg


def _seeded(seed: int, build: Callable[[], Any]) -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def tiny_actor(arch: Arch, vocab_size: int = 128, *, seed: int = 0, **kw: Any) -> Any:
    """A tiny ``AutoModelForCausalLM`` (random init with ``seed``); ``kw`` go to :func:`tiny_config`."""
    from transformers import AutoModelForCausalLM

    auto: Any = AutoModelForCausalLM
    cfg = tiny_config(arch, vocab_size, **kw)
    return _seeded(seed, lambda: auto.from_config(cfg))


def tiny_gpt2(vocab_size: int = 128, *, seed: int = 0, **kw: Any) -> Any:
    """Tiny GPT-2 causal LM (learned absolute positions)."""
    return tiny_actor("gpt2", vocab_size, seed=seed, **kw)


def tiny_llama(vocab_size: int = 128, *, seed: int = 0, **kw: Any) -> Any:
    """Tiny Llama-style causal LM (rotary positions, RMSNorm, SwiGLU)."""
    return tiny_actor("llama", vocab_size, seed=seed, **kw)


def tiny_critic(arch: Arch, vocab_size: int = 128, *, seed: int = 1, **kw: Any) -> Critic:
    """A tiny :class:`Critic` (``AutoModel`` backbone + value head)."""
    from transformers import AutoModel

    auto: Any = AutoModel
    cfg = tiny_config(arch, vocab_size, **kw)
    critic: Critic = _seeded(seed, lambda: Critic(auto.from_config(cfg)))
    return critic


def tiny_reward_model(arch: Arch, vocab_size: int = 128, *, seed: int = 2, **kw: Any) -> RewardModel:
    """A tiny :class:`RewardModel` (sequence classification, one label)."""
    from transformers import AutoModelForSequenceClassification

    auto: Any = AutoModelForSequenceClassification
    cfg = tiny_config(arch, vocab_size, num_labels=1, **kw)
    rm: RewardModel = _seeded(seed, lambda: RewardModel(auto.from_config(cfg)))
    return rm
