"""Model roles and per-token read-outs: one teacher-forced forward pass over prompt+response each.

Roles (thin wrappers over ``transformers`` models; see spec/models.md)::

    actor      any AutoModelForCausalLM                       π_θ(y_t | x, y_<t)
    reference  a frozen deep copy of the actor's initial weights (eval, requires_grad False)
    critic     :class:`Critic`: an AutoModel backbone + scalar value head, one value per position
    reward     :class:`RewardModel` (AutoModelForSequenceClassification, one label, read at the
               last attention_mask=1 position) or a plain function (prompt_ids, response_ids) -> float

Alignment (one sequence; prompt left-padded to width P, response right-padded to width T)::

    position      0 .. P-2   P-1        P      P+1    ...  P+T-2     P+T-1
    token         pads,x..   x_last     y_0    y_1    ...  y_{T-2}   y_{T-1}
    logits/value  ...        -> y_0     -> y_1 -> y_2 ...  -> y_{T-1} (unused)

    logits at position p score the token at p+1, so the response slice is [P-1, P+T-1);
    V(x, y_<t) is the critic's output at the position of the token before y_t: the same slice.

Causal attention + teacher forcing make each slice entry a function of (x, y_<t) only — the
per-prefix loops of :mod:`refppo.models_naive` compute the same numbers one prefix at a time.
``position_ids = clamp(cumsum(attention_mask) − 1, 0)`` is passed explicitly, so the amount of left
padding changes nothing (rotary models such as Llama depend on it).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import torch
from torch import Tensor, nn

from refppo.core.logprobs import entropy_from_logits, logprobs_from_logits
from refppo.errors import RefPPOError, ShapeError
from refppo.types import SeqFloat, TokenFloat

Arch: TypeAlias = Literal["gpt2", "llama"]
RewardFn: TypeAlias = Callable[[list[int], list[int]], float]
"""A programmatic reward: ``(prompt_ids, response_ids) -> score``; ids without padding, EOS included."""

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
VALUE_HEAD_FILE = "value_head.safetensors"


# ----------------------------------------------------------------------------------------------
# Batches of prompt+response sequences
# ----------------------------------------------------------------------------------------------


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """``clamp(cumsum(mask) − 1, min=0)``: 0 at the first real token whatever the left padding."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


