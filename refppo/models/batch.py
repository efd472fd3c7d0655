"""Batches of prompt+response sequences: prompts LEFT-padded to width P, responses RIGHT-padded to T.

The layout every read-out of :mod:`refppo.models` assumes (see :mod:`refppo.models` for the
alignment table)::

    prompt_ids [B, P]    pads, x_0 .. x_last        prompt_mask   0…0 1…1
    response_ids [B, T]  y_0 .. y_{L-1}, pads       response_mask 1…1 0…0

``position_ids = clamp(cumsum(attention_mask) − 1, 0)``: 0 at the first real token whatever the
amount of left padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from refppo.errors import ShapeError

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2


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
