"""A refppo dump from TRL's ``GRPOTrainer`` inputs (TRL 1.12.0 / 1.16.0).

``trl/trainer/grpo_trainer.py::GRPOTrainer._generate_and_score_completions`` returns the dict that
``_compute_loss`` reads (``prompt_ids``, ``prompt_mask``, ``completion_ids``, ``completion_mask``,
``advantages`` [B], ``num_items_in_batch``, and when present ``old_per_token_logps``,
``ref_per_token_logps``, ``sampling_per_token_logps``, ``importance_sampling_ratio``, ``tool_mask``).
Key map (TRL → dump):

==============================  ==================================================================
``completion_mask``             ``response_mask`` (times ``tool_mask`` when present: the loss mask)
``old_per_token_logps``         ``old_logprobs`` (the proximal policy; absent when TRL takes the
                                current forward's detached log-probs: then ``logprobs=`` is used)
``sampling_per_token_logps``    ``rollout_logprobs`` (vLLM's log-probs: the behaviour policy)
``ref_per_token_logps``         ``ref_logprobs`` (absent at ``beta = 0``: no reference model)
``advantages`` [B]              ``advantages`` [B, T] = the row's value on its valid tokens, 0 on padding
==============================  ==================================================================

The scores (the weighted sum of the reward functions, before the group normalisation) are not in the
dict: pass them. TRL's groups are contiguous blocks of ``num_generations`` rows on one process
(``rewards.view(-1, num_generations)``): ``group_index = arange(B) // num_generations``.
``importance_sampling_ratio`` is not a dump key (the oracle recomputes the weight from the roles).
Nothing here imports TRL.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from refppo.capture.adapters._common import float_dtype, scalar, update_inputs

TRL_GRPO_INPUTS: dict[str, str] = {
    "old_per_token_logps": "old_logprobs",
    "sampling_per_token_logps": "rollout_logprobs",
    "ref_per_token_logps": "ref_logprobs",
}
"""``GRPOTrainer`` input key → dump key (``completion_mask`` and ``advantages`` are reshaped, above)."""

TRL_LOSS_AGG: dict[str, str] = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dapo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}
"""``GRPOConfig.loss_type`` → ``loss_agg`` on one process (``dapo``: the global token count;
``dr_grpo``: the constant ``max_completion_length``, the sidecar's ``horizon``;
``tools/peers/makers/trl_grpo.py`` checks each against TRL's ``_compute_loss``)."""

TRL_IS_MODES: dict[str, tuple[str, str]] = {
    "token_truncate": ("token", "truncate"),
    "token_mask": ("token", "mask"),
    "sequence_truncate": ("sequence", "truncate"),
    "sequence_mask": ("sequence", "mask"),
}
"""TRL 1.16.0 ``vllm_importance_sampling_mode`` → ``(rollout_is, rollout_is_mode)``; the sequence
weight is the product (``agg=product``; spec/rollout-correction.md, validated by
``tools/peers rollout_correction``)."""


def from_trl_grpo(
    inputs: Mapping[str, Any],
    *,
    scores: Tensor,
    num_generations: int,
    logprobs: Tensor | None = None,
    loss: Any = None,
    pg_loss: Any = None,
    grad_logprobs: Tensor | None = None,
) -> dict[str, Tensor]:
    """``{dump key: tensor}`` from the inputs of one ``GRPOTrainer._compute_loss`` call.

    ``scores`` [B]: the summed rewards of each completion; ``logprobs`` [B, T]: the loss's
    ``per_token_logps`` (a leaf autograd went through gives ``grad_logprobs``); ``loss``: what
    ``_compute_loss`` returned; ``pg_loss``: the same at ``beta = 0``. Raises ``ValueError`` naming a
    missing key.
    """
    missing = [k for k in ("completion_mask", "advantages") if inputs.get(k) is None]
    if missing:
        raise ValueError(f"TRL GRPOTrainer inputs: missing {', '.join(missing)}")
    mask: Tensor = inputs["completion_mask"]
    if inputs.get("tool_mask") is not None:
        mask = mask * inputs["tool_mask"]
    out: dict[str, Tensor] = {"response_mask": mask.detach()}
    for key, dump_key in TRL_GRPO_INPUTS.items():
        t = inputs.get(key)
        if t is not None:
            out[dump_key] = t.detach()
    if "old_logprobs" not in out:
        if logprobs is None:
            raise ValueError(
                "TRL GRPOTrainer inputs: no old_per_token_logps (TRL then uses the current forward's "
                "detached log-probs): pass logprobs="
            )
        out["old_logprobs"] = logprobs.detach().clone()
    adv: Tensor = inputs["advantages"].detach()
    out["advantages"] = (
        adv if adv.dim() == 2 else torch.where(mask.bool(), adv.unsqueeze(1), 0.0).to(adv.dtype)
    )
    if scores.shape != mask.shape[:1]:
        raise ValueError(f"scores: expected shape [{mask.shape[0]}], got {list(scores.shape)}")
    out["scores"] = scores.detach()
    B, n = mask.shape[0], int(num_generations)
    if n < 1 or B % n:
        raise ValueError(
            f"num_generations={num_generations!r}: expected an integer >= 1 dividing the batch's {B} rows"
        )
    out["group_index"] = torch.arange(B, dtype=torch.int64) // n
    out.update(update_inputs(logprobs, None, None, grad_logprobs, None))
    dtype = float_dtype(out["old_logprobs"])
    for key, value in (("loss", loss), ("pg_loss", pg_loss)):
        if value is not None:
            out[key] = scalar(key, value, dtype)
    return out


def trl_grpo_hparams(args: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(hparams, convention)`` from TRL's ``GRPOConfig``: ``beta`` → ``kl_coef``, ``epsilon`` /
    ``epsilon_high`` → ``cliprange`` / ``cliprange_high``; ``scale_rewards`` (``group``/True: GRPO,
    ``none``/False: Dr. GRPO, ``batch``: ``group_std_level=batch``); ``loss_type``
    (:data:`TRL_LOSS_AGG`); with ``use_vllm`` and ``vllm_importance_sampling_correction`` the
    correction of :data:`TRL_IS_MODES` with ``clip_min``/``clip_max`` as the bounds. The KL (β > 0) is
    TRL's k3 loss term (``kl_in=loss``)."""
    eps = float(args.epsilon)
    hp: dict[str, Any] = {
        "kl_coef": float(args.beta),
        "cliprange": eps,
        "cliprange_high": float(getattr(args, "epsilon_high", None) or eps),
    }
    scale = args.scale_rewards
    scale = {True: "group", False: "none"}.get(scale, scale) if isinstance(scale, bool) else str(scale)
    conv: dict[str, Any] = {"advantage": "dr-grpo" if scale == "none" else "grpo", "kl_in": "loss"}
    conv["kl_estimator"] = "k3"
    if scale == "batch":
        conv["group_std_level"] = "batch"
    loss_type = str(args.loss_type)
    if loss_type not in TRL_LOSS_AGG:
        raise ValueError(f"TRL GRPOConfig.loss_type={loss_type!r} has no refppo aggregation here")
    conv["loss_agg"] = TRL_LOSS_AGG[loss_type]
    if loss_type == "dr_grpo":
        hp["horizon"] = float(args.max_completion_length)
    if bool(getattr(args, "use_vllm", False)) and bool(
        getattr(args, "vllm_importance_sampling_correction", False)
    ):
        named = str(getattr(args, "vllm_importance_sampling_mode", None))
        if named not in TRL_IS_MODES:
            raise ValueError(
                f"TRL vllm_importance_sampling_mode={named!r}: expected one of {list(TRL_IS_MODES)}"
            )
        level, mode = TRL_IS_MODES[named]
        conv.update(rollout_is=level, rollout_is_mode=mode, rollout_is_agg="product")
        conv["rollout_is_low"] = getattr(args, "vllm_importance_sampling_clip_min", None)
        conv["rollout_is_high"] = getattr(args, "vllm_importance_sampling_clip_max", None)
    return hp, conv


__all__ = ["TRL_GRPO_INPUTS", "TRL_IS_MODES", "TRL_LOSS_AGG", "from_trl_grpo", "trl_grpo_hparams"]
