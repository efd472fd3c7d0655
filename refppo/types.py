"""Shape-annotated tensor aliases: ONE axis vocabulary for the whole package.

Axis names (jaxtyping strings):

======== ==========================================================
``batch``  B, sequences in the batch
``resp``   T, response positions (right-padded; ``response_mask`` marks real tokens)
``vocab``  V, vocabulary entries of the logits
``seq``    S, positions of a whole prompt+response sequence (model read-outs)
======== ==========================================================

Every tensor argument of the core is response-aligned ``[batch, resp]``: position ``t`` of row
``b`` is response token ``y_t`` of sequence ``b``. Padded positions may hold any junk, NaN and
inf included; the core never lets it reach an output at a valid position.
"""

from __future__ import annotations

from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor

TokenFloat = Float[Tensor, "batch resp"]
"""A float per response position, e.g. log-probs, values, advantages: ``[B, T]``."""

SeqFloat = Float[Tensor, "batch"]
"""A float per sequence, e.g. reward-model scores: ``[B]``."""

Scalar = Float[Tensor, ""]
"""A 0-dim float tensor, e.g. an aggregated loss."""

ResponseMask = Shaped[Tensor, "batch resp"]
"""``[B, T]``, bool or 0/1 numbers; 1 on real response tokens, 0 on padding."""

BoolMask = Bool[Tensor, "batch resp"]
"""A validated, canonical mask: ``[B, T]`` bool."""

Logits = Float[Tensor, "batch resp vocab"]
"""Logits already aligned to the response: ``logits[b, t]`` scores token ``y_t``: ``[B, T, V]``."""

TokenIds = Int[Tensor, "batch resp"]
"""Response token ids ``[B, T]``."""

__all__ = ["BoolMask", "Logits", "ResponseMask", "Scalar", "SeqFloat", "TokenFloat", "TokenIds"]
