"""The reference gradient of one optimizer step, by autograd through ``refppo.pipeline`` (dump v2).

``J_ref`` is the pipeline's ``loss`` over the dump's ``B`` rows taken as ONE batch — the rows are
the whole optimizer step, so the normalisers of :func:`refppo.pipeline.step.update_quantities` (token
count, sequence count, horizon) are the step's global ones::

    J_ref = pg_loss + vf_coef·vf_loss − ent_coef·entropy_loss + kl_coef·kl_loss   (kl_in = loss)
    grad_logprobs[b, t] = ∂J_ref/∂logprobs[b, t]        grad_values[b, t] = ∂J_ref/∂values[b, t]

``grad_values`` is ``vf_coef·∂vf_loss/∂values`` (the only term of ``J`` that reads ``values``),
also for a critic with its own optimizer (``separate_critic``), where ``vf_coef`` is the value loss's
weight in the critic's objective. Positions outside the policy mask (``grad_logprobs``) or the value
mask (``grad_values``) get 0: a trainer's nonzero gradient there is a padding leak.

Ties at a clip boundary: where the trainer's rounding can put a token on either side of ``1 ± ε``
(or ``|V − V_old| = ε_v``, or equal value-loss branches), the dump may hold either branch's
gradient; there the reference takes whichever branch's gradient is nearest the dump: its own, the
unclipped one (the same pipeline with the clip removed) or the clipped one (:func:`reference_grads`).
The tie tokens are those that widen the clip fractions' tolerance
(:func:`refppo.oracle.check.recompute.pg_tie_mask`, ``vf_tie_mask``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from refppo.conventions import ValueLoss
from refppo.dump.tolerances import Tolerance
from refppo.oracle.check.settings import Setup
from refppo.pipeline.blocks import Normalisers
from refppo.pipeline.stages import UPDATE_STAGES, Stage
from refppo.pipeline.step import update_grads, update_inputs

GRAD_QUANTITIES: tuple[str, ...] = ("grad_logprobs", "grad_values")

NO_CLIP = 1.0 - 1e-12
"""A policy clip range that never binds (``1 − ε`` > 0 is the lower bound, ratios are > 0)."""


def grad_tolerance(tol: Tolerance) -> Tolerance:
    """``tol = (rtol + atol)·max|ref grad|``: both terms relative to the gradient's scale.

    A gradient has no absolute unit: the step's normaliser (``1/N_tokens``, ``1/B``, ``1/W``)
    scales every token's gradient, so an absolute ``atol`` would pass any gradient of a large step
    (``1/N`` below ``atol``) and the verdict would change with the batch size. Taking the dump
    dtype's ``atol`` relative to ``max|ref grad|`` keeps it scale-free: ``c·J`` gets the same verdict
    as ``J`` for any constant ``c``, and the per-token rounding of a trainer in that dtype (the
    dtype's relative error on the O(1) per-token factor ``A·ρ`` or ``V − R``) stays inside it.
    """
    return Tolerance(rtol=tol.rtol + tol.atol, atol=0.0)


@dataclass(frozen=True)
class UpdateInputs:
    """The tensors :func:`refppo.pipeline.step.update_quantities` takes, as the reference has them."""

    logprobs: Tensor
    values: Tensor
    old_logprobs: Tensor
    old_values: Tensor
    advantages: Tensor
    returns: Tensor
    mask: Tensor
    value_mask: Tensor
    ref_logprobs: Tensor | None
    """None where no KL term reads it (:func:`refppo.pipeline.needs.kl_loss_needs`)."""
    entropy: Tensor | None
    rollout_logprobs: Tensor | None = None
    """The behaviour log-probs (read by the rollout correction only when it is on)."""
    truncated: Tensor | None = None
    """[B] rows out of the loss under ``truncated_rows`` ≠ ``keep`` (:mod:`refppo.pipeline.row_subset`)."""
    group_index: Tensor | None = None
    """The prompt of each row ``[B]`` (read by ``loss_agg=prompt-mean`` only)."""

    def take(self, rows: Tensor) -> UpdateInputs:
        """The same inputs restricted to ``rows`` (an index tensor)."""
        kept: dict[str, Any] = {
            k: None if (v := getattr(self, k)) is None else v[rows] for k in self.__dataclass_fields__
        }
        return UpdateInputs(**kept)


def pipeline_grads(
    inp: UpdateInputs,
    setup: Setup,
    *,
    norm: Normalisers | None = None,
    objective: str = "loss",
    stages: Sequence[Stage] = UPDATE_STAGES,
) -> dict[str, Tensor]:
    """``∂J/∂logprobs``, ``∂J/∂values`` [B, T], and the (detached) ``ratio`` [B, T].

    ``J`` is the update stages' ``objective`` (``loss`` or ``pg_loss``) under ``setup`` and ``norm``
    (``stages``: a bug's variant of them), differentiated by the grads stage
    (:func:`refppo.pipeline.step.update_grads`); the gradients are 0 outside the policy / value mask
    (see the module docstring)."""
    q = update_inputs(
        logprobs=inp.logprobs, values=inp.values, old_logprobs=inp.old_logprobs, old_values=inp.old_values,
        advantages=inp.advantages, returns=inp.returns, mask=inp.mask, value_mask_=inp.value_mask,
        ref_logprobs=inp.ref_logprobs, entropy=inp.entropy, rollout_logprobs=inp.rollout_logprobs,
        truncated=inp.truncated,
        group_index=inp.group_index,
    )  # fmt: skip
    return update_grads(q, hp=setup.hp, conv=setup.conv, norm=norm, objective=objective, stages=stages)


def unclipped(setup: Setup) -> Setup:
    """``setup`` with the policy clip (and dual clip) and the value clip removed."""
    hp = replace(setup.hp, cliprange=NO_CLIP, cliprange_high=1e12)
    conv = setup.conv.with_updates({"dual_clip": None, "value_loss": ValueLoss.UNCLIPPED})
    return Setup(conv, hp)


def reference_grads(
    inp: UpdateInputs,
    setup: Setup,
    dump: dict[str, Tensor],
    ties: dict[str, Tensor],
    *,
    stages: Sequence[Stage] = UPDATE_STAGES,
) -> dict[str, Tensor]:
    """The reference ``grad_*`` present in ``dump``; at ``ties[name]`` tokens the branch nearest the dump.

    The branches of a tie token: the reference's own gradient, the unclipped branch's (the pipeline
    with the clip removed) and the clipped branch's, whose policy or value term is constant there:
    for ``grad_logprobs`` the unclipped gradient less its ``pg_loss`` part (the KL-loss part stays),
    for ``grad_values`` 0.
    """
    ref = pipeline_grads(inp, setup, stages=stages)
    out = {k: ref[k] for k in GRAD_QUANTITIES if k in dump}
    tied = {k: t for k, t in ties.items() if k in out and bool(t.any())}
    if tied:
        free = unclipped(setup)
        alt = pipeline_grads(inp, free, stages=stages)
        pg_free = pipeline_grads(inp, free, objective="pg_loss", stages=stages)["grad_logprobs"]
        clipped = {
            "grad_logprobs": alt["grad_logprobs"] - pg_free,
            "grad_values": torch.zeros_like(alt["grad_values"]),
        }
        for k, t in tied.items():
            best = out[k]
            for cand in (alt[k], clipped[k]):
                nearer = (dump[k] - cand).abs() < (dump[k] - best).abs()
                best = torch.where(t & nearer, cand, best)
            out[k] = best
    return out


__all__ = [
    "GRAD_QUANTITIES",
    "UpdateInputs",
    "grad_tolerance",
    "pipeline_grads",
    "reference_grads",
    "unclipped",
]
