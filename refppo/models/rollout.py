"""Rollout and scoring: sample responses, then one teacher-forced, dropout-free pass per model.

Public API (used by :mod:`refppo.ppo` and the trainer)::

    RolloutConfig                       frozen: max_new_tokens, temperature, top_k, top_p, eos/pad ids,
                                        missing_eos_penalty, use_cache
    generate_rollout(actor, prompt_ids, prompt_mask, cfg, generator) -> SequenceBatch
    generate_rollout_logprobs(...)  -> (SequenceBatch, [B, T] the sampler's log-probs: an engine's)
    ScoredRollout                       frozen: batch, old_logprobs, ref_logprobs, old_values, scores, ...
    score_rollout(actor, reference, critic, reward, batch, *, temperature, eos_token_id,
                  missing_eos_penalty=None) -> ScoredRollout

Numbered skeleton (as lm-human-preferences / TRL ppov2)::

    1. sample y ~ π_θ(·|x)/τ token by token (KV cache: each step feeds only the new token); stop
       a row at its first EOS (EOS is a valid response token; everything after it is padding, mask 0)
    2. one forward each, in eval mode (dropout off), under no_grad:
       π_old log-probs (the actor itself, cached — no copy of the actor is kept),
       reference log-probs, critic values V(x, y_<t)
    3. score = reward(x, y); rows without EOS (truncated at max_new_tokens) get
       score − missing_eos_penalty when that option is set (TRL ``missing_eos_penalty``)
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from refppo.core.checks import check_positive
from refppo.errors import HyperparameterError
from refppo.models.batch import EOS_ID, PAD_ID, SequenceBatch, position_ids_from_mask
from refppo.models.readout import response_logprobs, response_values, reward_scores
from refppo.models.roles import Reward, eval_mode
from refppo.types import SeqFloat, TokenFloat


@dataclass(frozen=True)
class RolloutConfig:
    """How responses are sampled and scored."""

    max_new_tokens: int = 16
    """Response width T: rows are right-padded to exactly this many positions."""
    temperature: float = 1.0
    """τ: the sampler draws from softmax(logits/τ); every log-prob (old, ref, current) uses the same τ."""
    top_k: int = 0
    """0 = off. Any other value makes the sampler differ from π/τ (the log-probs ignore the filter)."""
    top_p: float = 1.0
    """1.0 = off. Same caveat as ``top_k``."""
    eos_token_id: int = EOS_ID
    """End of sequence; the first EOS is the last valid response token."""
    pad_token_id: int = PAD_ID
    """Id written at padded response positions (mask 0)."""
    missing_eos_penalty: float | None = None
    """If set, subtracted from the score of every row that reached ``max_new_tokens`` without EOS."""
    use_cache: bool = True
    """Sample with the model's KV cache (``past_key_values``, ``logits_to_keep=1``): each step feeds
    only the new token. ``False`` re-runs the whole prefix every step with no extra keywords (for
    models without a cache, or whose ``forward`` rejects them); same tokens."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise HyperparameterError(f"max_new_tokens: expected >= 1, got {self.max_new_tokens}")
        check_positive("temperature", self.temperature)
        if self.top_k < 0:
            raise HyperparameterError(f"top_k: expected >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise HyperparameterError(f"top_p: expected a number in (0, 1], got {self.top_p}")
        if self.missing_eos_penalty is not None and self.missing_eos_penalty < 0:
            raise HyperparameterError(f"missing_eos_penalty: expected >= 0, got {self.missing_eos_penalty}")


def _filter(probs: Tensor, top_k: int, top_p: float) -> Tensor:
    """Zero out all but the top-k / nucleus-p entries of ``probs`` ``[B, V]`` and renormalise."""
    if top_k > 0 and top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k, dim=-1).values[:, -1:]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly before each entry
        keep_sorted = before < top_p * sorted_p.sum(dim=-1, keepdim=True)
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum(dim=-1, keepdim=True)


def sample_from_logits(logits: Tensor, cfg: RolloutConfig, generator: torch.Generator) -> Tensor:
    """One token per row ``[B]`` from ``softmax(logits/τ)`` by inverse-CDF sampling in float64.

    One uniform per row is drawn from ``generator`` (a CPU generator) at every step, so the
    random stream does not depend on which rows are finished, nor on the device of the model.
    """
    probs = torch.softmax(logits.detach().to(torch.float64) / cfg.temperature, dim=-1)
    probs = _filter(probs, cfg.top_k, cfg.top_p)
    u = torch.rand(probs.shape[0], generator=generator, dtype=torch.float64).to(probs.device)
    cdf = probs.cumsum(dim=-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1)).squeeze(1)
    return idx.clamp(max=probs.shape[-1] - 1)


def _forward_accepts(model: nn.Module, name: str) -> bool:
    """``model.forward`` takes keyword ``name`` (a named parameter, or ``**kwargs``)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # no introspectable signature: do not guess
        return False
    return name in params or any(q.kind is inspect.Parameter.VAR_KEYWORD for q in params.values())


CACHE_DEPRECATION_WARNING = r"`past_key_values` is deprecated"
"""Start of transformers ≥ 5's FutureWarning for the ``past_key_values`` keyword (renamed ``cache``;
removal announced for 5.40, which pyproject's ``transformers<5.40`` excludes)."""
CACHE_DEPRECATION_LOG = "`past_key_values`/`cache_params` are deprecated"
"""The same deprecation, logged once by ``transformers.utils.generic``."""


