"""Model roles: the critic (backbone + value head), the reward model, the frozen reference.

::

    actor      any AutoModelForCausalLM                       π_θ(y_t | x, y_<t)
    reference  :func:`make_reference`: a frozen deep copy of the actor (eval, requires_grad False)
    critic     :class:`Critic`: an AutoModel backbone + scalar value head, one value per position [B, S]
    reward     :class:`RewardModel` (AutoModelForSequenceClassification, one label, read at the
               last attention_mask=1 position, [B]) or a plain function (prompt_ids, response_ids) -> float
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeAlias

import torch
from torch import Tensor, nn

from refppo.errors import RefPPOError, ShapeError
from refppo.types import SeqFloat

RewardFn: TypeAlias = Callable[[list[int], list[int]], float]
"""A programmatic reward: ``(prompt_ids, response_ids) -> score``; ids without padding, EOS included."""

VALUE_HEAD_FILE = "value_head.safetensors"


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
