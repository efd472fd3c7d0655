"""Per-token read-outs: ONE teacher-forced forward pass over prompt+response each.

::

    position      0 .. P-2   P-1        P      P+1    ...  P+T-2     P+T-1
    token         pads,x..   x_last     y_0    y_1    ...  y_{T-2}   y_{T-1}
    logits/value  ...        -> y_0     -> y_1 -> y_2 ...  -> y_{T-1} (unused)

Logits at position p score the token at p+1, so the response slice is ``[P-1, P+T-1)``;
``V(x, y_<t)`` is the critic's output at the position of the token before ``y_t``: the same slice.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from refppo.core.logprobs import entropy_from_logits, logprobs_from_logits
from refppo.errors import ShapeError
from refppo.models.batch import SequenceBatch
from refppo.models.roles import Reward, RewardModel, eval_mode
from refppo.types import SeqFloat, TokenFloat


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


def at_least_float32(x: Tensor) -> Tensor:
    """``x`` in float32 when its dtype is narrower (bf16/fp16 under autocast), else unchanged.

    Autocast's op lists differ by device: on CUDA ``log_softmax`` runs in float32 while ``linear``
    (the value head) stays bf16; CPU's keeps both in bf16. The read-outs promote, so the PPO core gets
    one dtype on every device and never computes ratios, advantages or losses in bf16. The cast is
    differentiable; float32/float64 pass through untouched.
    """
    return x.to(torch.promote_types(x.dtype, torch.float32))


def response_logprobs(
    model: nn.Module, batch: SequenceBatch, temperature: float = 1.0
) -> tuple[TokenFloat, TokenFloat]:
    """``(log π(y_t | x, y_<t), H_t)``, both ``[B, T]``, 0 at padding; logits divided by
    ``temperature`` before the log-softmax (:func:`refppo.core.logprobs.logprobs_from_logits`); at least
    float32 (:func:`at_least_float32`)."""
    lg = response_logits(model, batch)
    logp = logprobs_from_logits(lg, batch.response_ids, batch.response_mask, temperature=temperature)
    ent = entropy_from_logits(lg, batch.response_mask, temperature=temperature)
    return at_least_float32(logp), at_least_float32(ent)


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
    (slice ``[P-1, P+T-1)``); defined on :func:`value_positions`, 0 beyond; at least float32."""
    v: Tensor = critic(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
    )
    vals = at_least_float32(response_slice(v, batch.prompt_width, batch.response_width))
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