class _DropMessage(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


@contextlib.contextmanager
def quiet_cache_deprecation() -> Iterator[None]:
    """Silence transformers' ``past_key_values`` deprecation — the FutureWarning (by message and
    category) and its log line (by message) — for the calls made inside, and nothing else: the
    keyword still works in every supported version and the KV-cached rollout relies on it."""
    logger = logging.getLogger("transformers.utils.generic")
    drop = _DropMessage(CACHE_DEPRECATION_LOG)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=CACHE_DEPRECATION_WARNING, category=FutureWarning)
        logger.addFilter(drop)
        try:
            yield
        finally:
            logger.removeFilter(drop)


@torch.no_grad()
def _cache_keywords(actor: nn.Module, cfg: RolloutConfig) -> dict[str, Any]:
    """The cache keywords of every forward: ``use_cache`` (and ``logits_to_keep=1`` where
    ``forward`` takes it) when ``cfg.use_cache`` and ``forward`` takes ``past_key_values``; none
    at all otherwise (any ``forward`` works)."""
    extra: dict[str, Any] = {}
    if cfg.use_cache and _forward_accepts(actor, "past_key_values"):
        extra["use_cache"] = True
        if _forward_accepts(actor, "logits_to_keep"):
            extra["logits_to_keep"] = 1
    return extra


def _forward(actor: nn.Module, ids: Tensor, mask: Tensor, past: Any, extra: dict[str, Any]) -> Any:
    """One decoding step's forward: the whole prefix (``past`` None), else only the newest token
    with the model's cache; the mask covers prompt + every token so far, positions
    ``clamp(cumsum(mask) − 1, 0)``."""
    if past is None:
        return actor(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), **extra)
    return actor(
        input_ids=ids[:, -1:],
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask)[:, -1:],
        past_key_values=past,
        **extra,
    )


def generate_rollout(
    actor: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    cfg: RolloutConfig,
    generator: torch.Generator,
) -> SequenceBatch:
    """Sample one response per LEFT-padded prompt (``[B, P]`` ids and mask), eval mode, no_grad.

    With ``cfg.use_cache`` (default) the first step runs the prompt and keeps the model's
    ``past_key_values``; every later step feeds only the new token, with the full
    ``attention_mask`` so far (left padding and finished rows masked) and its position
    ``clamp(cumsum(mask) − 1, 0)`` — the same positions as the teacher-forced pass. If the model
    returns no ``past_key_values`` the next step re-runs the whole prefix; only the last position's
    logits are computed where ``forward`` takes ``logits_to_keep``. ``use_cache=False``: the plain
    reference path, the whole prefix every step (O(T²)) with only ``input_ids``, ``attention_mask``
    and ``position_ids`` (for a ``forward`` that rejects the cache keywords). Every token goes
    through :func:`sample_from_logits`.
    The loop stops when every row has emitted EOS; the result is right-padded to ``cfg.max_new_tokens``.
    """
    return _generate(actor, prompt_ids, prompt_mask, cfg, generator, None)[0]


def generate_rollout_logprobs(
    actor: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    cfg: RolloutConfig,
    generator: torch.Generator,
    *,
    processed: bool = False,
) -> tuple[SequenceBatch, Tensor]:
    """:func:`generate_rollout` (the same tokens from the same generator draws) that also returns
    the sampler's own log-probs of the sampled tokens, ``[B, T]`` float32, 0 at padding: what an
    inference engine reports (:func:`sampled_logprobs` of each step's logits: ``raw`` or
    ``processed``)."""
    batch, lp = _generate(actor, prompt_ids, prompt_mask, cfg, generator, processed)
    assert lp is not None
    return batch, lp


def sampled_logprobs(logits: Tensor, tokens: Tensor, cfg: RolloutConfig, processed: bool) -> Tensor:
    """``[B]`` log-prob of ``tokens`` ``[B]`` under one step's ``logits`` ``[B, V]``, as an engine
    reports it. Raw: ``log softmax(z/τ)_y`` (float32, the whole vocabulary; vLLM ``raw_logprobs``).
    Processed: ``log p̃_y`` with ``p̃ = filter(softmax(z/τ)) / S`` the top-k / top-p distribution the
    sampler drew from (:func:`sample_from_logits`, float64, then float32), i.e. ``log p_y − log S``
    where ``S`` is the support's mass (vLLM ``processed_logprobs``)."""
    idx = tokens.long().unsqueeze(1)
    if processed:
        probs = torch.softmax(logits.detach().to(torch.float64) / cfg.temperature, dim=-1)
        return _filter(probs, cfg.top_k, cfg.top_p).gather(1, idx).squeeze(1).log().float()
    return torch.log_softmax(logits.detach().float() / cfg.temperature, dim=-1).gather(1, idx).squeeze(1)


