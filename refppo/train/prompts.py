"""The prompts of an iteration (skeleton step 1 of :mod:`refppo.train.loop`): drawn, grouped,
tokenized, checked against the context and left-padded.

Each prompt must encode to at least one token and at most :func:`max_prompt_tokens` (context −
``rollout.max_new_tokens``, or ``rollout.max_prompt_tokens``); a longer one is an error naming it
(and, from ``task.prompts_file``, its file and line, checked at setup), never truncated.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from refppo.core._group_checks import GROUP_ESTIMATORS
from refppo.group_conventions import GroupSingleton
from refppo.models.batch import left_pad
from refppo.train import group
from refppo.train.config.schema import TrainConfig
from refppo.train.dist import DistContext
from refppo.train.runtime import TrainingError, context_length
from refppo.train.tasks.words import WordsTask


def max_prompt_tokens(actor: nn.Module, max_new_tokens: int, max_prompt: int) -> int:
    """The longest prompt allowed: context − ``max_new_tokens`` (capped by ``max_prompt`` when
    set, ``rollout.max_prompt_tokens``); no limit (10⁹) when neither is known."""
    ctx = context_length(actor)
    T = max_new_tokens
    limit = max_prompt
    if ctx is not None:
        if ctx <= T:
            raise TrainingError(
                f"rollout.max_new_tokens={T} leaves no room for a prompt in a context of {ctx}"
            )
        limit = min(limit, ctx - T) if limit else ctx - T
    return limit or 10**9


class PromptEncoder:
    """Prompt texts → checked token ids, for one tokenizer and context."""

    def __init__(self, tokenizer: Any, *, add_special_tokens: bool, max_tokens: int, device: torch.device):
        self.tokenizer = tokenizer
        self.add_special_tokens = add_special_tokens
        """``task.add_special_tokens``: with the tokenizer's BOS etc."""
        self.max_tokens = max_tokens
        """The longest prompt allowed (:func:`max_prompt_tokens`)."""
        self.device = device

    def tokenize(self, text: str) -> list[int]:
        """The token ids of one prompt."""
        ids: list[int] = self.tokenizer(text, add_special_tokens=self.add_special_tokens)["input_ids"]
        return ids

    def check(self, row: list[int], text: str, where: str = "") -> None:
        """``row`` (the ids of ``text``) is neither empty nor longer than allowed; ``where``
        prefixes the error (``file:line: ``)."""
        if len(row) == 0:
            raise TrainingError(f"{where}prompt {text!r} encodes to no tokens")
        if len(row) > self.max_tokens:
            shown = text if len(text) <= 80 else text[:80] + "…"
            raise TrainingError(
                f"{where}prompt of {len(row)} tokens is longer than the {self.max_tokens} allowed "
                f"(context − rollout.max_new_tokens, or rollout.max_prompt_tokens): {shown!r}"
            )

    def encode(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        """Token ids of ``texts``, checked, left-padded: ``([B, P] ids, [B, P] mask)`` on the device."""
        ids = [self.tokenize(t) for t in texts]
        for t, row in zip(texts, ids, strict=True):
            self.check(row, t)
        pid, pmask = left_pad(ids, int(self.tokenizer.pad_token_id))
        return pid.to(self.device), pmask.to(self.device)

    def read_file(self, path: str) -> list[str]:
        """The prompts of ``path`` (one per line, blank lines skipped), each checked against the
        context now, not mid-run; an error names the file and the line."""
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise TrainingError(
                f"task.prompts_file {path!r} (--prompts): not UTF-8 text (byte {e.start}: {e.reason})"
            ) from None
        except OSError as e:
            raise TrainingError(
                f"task.prompts_file {path!r} (--prompts): cannot read: {e.strerror or e}"
            ) from None
        numbered = [(n, line.strip()) for n, line in enumerate(lines, start=1) if line.strip()]
        if not numbered:
            raise TrainingError(f"task.prompts_file {path!r} holds no prompt")
        for n, text in numbered:
            self.check(self.tokenize(text), text, where=f"{path}:{n}: ")
        return [text for _, text in numbered]


def draw(
    cfg: TrainConfig,
    task: WordsTask,
    rng: random.Random,
    pool: list[str] | None,
    dist: DistContext,
    device: torch.device,
) -> tuple[list[str], Tensor]:
    """This rank's prompts of one iteration, each repeated ``rollout.group_size`` times:
    ``(texts [B], group_index [B])`` (:mod:`refppo.train.group`). Uniform draws from ``pool``
    (``task.prompts_file``) or the embedded task's generator, with this rank's ``rng``."""
    g = cfg.rollout.group_size
    local = cfg.rollout.batch_size // dist.world_size // g  # prompts on this rank
    texts = [rng.choice(pool) for _ in range(local)] if pool is not None else task.prompts(local, rng)
    texts, group_index = group.expand_groups(texts, g, dist.rank)
    if g > 1:  # groups of one are unique by construction; the PPO path gains no collective
        conv = cfg.ppo.convention
        one_row = conv.adv.estimator in GROUP_ESTIMATORS and conv.adv.group_singleton is GroupSingleton.ERROR
        group.check_groups_on_rank(group_index, dist.world_size, device, refuse_one_row=one_row)
    return texts, group_index


__all__ = ["PromptEncoder", "draw", "max_prompt_tokens"]
