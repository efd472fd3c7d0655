"""Short built-in warm start (SFT) and reward-model training for the embedded task.

* :func:`sft` — teacher-forced cross-entropy on task samples (response tokens only) for a few
  hundred steps, so PPO starts from a policy that writes well-formed responses, not noise.
* :func:`train_reward_model` — a tiny ``AutoModelForSequenceClassification`` (one label, score read
  at the last real token: :class:`refppo.models.roles.RewardModel`) trained with the Bradley–Terry loss
  ``−log σ(r_chosen − r_rejected)`` on preference pairs labelled by the task's hidden rule, then
  rescaled to unit std on warm-start samples (Ziegler et al. 2019 normalise the reward model too).

Both use :func:`refppo.models.readout.response_logprobs` / :class:`~refppo.models.batch.SequenceBatch`, i.e.
the
same alignment and padding as the PPO pass.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from refppo.models.batch import SequenceBatch
from refppo.models.readout import response_logprobs
from refppo.models.roles import RewardModel
from refppo.train.tasks.words import WordsTask, rule_reward


def _encode(tokenizer: Any, text: str) -> list[int]:
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


def sft(
    model: nn.Module,
    tokenizer: Any,
    task: WordsTask,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    rng: random.Random,
    device: torch.device,
) -> list[float]:
    """Warm-start ``model`` in place; returns the loss per step (mean NLL per response token)."""
    if steps == 0:
        return []
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses: list[float] = []
    model.train()
    for _ in range(steps):
        prompts = [_encode(tokenizer, task.prompt(rng)) for _ in range(batch_size)]
        responses = [_encode(tokenizer, task.response(rng)) for _ in range(batch_size)]
        batch = SequenceBatch.from_lists(prompts, responses, pad_token_id=tokenizer.pad_token_id).to(device)
        logp, _ = response_logprobs(model, batch)
        m = batch.response_mask.to(logp.dtype)
        loss = -(logp * m).sum() / m.sum()
        opt.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


@dataclass(frozen=True)
class RMStats:
    """What reward-model training reached."""

    losses: list[float]
    """Bradley–Terry loss per step."""
    train_accuracy: float
    """Fraction of training pairs ordered correctly at the end."""
    heldout_accuracy: float
    """Fraction of fresh (held-out) pairs ordered correctly."""
    scale: float = 1.0
    """Factor applied to the score head for unit-std scores on warm-start samples."""


def preference_pairs(
    tokenizer: Any,
    task: WordsTask,
    n: int,
    rng: random.Random,
    label: Callable[[str, str], float] = rule_reward,
) -> tuple[SequenceBatch, SequenceBatch]:
    """``n`` (chosen, rejected) pairs over shared prompts, ordered by ``label``; ties are redrawn."""
    prompts: list[list[int]] = []
    chosen: list[list[int]] = []
    rejected: list[list[int]] = []
    while len(prompts) < n:
        p = task.prompt(rng)
        a, b = task.response(rng), task.response(rng)
        sa, sb = label(p, a), label(p, b)
        if sa == sb:
            continue
        hi, lo = (a, b) if sa > sb else (b, a)
        prompts.append(_encode(tokenizer, p))
        chosen.append(_encode(tokenizer, hi))
        rejected.append(_encode(tokenizer, lo))
    pad = tokenizer.pad_token_id
    P = max(len(p) for p in prompts)
    T = max(len(r) for r in chosen + rejected)
    return (
        SequenceBatch.from_lists(prompts, chosen, pad_token_id=pad, prompt_width=P, response_width=T),
        SequenceBatch.from_lists(prompts, rejected, pad_token_id=pad, prompt_width=P, response_width=T),
    )


def _scores(rm: RewardModel, batch: SequenceBatch) -> torch.Tensor:
    out: torch.Tensor = rm(batch.input_ids, batch.attention_mask, batch.position_ids)
    return out


def _accuracy(rm: RewardModel, chosen: SequenceBatch, rejected: SequenceBatch) -> float:
    with torch.no_grad():
        rm.eval()
        acc = float((_scores(rm, chosen) > _scores(rm, rejected)).float().mean())
        rm.train()
    return acc


def train_reward_model(
    rm: RewardModel,
    tokenizer: Any,
    task: WordsTask,
    *,
    pairs: int,
    steps: int,
    batch_size: int,
    lr: float,
    rng: random.Random,
    device: torch.device,
) -> RMStats:
    """Train ``rm`` in place on ``pairs`` rule-labelled preference pairs for ``steps`` steps."""
    chosen, rejected = (b.to(device) for b in preference_pairs(tokenizer, task, max(pairs, 1), rng))
    opt = torch.optim.AdamW(rm.parameters(), lr=lr)
    losses: list[float] = []
    rm.train()
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    n = chosen.B
    for _ in range(steps):
        idx = torch.randint(0, n, (min(batch_size, n),), generator=g).to(device)
        margin = _scores(rm, chosen.select(idx)) - _scores(rm, rejected.select(idx))
        loss = -torch.nn.functional.logsigmoid(margin).mean()
        opt.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        opt.step()
        losses.append(float(loss.detach()))
    train_acc = _accuracy(rm, chosen, rejected)
    hc, hr = (b.to(device) for b in preference_pairs(tokenizer, task, 256, rng))
    held = _accuracy(rm, hc, hr)
    rm.eval()
    scale = normalise_reward_scale(rm, torch.cat([_scores_nograd(rm, hc), _scores_nograd(rm, hr)]))
    return RMStats(losses, train_acc, held, scale)


def _scores_nograd(rm: RewardModel, batch: SequenceBatch) -> torch.Tensor:
    with torch.no_grad():
        return _scores(rm, batch)


def normalise_reward_scale(rm: RewardModel, scores: torch.Tensor) -> float:
    """Rescale the score head so that ``scores`` (of warm-start samples) have unit std (and zero
    mean when the head has a bias), so that β and the KL mean the same whatever the RM's scale.
    Returns the factor applied to the head."""
    head = rm.model.score
    std = float(scores.double().std())
    factor = 1.0 / std if std > 0 else 1.0
    with torch.no_grad():
        head.weight.mul_(factor)
        if getattr(head, "bias", None) is not None:
            head.bias.mul_(factor).sub_(float(scores.double().mean()) * factor)
    return factor
