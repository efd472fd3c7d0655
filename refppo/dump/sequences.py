"""The dump's sequences and the user's checkpoints, as refppo's re-scoring reads them.

Layout (spec/dump-format.md, "Re-scoring keys"): ``input_ids`` and ``attention_mask`` are
``[B, S]`` with ``S = P + T``: the LEFT-padded prompt (width ``P``) followed by the RIGHT-padded
response (width ``T``, the width of ``response_mask``), the layout of verl
(``batch["input_ids"]`` = prompts + responses, ``response_mask`` = the response slice of
``attention_mask``), OpenRLHF (``sequences`` with ``attention_mask``, ``action_mask`` the last
``num_actions`` columns) and TRL (``trl/experimental/ppo/ppo_trainer.py``: ``query_responses`` =
queries + responses; run in ``tools/peers rescore_trl``).
Only the validation and the split into a :class:`refppo.models.batch.SequenceBatch` live here; the
read-outs are :mod:`refppo.models`'.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from refppo.errors import RefPPOError
from refppo.models.batch import SequenceBatch

_INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _rows(bad: Tensor) -> list[int]:
    return [int(i) for i in bad.nonzero().flatten()[:8]]


def validate_sequences(raw: dict[str, Any], response_mask: Tensor) -> dict[str, Tensor]:
    """``input_ids``, ``attention_mask`` (and ``position_ids``) as ``torch.long`` ``[B, P+T]``.

    Raises ValueError with a one-line message (the loader prefixes the file name) on: a key
    without its partner, a non-integer dtype, a shape other than ``[B, S]`` with ``S > T``, a
    mask that is not 0/1, a response part of ``attention_mask`` that differs from
    ``response_mask``, a prompt part that is not left-padded or has no real token, negative ids.
    """
    B, T = (int(s) for s in response_mask.shape)
    present = [k for k in ("input_ids", "attention_mask", "position_ids") if k in raw]
    if "input_ids" not in raw or "attention_mask" not in raw:
        need = "input_ids" if "input_ids" not in raw else "attention_mask"
        raise ValueError(f"{present[0]} is given without {need}: re-scoring needs both [B, P+T] tensors")
    out: dict[str, Tensor] = {}
    for k in present:
        t = raw[k]
        if not isinstance(t, Tensor):
            raise ValueError(f"{k}: expected a tensor, got {type(t).__name__}")
        if t.dtype not in _INTS and not (k == "attention_mask" and t.dtype == torch.bool):
            raise ValueError(f"{k}: expected an integer tensor, got dtype {t.dtype}")
        if t.dim() != 2 or int(t.shape[0]) != B:
            raise ValueError(
                f"{k}: expected shape [B, P+T] with B = {B} (from response_mask), got {list(t.shape)}"
            )
        out[k] = t.detach().to(torch.long)
    S = int(out["input_ids"].shape[1])
    if S <= T:
        raise ValueError(
            f"input_ids: width {S} leaves no prompt before the T = {T} response positions "
            "(expected [B, P+T] with P >= 1: the prompt, then the response)"
        )
    for k in present[1:]:
        if tuple(out[k].shape) != (B, S):
            raise ValueError(f"{k}: expected shape [{B}, {S}] (that of input_ids), got {list(out[k].shape)}")
    if "position_ids" in out and bool((out["position_ids"] < 0).any()):
        raise ValueError(
            f"position_ids: rows {_rows((out['position_ids'] < 0).any(dim=1))} hold negative positions"
        )
    _check_attention(out["attention_mask"], response_mask)
    if bool((out["input_ids"] < 0).any()):
        raise ValueError(f"input_ids: rows {_rows((out['input_ids'] < 0).any(dim=1))} hold negative ids")
    return out


def _check_attention(am: Tensor, response_mask: Tensor) -> None:
    """``attention_mask`` ``[B, S]`` is 0/1, its last ``T`` columns cover ``response_mask`` and are
    right-padded, its first ``S − T`` (the prompt) are left-padded with a real last token."""
    S, T = int(am.shape[1]), int(response_mask.shape[1])
    if bool(((am != 0) & (am != 1)).any()):
        raise ValueError("attention_mask: expected only 0/1 values")
    resp = am[:, S - T :].bool()
    uncovered = (response_mask.bool() & ~resp).any(dim=1)
    if bool(uncovered.any()):
        raise ValueError(
            f"attention_mask: rows {_rows(uncovered)}: a response_mask token is not attended in the last "
            f"T = {T} columns (expected the left-padded prompt, then the response, response_mask ⊆ attention)"
        )
    not_right = (resp[:, 1:] & ~resp[:, :-1]).any(dim=1)
    if bool(not_right.any()):
        raise ValueError(
            f"attention_mask: rows {_rows(not_right)}: the response part is not right-padded (1…1 0…0)"
        )
    prompt = am[:, : S - T]
    not_left = (prompt[:, 1:] < prompt[:, :-1]).any(dim=1)
    if bool(not_left.any()):
        raise ValueError(
            f"attention_mask: rows {_rows(not_left)}: the prompt part is not left-padded (0…0 1…1)"
        )
    empty = prompt[:, -1] == 0
    if bool(empty.any()):
        raise ValueError(f"attention_mask: rows {_rows(empty)} have no real prompt token")


def sequence_batch(tensors: dict[str, Tensor], response_mask: Tensor) -> SequenceBatch:
    """The dump's rows as a :class:`SequenceBatch` (prompt = the first ``S − T`` columns).

    Its ``response_mask`` is the response part of ``attention_mask`` (what the model attends,
    right-padded); the dump's ``response_mask`` (⊆ it) is where the re-score is compared."""
    ids, am = tensors["input_ids"], tensors["attention_mask"]
    P = int(ids.shape[1]) - int(response_mask.shape[1])
    return SequenceBatch(ids[:, :P], am[:, :P].bool(), ids[:, P:], am[:, P:].bool())