@dataclass(frozen=True)
class SequenceBatch:
    """Prompts LEFT-padded to width P, responses RIGHT-padded to width T.

    ``prompt_ids [B, P]`` (long), ``prompt_mask [B, P]`` (bool, 1 on real prompt tokens, which
    sit at the right end), ``response_ids [B, T]`` (long; padding holds ``pad_token_id``),
    ``response_mask [B, T]`` (bool, 1 on real response tokens — EOS included — at the left end).
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor

    def __post_init__(self) -> None:
        B, P = self.prompt_ids.shape
        if self.prompt_mask.shape != (B, P):
            raise ShapeError(f"prompt_mask: expected [{B}, {P}], got {list(self.prompt_mask.shape)}")
        if self.response_ids.dim() != 2 or self.response_ids.shape[0] != B:
            raise ShapeError(f"response_ids: expected [{B}, T], got {list(self.response_ids.shape)}")
        if self.response_mask.shape != self.response_ids.shape:
            raise ShapeError(
                f"response_mask: expected {list(self.response_ids.shape)}, "
                f"got {list(self.response_mask.shape)}"
            )
        object.__setattr__(self, "prompt_mask", self.prompt_mask.to(torch.bool))
        object.__setattr__(self, "response_mask", self.response_mask.to(torch.bool))
        pm = self.prompt_mask.long()
        if P > 0 and bool((pm[:, 1:] < pm[:, :-1]).any()):
            raise ShapeError("prompt_mask: prompts must be LEFT-padded (mask 0…0 1…1 in each row)")
        rm = self.response_mask.long()
        if rm.shape[1] > 1 and bool((rm[:, 1:] > rm[:, :-1]).any()):
            raise ShapeError("response_mask: responses must be RIGHT-padded (mask 1…1 0…0 in each row)")
        if P == 0 or bool((~self.prompt_mask[:, -1]).any()):
            raise ShapeError("prompt_mask: every prompt needs at least one real token")

    @property
    def batch_size(self) -> int:
        """B."""
        return int(self.prompt_ids.shape[0])

    @property
    def prompt_width(self) -> int:
        """P, the padded prompt width."""
        return int(self.prompt_ids.shape[1])

    @property
    def response_width(self) -> int:
        """T, the padded response width."""
        return int(self.response_ids.shape[1])

    @property
    def B(self) -> int:  # noqa: N802 - paper symbol, alias of batch_size
        """B (alias of :attr:`batch_size`)."""
        return self.batch_size

    @property
    def P(self) -> int:  # noqa: N802 - paper symbol, alias of prompt_width
        """P (alias of :attr:`prompt_width`)."""
        return self.prompt_width

    @property
    def T(self) -> int:  # noqa: N802 - paper symbol, alias of response_width
        """T (alias of :attr:`response_width`)."""
        return self.response_width

    @property
    def input_ids(self) -> Tensor:
        """``[B, P+T]`` prompt then response."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        """``[B, P+T]`` long, 1 on real tokens."""
        return torch.cat([self.prompt_mask, self.response_mask], dim=1).long()

    @property
    def position_ids(self) -> Tensor:
        """``[B, P+T]``, :func:`position_ids_from_mask` of :attr:`attention_mask`."""
        return position_ids_from_mask(self.attention_mask)

    @property
    def response_lengths(self) -> Tensor:
        """``[B]`` number of real response tokens."""
        return self.response_mask.long().sum(dim=1)

    def select(self, index: Tensor) -> SequenceBatch:
        """The rows ``index`` (same widths P and T)."""
        return SequenceBatch(
            self.prompt_ids[index],
            self.prompt_mask[index],
            self.response_ids[index],
            self.response_mask[index],
        )

    def to(self, device: torch.device | str) -> SequenceBatch:
        return SequenceBatch(
            self.prompt_ids.to(device),
            self.prompt_mask.to(device),
            self.response_ids.to(device),
            self.response_mask.to(device),
        )

    def unpadded(self, b: int) -> tuple[list[int], list[int]]:
        """Row ``b`` as Python lists ``(prompt_ids, response_ids)`` without padding."""
        p = [
            int(t)
            for t, ok in zip(self.prompt_ids[b].tolist(), self.prompt_mask[b].tolist(), strict=True)
            if ok
        ]
        r = [
            int(t)
            for t, ok in zip(self.response_ids[b].tolist(), self.response_mask[b].tolist(), strict=True)
            if ok
        ]
        return p, r

    @classmethod
    def from_lists(
        cls,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        *,
        pad_token_id: int = PAD_ID,
        prompt_width: int | None = None,
        response_width: int | None = None,
    ) -> SequenceBatch:
        """Pad Python token lists: prompts on the left to ``prompt_width``, responses on the right."""
        prompt_ids, prompt_mask = left_pad(prompts, pad_token_id, prompt_width)
        response_ids, response_mask = right_pad(responses, pad_token_id, response_width)
        return cls(prompt_ids, prompt_mask, response_ids, response_mask)


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int, width: int | None = None) -> tuple[Tensor, Tensor]:
    """``(ids [B, W], mask [B, W] bool)`` with each sequence flush right."""
    W = max(len(s) for s in seqs) if width is None else width
    if any(len(s) > W for s in seqs):
        raise ShapeError(f"left_pad: a sequence is longer than width {W}")
    ids = torch.full((len(seqs), W), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), W), dtype=torch.bool)
    for b, s in enumerate(seqs):
        if len(s):
            ids[b, W - len(s) :] = torch.tensor(list(s), dtype=torch.long)
            mask[b, W - len(s) :] = True
    return ids, mask


def right_pad(seqs: Sequence[Sequence[int]], pad_id: int, width: int | None = None) -> tuple[Tensor, Tensor]:
    """``(ids [B, W], mask [B, W] bool)`` with each sequence flush left."""
    W = max(len(s) for s in seqs) if width is None else width
    if any(len(s) > W for s in seqs):
        raise ShapeError(f"right_pad: a sequence is longer than width {W}")
    ids = torch.full((len(seqs), W), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), W), dtype=torch.bool)
    for b, s in enumerate(seqs):
        if len(s):
            ids[b, : len(s)] = torch.tensor(list(s), dtype=torch.long)
            mask[b, : len(s)] = True
    return ids, mask


# ----------------------------------------------------------------------------------------------
# Roles
# ----------------------------------------------------------------------------------------------


class Critic(nn.Module):
    """A causal-LM backbone (``AutoModel``) with a scalar value head: one value per position.

    ``forward(input_ids, attention_mask, position_ids) -> [B, S]``. Causal attention: the value
    at position p depends on tokens 0..p only.
    """

    def __init__(self, backbone: Any, value_head: nn.Linear | None = None) -> None:
        super().__init__()
        self.backbone: Any = backbone
        hidden = int(backbone.config.hidden_size)
        self.value_head: nn.Linear = value_head if value_head is not None else nn.Linear(hidden, 1)

    @property
    def config(self) -> Any:
        return self.backbone.config

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        h: Tensor = out.last_hidden_state
        values: Tensor = self.value_head(h).squeeze(-1)
        return values

    def save_pretrained(self, path: str | os.PathLike[str]) -> None:
        """Backbone via ``save_pretrained`` plus ``value_head.safetensors`` in the same directory."""
        from safetensors.torch import save_file

        self.backbone.save_pretrained(path)
        state = {k: v.detach().contiguous().cpu() for k, v in self.value_head.state_dict().items()}
        save_file(state, os.path.join(os.fspath(path), VALUE_HEAD_FILE))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], *, seed: int = 0) -> Critic:
        """Backbone by ``AutoModel.from_pretrained(path)`` (any local model dir, e.g. an SFT
        checkpoint); the value head from ``value_head.safetensors`` if present, else freshly
        initialised with ``seed``."""
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(path)
        head_file = os.path.join(os.fspath(path), VALUE_HEAD_FILE)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            critic = cls(backbone)
        if os.path.exists(head_file):
            from safetensors.torch import load_file

            critic.value_head.load_state_dict(load_file(head_file))
        return critic


class RewardModelError(RefPPOError):
    """A reward-model directory whose weights did not all load (e.g. a causal LM: no score head)."""


def last_valid_index(attention_mask: Tensor) -> Tensor:
    """``[B]`` long: each row's last position with ``attention_mask == 1`` (−1 for an empty row)."""
    S = attention_mask.shape[1]
    pos = torch.arange(S, device=attention_mask.device).expand_as(attention_mask)
    return torch.where(attention_mask.bool(), pos, torch.full_like(pos, -1)).amax(dim=1)