def _generate(
    actor: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    cfg: RolloutConfig,
    generator: torch.Generator,
    processed: bool | None,
) -> tuple[SequenceBatch, Tensor | None]:
    """The sampling loop of :func:`generate_rollout`; ``processed`` not None: also the sampled
    tokens' log-probs (:func:`sampled_logprobs`), else None."""
    device = prompt_ids.device
    B = prompt_ids.shape[0]
    ids = prompt_ids.long()
    mask = prompt_mask.long()
    responses = torch.full((B, cfg.max_new_tokens), cfg.pad_token_id, dtype=torch.long, device=device)
    rmask = torch.zeros((B, cfg.max_new_tokens), dtype=torch.bool, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    lps = None if processed is None else torch.zeros((B, cfg.max_new_tokens), device=device)
    extra = _cache_keywords(actor, cfg)
    cached = bool(extra)
    past: Any = None  # the model's cache after the previous step (None: run the whole prefix)
    quiet = quiet_cache_deprecation() if cached else contextlib.nullcontext()
    with eval_mode(actor), quiet:
        for t in range(cfg.max_new_tokens):
            out = _forward(actor, ids, mask, past, extra)
            if cached:
                past = getattr(out, "past_key_values", None)
            nxt = sample_from_logits(out.logits[:, -1, :], cfg, generator)
            alive = ~done
            if lps is not None and processed is not None:
                lp = sampled_logprobs(out.logits[:, -1, :], nxt, cfg, processed)
                lps[:, t] = torch.where(alive, lp, torch.zeros_like(lp))
            nxt = torch.where(alive, nxt, torch.full_like(nxt, cfg.pad_token_id))
            responses[:, t] = nxt
            rmask[:, t] = alive
            done = done | (alive & (nxt == cfg.eos_token_id))
            ids = torch.cat([ids, nxt.unsqueeze(1)], dim=1)
            mask = torch.cat([mask, alive.long().unsqueeze(1)], dim=1)
            if bool(done.all()):
                break
    return SequenceBatch(prompt_ids, prompt_mask, responses, rmask), lps


@dataclass(frozen=True)
class ScoredRollout:
    """Everything cached at rollout time (all detached). ``[B, T]`` tensors are 0 at padding."""

    batch: SequenceBatch
    old_logprobs: TokenFloat
    """log π_old(y_t | x, y_<t): the actor's log-probs at sampling time (teacher-forced, eval mode)."""
    ref_logprobs: TokenFloat
    """log π_ref(y_t | x, y_<t)."""
    old_values: TokenFloat
    """V_old(x, y_<t)."""
    old_entropy: TokenFloat
    """Entropy of π_old/τ per token (for logging)."""
    raw_scores: SeqFloat
    """Reward before the missing-EOS penalty."""
    scores: SeqFloat
    """Reward after the missing-EOS penalty: the score that enters the token rewards."""
    has_eos: Tensor
    """``[B]`` bool: the response contains EOS (else it was truncated)."""
    temperature: float = 1.0
    """τ used for every log-prob of this rollout; the PPO update recomputes with the same τ."""

    def select(self, index: Tensor) -> ScoredRollout:
        """The rows ``index``."""
        return ScoredRollout(
            self.batch.select(index),
            self.old_logprobs[index],
            self.ref_logprobs[index],
            self.old_values[index],
            self.old_entropy[index],
            self.raw_scores[index],
            self.scores[index],
            self.has_eos[index],
            self.temperature,
        )


def has_eos(batch: SequenceBatch, eos_token_id: int) -> Tensor:
    """``[B]`` bool: some valid response token is EOS."""
    return ((batch.response_ids == eos_token_id) & batch.response_mask).any(dim=1)


@torch.no_grad()
def score_rollout(
    actor: nn.Module,
    reference: nn.Module,
    critic: nn.Module | None,
    reward: Reward,
    batch: SequenceBatch,
    *,
    temperature: float = 1.0,
    eos_token_id: int = EOS_ID,
    missing_eos_penalty: float | None = None,
) -> ScoredRollout:
    """Step 2–3 of the module docstring: one teacher-forced, dropout-free pass per model.

    Models are put in eval mode for the pass and restored to their previous mode afterwards.
    ``critic=None`` (a critic-free estimator): no value pass; ``old_values`` are zeros of the
    log-probs' shape, a stand-in no critic-free step reads.
    """
    models = (actor, reference) if critic is None else (actor, reference, critic)
    with eval_mode(*models):
        old_logprobs, old_entropy = response_logprobs(actor, batch, temperature)
        ref_logprobs, _ = response_logprobs(reference, batch, temperature)
        old_values = torch.zeros_like(old_logprobs) if critic is None else response_values(critic, batch)
    raw = reward_scores(reward, batch).to(old_values.dtype)
    eos = has_eos(batch, eos_token_id)
    scores = raw
    if missing_eos_penalty is not None:
        scores = raw - missing_eos_penalty * (~eos).to(raw.dtype)
    return ScoredRollout(
        batch,
        old_logprobs.detach(),
        ref_logprobs.detach(),
        old_values.detach(),
        old_entropy.detach(),
        raw,
        scores,
        eos,
        temperature,
    )
