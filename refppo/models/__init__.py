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
per-prefix loops of :mod:`refppo.models.naive` compute the same numbers one prefix at a time.
``position_ids = clamp(cumsum(attention_mask) − 1, 0)`` is passed explicitly, so the amount of left
padding changes nothing (rotary models such as Llama depend on it).

Modules: :mod:`~refppo.models.batch` (:class:`SequenceBatch`, padding),
:mod:`~refppo.models.roles` (:class:`Critic`, :class:`RewardModel`, reference, eval mode),
:mod:`~refppo.models.readout` (the per-token read-outs above), :mod:`~refppo.models.tiny` (tiny
seeded models from configs), :mod:`~refppo.models.loading` (local directories). This module
re-exports them all; ``refppo.models.X`` is the import path the rest of the code uses. The naive
twins are :mod:`~refppo.models.naive` (not re-exported here).
"""

from __future__ import annotations

from refppo.models.batch import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SequenceBatch,
    left_pad,
    position_ids_from_mask,
    right_pad,
)
from refppo.models.loading import load_actor, load_critic, load_reference, load_reward_model
from refppo.models.readout import (
    response_logits,
    response_logprobs,
    response_slice,
    response_values,
    reward_scores,
    sequence_logits,
    value_positions,
)
from refppo.models.roles import (
    VALUE_HEAD_FILE,
    Critic,
    Reward,
    RewardFn,
    RewardModel,
    RewardModelError,
    eval_mode,
    last_valid_index,
    make_reference,
)
from refppo.models.tiny import (
    Arch,
    tiny_actor,
    tiny_config,
    tiny_critic,
    tiny_gpt2,
    tiny_llama,
    tiny_reward_model,
)

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "VALUE_HEAD_FILE",
    "Arch",
    "Critic",
    "Reward",
    "RewardFn",
    "RewardModel",
    "RewardModelError",
    "SequenceBatch",
    "eval_mode",
    "last_valid_index",
    "left_pad",
    "load_actor",
    "load_critic",
    "load_reference",
    "load_reward_model",
    "make_reference",
    "position_ids_from_mask",
    "response_logits",
    "response_logprobs",
    "response_slice",
    "response_values",
    "reward_scores",
    "right_pad",
    "sequence_logits",
    "tiny_actor",
    "tiny_config",
    "tiny_critic",
    "tiny_gpt2",
    "tiny_llama",
    "tiny_reward_model",
    "value_positions",
]