class RewardModel(nn.Module):
    """An ``AutoModelForSequenceClassification`` with one label; score at each row's last real token.

    The read-out is done here, at the last ``attention_mask == 1`` position, instead of relying on
    transformers' pooling (which finds the last token through ``pad_token_id`` and breaks when the
    pad id equals EOS or when a real token equals the pad id).
    """

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model: Any = model
        if int(model.config.num_labels) != 1:
            raise ShapeError(f"RewardModel: expected num_labels=1, got {model.config.num_labels}")
        if not isinstance(getattr(model, "score", None), nn.Module) or not hasattr(model, "base_model"):
            raise ShapeError(
                f"RewardModel: expected a causal-LM sequence classifier with a per-position `score` "
                f"head (GPT-2, Llama, ... ForSequenceClassification), got {type(model).__name__}"
            )

    def per_position(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        """The score head at every position, ``[B, S]`` (the read-out picks one per row)."""
        base = self.model.base_model
        out = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        per_pos: Tensor = self.model.score(out.last_hidden_state).squeeze(-1)
        return per_pos

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> SeqFloat:
        per_pos = self.per_position(input_ids, attention_mask, position_ids)
        last = last_valid_index(attention_mask)
        return per_pos.gather(1, last.unsqueeze(1)).squeeze(1)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> RewardModel:
        """``AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)``, refused with a
        :class:`RewardModelError` unless EVERY weight, the score head included, came from the
        checkpoint: transformers silently initialises a missing head at random (a causal LM
        directory loads "fine" with a random ``score.weight``), and PPO against a random score
        trains on noise. Checked with ``output_loading_info=True`` (``missing_keys``,
        ``mismatched_keys``); transformers' own load report is kept quiet, the error says it all."""
        from transformers import AutoModelForSequenceClassification
        from transformers.utils import logging as hf_logging_module

        hf_logging: Any = hf_logging_module  # untyped module: its functions are called through Any

        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the LOAD REPORT table: replaced by the one-line error below
        try:
            model, info = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=1, output_loading_info=True
            )
        finally:
            hf_logging.set_verbosity(level)
        missing = sorted(info.get("missing_keys") or ())
        mismatched = sorted(
            str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys") or ()
        )
        if missing or mismatched:
            head = [k for k in missing if k.split(".")[0] in ("score", "classifier")]
            what = (
                f"its score head ({', '.join(head)}) is not in the checkpoint — is it a causal LM rather "
                "than a trained reward model (a sequence classifier with one label)?"
                if head
                else f"weights missing from the checkpoint or of another shape: {[*missing, *mismatched][:5]}"
            )
            raise RewardModelError(f"{what} Refusing to score with randomly initialised weights")
        return cls(model)


Reward: TypeAlias = RewardModel | RewardFn
"""A reward model or a plain function; see :func:`reward_scores`."""


def make_reference(actor: nn.Module) -> nn.Module:
    """A frozen copy of ``actor``'s current weights: eval mode, ``requires_grad=False``."""
    ref = copy.deepcopy(actor)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


@contextmanager
def eval_mode(*models: nn.Module) -> Iterator[None]:
    """Put ``models`` in eval mode (dropout off) and restore each one's training flags on exit."""
    saved = [[m.training for m in model.modules()] for model in models]
    try:
        for model in models:
            model.eval()
        yield
    finally:
        for model, flags in zip(models, saved, strict=True):
            for m, flag in zip(model.modules(), flags, strict=True):
                m.training = flag


