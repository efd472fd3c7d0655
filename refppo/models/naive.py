"""Naive twins of :mod:`refppo.models`' read-outs: notes Q7/Q8 taken literally, one prefix at a time.

For each sequence alone (no padding at all) and each response position ``t``, the model is run
on the prefix ``(x, y_<t)`` and its LAST position is read: that is ``log π(y_t | x, y_<t)`` (via
:func:`refppo.core.logprobs.logprobs_from_logits_naive`, in float64 Python arithmetic) and
``V(x, y_<t)``. No causal mask is relied on — the future is simply not in the input. The batched
single pass of :mod:`refppo.models` must equal these (tests/models/test_models.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from refppo.core.logprobs import entropy_from_logits_naive, logprobs_from_logits_naive
from refppo.models.batch import SequenceBatch
from refppo.models.readout import value_positions
from refppo.models.roles import RewardModel, eval_mode
from refppo.types import SeqFloat, TokenFloat


def _run(model: nn.Module, ids: list[int], device: torch.device) -> Any:
    x = torch.tensor([ids], dtype=torch.long, device=device)
    ones = torch.ones_like(x)
    pos = torch.arange(len(ids), device=device).unsqueeze(0)
    return model(input_ids=x, attention_mask=ones, position_ids=pos)


def prefix_logits(model: nn.Module, prefix: list[int], device: torch.device) -> Tensor:
    """Logits ``[V]`` at the last position of ``model`` run on ``prefix`` alone."""
    out = _run(model, prefix, device)
    logits: Tensor = out.logits
    return logits[0, -1, :]


def prefix_value(critic: nn.Module, prefix: list[int], device: torch.device) -> Tensor:
    """0-dim ``V(prefix)``: the critic's output at the last position of ``prefix`` run alone."""
    out: Tensor = _run(critic, prefix, device)
    return out[0, -1]


def response_logprobs_naive(
    model: nn.Module, batch: SequenceBatch, temperature: float = 1.0
) -> tuple[TokenFloat, TokenFloat]:
    """``(log π(y_t | x, y_<t), H_t)`` ``[B, T]``, one unpadded prefix forward per (b, t)."""
    B, T = batch.batch_size, batch.response_width
    device = batch.prompt_ids.device
    logp = torch.zeros(B, T, dtype=torch.float32, device=device)
    ent = torch.zeros(B, T, dtype=torch.float32, device=device)
    for b in range(B):
        x, y = batch.unpadded(b)
        for t in range(len(y)):
            lg = prefix_logits(model, x + y[:t], device).detach().reshape(1, 1, -1)
            tok = torch.tensor([[y[t]]], device=device)
            logp[b, t] = logprobs_from_logits_naive(lg, tok, temperature=temperature)[0, 0]
            ent[b, t] = entropy_from_logits_naive(lg, temperature=temperature)[0, 0]
    return logp, ent


def response_values_naive(critic: nn.Module, batch: SequenceBatch) -> TokenFloat:
    """``V(x, y_<t)`` ``[B, T]`` on :func:`refppo.models.readout.value_positions`, one prefix forward each."""
    B, T = batch.batch_size, batch.response_width
    device = batch.prompt_ids.device
    keep = value_positions(batch.response_mask)
    vals = torch.zeros(B, T, dtype=torch.float32, device=device)
    for b in range(B):
        x, y = batch.unpadded(b)
        for t in range(T):
            if bool(keep[b, t]):
                vals[b, t] = prefix_value(critic, x + y[:t], device).detach()
    return vals


def reward_scores_naive(reward: RewardModel, batch: SequenceBatch) -> SeqFloat:
    """Scores ``[B]``: the reward model on each unpadded ``x + y``, read at its last position."""
    device = batch.prompt_ids.device
    out = []
    with torch.no_grad(), eval_mode(reward):
        for b in range(batch.batch_size):
            x, y = batch.unpadded(b)
            ids = torch.tensor([x + y], dtype=torch.long, device=device)
            ones = torch.ones_like(ids)
            pos = torch.arange(ids.shape[1], device=device).unsqueeze(0)
            out.append(float(reward(ids, ones, pos)[0]))
    return torch.tensor(out, dtype=torch.float32, device=device)