class RescoreError(RefPPOError):
    """A checkpoint the re-scoring cannot use (one line; the CLI exits 2)."""


class LabelCritic(nn.Module):
    """A token- or sequence-classification model with one label read at every position: ``[B, S]``.

    ``token``: ``model(...).logits[..., 0]`` (verl 0.9.1's critic is a ``*ForTokenClassification``
    with one label, ``verl/workers/engine/fsdp/transformer_impl.py::FSDPEngineWithValueHead``);
    ``sequence``: the score head applied to every hidden state (TRL 1.12.0's value model,
    ``trl/experimental/utils.py::get_reward``: ``model.score(hidden_states[-1])``; equal
    to refppo's re-score in ``tools/peers rescore_trl``), through
    :meth:`refppo.models.roles.RewardModel.per_position`.
    """

    def __init__(self, model: Any, kind: str) -> None:
        super().__init__()
        from refppo.models.roles import RewardModel

        self.model: Any = model
        self.kind = kind
        self.reader: RewardModel | None = RewardModel(model) if kind == "sequence" else None

    @property
    def config(self) -> Any:
        return self.model.config

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        if self.reader is not None:
            return self.reader.per_position(input_ids, attention_mask, position_ids)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        values: Tensor = out.logits[..., 0]
        return values


def check_model_dir(role: str, path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise RescoreError(f"--{role} {p}: not a local Hugging Face model directory (no config.json)")
    return p


def load_causal_lm(role: str, path: str | os.PathLike[str]) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` of a local directory, in eval mode."""
    from transformers import AutoConfig

    from refppo.models.loading import load_actor

    p = check_model_dir(role, path)
    archs = list(AutoConfig.from_pretrained(p).architectures or [])
    heads = [a for a in archs if a.endswith(("ForSequenceClassification", "ForTokenClassification"))]
    if heads:  # its language-model head would be initialised at random and compared as the trainer's
        raise RescoreError(f"--{role} {p}: expected a causal language model, config.json names {heads}")
    model: nn.Module = load_actor(p)
    return model.eval()


def load_value_model(path: str | os.PathLike[str]) -> nn.Module:
    """The critic: refppo's own (``value_head.safetensors`` present), else a token- or
    sequence-classification checkpoint with one label (:class:`LabelCritic`)."""
    from transformers import AutoConfig

    from refppo.models.loading import load_critic
    from refppo.models.roles import VALUE_HEAD_FILE

    p = check_model_dir("critic", path)
    if (p / VALUE_HEAD_FILE).is_file():
        return load_critic(p).eval()
    archs = list(AutoConfig.from_pretrained(p).architectures or [])
    kind = next(
        (
            k
            for k, s in (("token", "ForTokenClassification"), ("sequence", "ForSequenceClassification"))
            if any(a.endswith(s) for a in archs)
        ),
        None,
    )
    if kind is None:
        raise RescoreError(
            f"--critic {p}: expected refppo's critic ({VALUE_HEAD_FILE}), or a token- or "
            f"sequence-classification model with one label; config.json names {archs or 'no architecture'}"
        )
    return LabelCritic(_load_checked(p, kind), kind).eval()


def _load_checked(p: Path, kind: str) -> Any:
    """The classification model, refused unless every weight came from the checkpoint and it has
    one label (a head initialised at random would be compared as if it were the trainer's)."""
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging_module

    hf_logging: Any = hf_logging_module
    auto: Any = AutoModelForTokenClassification if kind == "token" else AutoModelForSequenceClassification
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = auto.from_pretrained(p, output_loading_info=True)
    finally:
        hf_logging.set_verbosity(level)
    if int(model.config.num_labels) != 1:
        raise RescoreError(
            f"--critic {p}: expected one label (a value per position), got {model.config.num_labels}"
        )
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise RescoreError(
            f"--critic {p}: weights missing from the checkpoint {missing[:5]}; refusing random weights"
        )
    return model