# ----------------------------------------------------------------------------------------------
# Tiny models (random init from configs; nothing is downloaded)
# ----------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------
# Loading from a local directory (never from a hub)
# ----------------------------------------------------------------------------------------------


def load_actor(path: str | os.PathLike[str]) -> Any:
    """``AutoModelForCausalLM.from_pretrained(path)`` for any local model directory."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def load_reference(path: str | os.PathLike[str]) -> nn.Module:
    """The actor's initial weights from ``path``, frozen (:func:`make_reference`)."""
    ref = load_actor(path)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    out: nn.Module = ref
    return out


def load_critic(path: str | os.PathLike[str], *, seed: int = 0) -> Critic:
    """:meth:`Critic.from_pretrained`."""
    return Critic.from_pretrained(path, seed=seed)


def load_reward_model(path: str | os.PathLike[str]) -> RewardModel:
    """:meth:`RewardModel.from_pretrained`."""
    return RewardModel.from_pretrained(path)


# ----------------------------------------------------------------------------------------------
# Per-token read-outs: ONE teacher-forced forward pass each
# ----------------------------------------------------------------------------------------------


def sequence_logits(model: nn.Module, batch: SequenceBatch, position_ids: Tensor | None = None) -> Tensor:
    """Logits ``[B, P+T, V]`` of one forward pass (``position_ids`` default: ``batch.position_ids``)."""
    pos = batch.position_ids if position_ids is None else position_ids
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=pos)
    logits: Tensor = out.logits
    return logits


def response_slice(per_position: Tensor, P: int, T: int, offset: int = 0) -> Tensor:
    """``per_position[:, P-1+offset : P+T-1+offset]``: the response-aligned read-out (offset 0);
    the oracle's off-by-one hypotheses use ``offset = ±1``. Raises ShapeError when out of range."""
    lo, hi = P - 1 + offset, P + T - 1 + offset
    if lo < 0 or hi > per_position.shape[1]:
        raise ShapeError(f"response_slice: [{lo}, {hi}) is outside [0, {per_position.shape[1]})")
    return per_position[:, lo:hi]


def response_logits(model: nn.Module, batch: SequenceBatch) -> Tensor:
    """Response-aligned logits ``[B, T, V]``: ``logits[:, P-1 : P+T-1]`` of one forward pass."""
    return response_slice(sequence_logits(model, batch), batch.prompt_width, batch.response_width)


def response_logprobs(
    model: nn.Module, batch: SequenceBatch, temperature: float = 1.0
) -> tuple[TokenFloat, TokenFloat]:
    """``(log π(y_t | x, y_<t), H_t)``, both ``[B, T]``, 0 at padding; logits divided by
    ``temperature`` before the log-softmax (:func:`refppo.core.logprobs_from_logits`)."""
    lg = response_logits(model, batch)
    logp = logprobs_from_logits(lg, batch.response_ids, batch.response_mask, temperature=temperature)
    ent = entropy_from_logits(lg, batch.response_mask, temperature=temperature)
    return logp, ent


def value_positions(response_mask: Tensor) -> Tensor:
    """``[B, T]`` bool: the response mask plus the one slot after each row's last valid token.

    ::

        t          0  1  2  3  4  5
        mask       1  1  1  0  0  0
        value pos  1  1  1  1  0  0     slot L=3 holds V(x, y_0..y_2), the state after the last
                                        token (used as a value by score_at=after_last_valid)
    """
    m = response_mask.to(torch.bool)
    shifted = torch.zeros_like(m)
    shifted[:, 1:] = m[:, :-1]
    return m | shifted


def response_values(critic: nn.Module, batch: SequenceBatch) -> TokenFloat:
    """``V(x, y_<t)`` ``[B, T]``: the critic's output at the position of the token before ``y_t``
    (slice ``[P-1, P+T-1)``); defined on :func:`value_positions`, 0 beyond."""
    v: Tensor = critic(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
    )
    vals = response_slice(v, batch.prompt_width, batch.response_width)
    keep = value_positions(batch.response_mask)
    return torch.where(keep, vals, torch.zeros((), dtype=vals.dtype, device=vals.device))


def reward_scores(reward: Reward, batch: SequenceBatch) -> SeqFloat:
    """Scores ``[B]`` (float32): a :class:`RewardModel` over prompt+response (read at the last real
    token), or ``reward(prompt_ids, response_ids)`` per row for a plain function."""
    if isinstance(reward, RewardModel):
        with torch.no_grad(), eval_mode(reward):
            s: Tensor = reward(batch.input_ids, batch.attention_mask, batch.position_ids)
        return s.detach().to(torch.float32)
    vals = [float(reward(*batch.unpadded(b))) for b in range(batch.batch_size)]
    return torch.tensor(vals, dtype=torch.float32, device=batch.prompt_ids.device)
