"""A refppo dump from OpenRLHF 0.11.2's own ``Experience`` and its loss outputs.

``openrlhf/trainer/ppo_utils/experience.py::Experience`` holds one PPO batch after
``experience_maker.py::compute_advantages_and_returns``; the update is
``openrlhf/trainer/ray/ppo_actor.py::training_step`` (``PolicyLoss`` → ``actor_loss, clip_ratio,
ppo_kl, …``; ``experience.info["ppo_clip_ratio"]``, ``["ppo_kl"]``) and ``ppo_critic.py``
(``ValueLoss``). Field map (``Experience`` → dump):

==========================  ===================================================================
``action_mask``             ``response_mask``
``action_log_probs``        ``old_logprobs`` (experience-time actor log-probs: the proximal policy)
``rollout_log_probs``       ``rollout_logprobs`` (vLLM's log-probs: the behaviour policy; optional)
``base_action_log_probs``   ``ref_logprobs`` (optional: None at β = 0 and unless ``algo.kl.use_loss``)
``values``                  ``old_values`` (experience-time critic values; None without a critic)
``rewards``                 ``scores`` (one per sample: the reward-model score, before
                            ``compute_reward`` adds the KL and clips)
``kl``                      ``kl`` (``compute_advantages_and_returns`` sets it to None: pass it
                            as ``kl=`` if you kept it)
``advantages``/``returns``  ``advantages`` (after the batch whitening) / ``returns``
``info["ppo_clip_ratio"]``  ``pg_clipfrac``; ``info["ppo_kl"]`` → ``approx_kl``
==========================  ===================================================================

The update's forward outputs (``action_log_probs`` of the actor in ``training_step``, the critic's
``values``, entropy) and the losses are not kept in the ``Experience``: pass them. Leaves that
autograd went through (``requires_grad_()`` before ``PolicyLoss``/``ValueLoss``, then
``backward``) give ``grad_logprobs``/``grad_values`` from their ``.grad``. Nothing here imports
OpenRLHF.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from refppo.capture.adapters._common import float_dtype, from_metrics, row_origin, scalar, update_inputs

OPENRLHF_FIELDS: dict[str, str] = {
    "action_mask": "response_mask",
    "action_log_probs": "old_logprobs",
    "rollout_log_probs": "rollout_logprobs",
    "base_action_log_probs": "ref_logprobs",
    "values": "old_values",
    "rewards": "scores",
    "kl": "kl",
    "advantages": "advantages",
    "returns": "returns",
}
"""``Experience`` field → dump key."""

OPENRLHF_INFO: dict[str, str] = {"ppo_clip_ratio": "pg_clipfrac", "ppo_kl": "approx_kl"}
"""``experience.info`` key (set by ``ppo_actor.training_step``) → dump key."""

_REQUIRED = ("action_mask", "action_log_probs", "rewards")
"""``values`` (a critic) and ``base_action_log_probs`` (a reference) are optional: the oracle requires
what its setting reads (one line naming the key and the stage)."""


def _field(experience: Any, name: str) -> Tensor | None:
    value = getattr(experience, name, None)
    if value is not None and not isinstance(value, Tensor):
        raise TypeError(f"Experience.{name}: expected a tensor, got {type(value).__name__}")
    return value


def from_openrlhf(
    experience: Any,
    *,
    policy_loss: Tensor | Sequence[Any] | None = None,
    value_loss: Any = None,
    logprobs: Tensor | None = None,
    values: Tensor | None = None,
    entropy: Tensor | None = None,
    kl: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    token_rewards: Tensor | None = None,
    entropy_loss: Any = None,
    kl_loss: Any = None,
    loss: Any = None,
    grad_logprobs: Tensor | None = None,
    grad_values: Tensor | None = None,
    micro_batch: Tensor | None = None,
    rank: Tensor | None = None,
) -> dict[str, Tensor]:
    """``{dump key: tensor}`` from an OpenRLHF ``Experience`` and the update's outputs.

    ``policy_loss``: what ``PolicyLoss.forward`` returned (the tuple ``(loss, clip_ratio, ppo_kl,
    …)``, or the loss alone); ``value_loss``: ``ValueLoss.forward``'s output; ``token_rewards``: the
    output of ``models/utils.py::compute_reward`` (not kept in the ``Experience``); ``loss``: the
    actor's total (``actor_loss + kl_loss·kl_ctl − entropy_loss·entropy_coef``); the rest as in
    :func:`refppo.capture.adapters.verl.from_verl`. ``ref_logprobs``: with ``algo.kl.use_loss`` off,
    ``make_experience`` drops ``base_action_log_probs`` (it sets them to None once ``kl`` is
    computed): with a KL in the reward (β > 0) keep them and pass them here (without them the oracle
    refuses the dump in one line naming ``ref_logprobs`` and the kl stage; at β = 0 none is needed).
    Raises ``ValueError`` naming a missing field.
    """
    out = _experience_tensors(experience, ref_logprobs, kl, token_rewards)
    out.update(update_inputs(logprobs, values, entropy, grad_logprobs, grad_values))
    dtype = float_dtype(out["old_logprobs"])
    info = getattr(experience, "info", None) or {}
    out.update(from_metrics(info, OPENRLHF_INFO, dtype))
    if policy_loss is not None:
        parts = [policy_loss] if isinstance(policy_loss, Tensor) else list(policy_loss)
        for key, value in zip(("pg_loss", "pg_clipfrac", "approx_kl"), parts, strict=False):
            out[key] = scalar(f"PolicyLoss output {key}", value, dtype)
    for key, value in (
        ("vf_loss", value_loss),
        ("entropy_loss", entropy_loss),
        ("kl_loss", kl_loss),
        ("loss", loss),
    ):
        if value is not None:
            out[key] = scalar(key, value[0] if isinstance(value, tuple) else value, dtype)
    out.update(row_origin(micro_batch, rank))
    return out


def _experience_tensors(
    experience: Any, ref_logprobs: Tensor | None, kl: Tensor | None, token_rewards: Tensor | None
) -> dict[str, Tensor]:
    """The ``Experience``'s fields as dump keys (:data:`OPENRLHF_FIELDS`, detached), with the
    tensors it does not keep given by the caller; ``ValueError`` naming the missing fields."""
    missing = [k for k in _REQUIRED if _field(experience, k) is None]
    if missing:
        raise ValueError(f"OpenRLHF Experience: missing {', '.join(missing)} (needed for a dump)")
    out: dict[str, Tensor] = {}
    for name, key in OPENRLHF_FIELDS.items():
        t = _field(experience, name)
        if t is not None:
            out[key] = t.detach()
    for key, given in (("ref_logprobs", ref_logprobs), ("kl", kl), ("token_rewards", token_rewards)):
        if given is not None:
            out[key] = given.detach()
    return out


def openrlhf_hparams(args: Any, *, kl_coef: float | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(hparams, convention)`` for the sidecar from OpenRLHF's nested ``args``.

    Reads ``args.algo.advantage.{gamma, lambd}``, ``args.algo.kl.{init_coef, estimator, use_loss}``,
    ``args.actor.{eps_clip_low_high, dual_clip, entropy_coef, loss_agg_mode}``,
    ``args.critic.value_clip`` and ``args.reward.clip_range`` (the names
    ``trainer/ray/ppo_actor.py`` and ``experience_maker.py`` read). ``kl_coef`` overrides
    ``init_coef`` (an adaptive controller's value). The critic has its own optimizer
    (``ppo_critic.py``): ``separate_critic`` is true and ``vf_coef`` 1.
    """
    lo, hi = (float(x) for x in args.actor.eps_clip_low_high)
    hp: dict[str, Any] = {
        "gamma": float(args.algo.advantage.gamma),
        "lam": float(args.algo.advantage.lambd),
        "kl_coef": float(args.algo.kl.init_coef if kl_coef is None else kl_coef),
        "cliprange": lo,
        "cliprange_high": hi,
        "cliprange_value": float(args.critic.value_clip),
        "vf_coef": 1.0,
        "ent_coef": float(args.actor.entropy_coef or 0.0),
        "separate_critic": True,
    }
    agg = str(getattr(args.actor, "loss_agg_mode", "token-mean"))
    conv: dict[str, Any] = {
        "kl_estimator": str(args.algo.kl.estimator),
        "kl_in": "loss" if bool(args.algo.kl.use_loss) else "reward",
        # ppo_actor builds PolicyLoss(token_level_loss=loss_agg_mode == "token-mean"); the other
        # mode of aggregate_loss is a mean of per-sequence token means
        "loss_agg": "token-mean" if agg == "token-mean" else "seq-mean-token-mean",
    }
    conv.update(openrlhf_correction(args))
    dual = getattr(args.actor, "dual_clip", None)
    if dual is not None:
        conv["dual_clip"] = float(dual)
    clip = getattr(args.reward, "clip_range", None)
    if clip is not None:
        lo_r, hi_r = (float(x) for x in clip)
        if lo_r != -hi_r:
            raise ValueError(f"OpenRLHF args.reward.clip_range {clip}: refppo's score_clip is symmetric")
        conv["score_clip"] = hi_r
    return hp, conv


def openrlhf_correction(args: Any) -> dict[str, Any]:
    """The ``rollout_is*`` keys of OpenRLHF's vLLM IS correction (``args.algo.advantage.
    is_correction_{level, mode, gating, threshold}``, read by ``models/loss.py::PolicyLoss``):
    ``level`` ``token`` with the ``ratio`` gating, ``mode`` ``clip`` (truncate to ``[lo, hi]``) or
    ``mask``. ``off`` (or absent): no keys. The sequence level and the divergence gatings are
    refused with one line (not validated against OpenRLHF's code here)."""
    adv: Any = getattr(getattr(args, "algo", None), "advantage", None)
    level = str(getattr(adv, "is_correction_level", "off") or "off")
    if level == "off":
        return {}
    gating = str(getattr(adv, "is_correction_gating", "ratio"))
    if level != "token" or gating != "ratio":
        raise ValueError(
            f"OpenRLHF args.algo.advantage: is_correction_level={level!r}, is_correction_gating={gating!r}: "
            "only the token level with the ratio gating has a refppo counterpart here"
        )
    try:
        lo, hi = (float(v) for v in getattr(adv, "is_correction_threshold", ()))
    except (TypeError, ValueError):
        raise ValueError(
            f"OpenRLHF is_correction_threshold={getattr(adv, 'is_correction_threshold', None)!r}: "
            "expected a pair [low, high]"
        ) from None
    named = getattr(adv, "is_correction_mode", None)
    mode = {"clip": "truncate", "mask": "mask"}.get(str(named))
    if mode is None:
        raise ValueError(f"OpenRLHF is_correction_mode={named!r}: expected clip or mask")
    return {"rollout_is": "token", "rollout_is_mode": mode, "rollout_is_low": lo, "rollout_is_high": hi}


__all__ = ["OPENRLHF_FIELDS", "OPENRLHF_INFO", "from_openrlhf", "openrlhf_correction", "openrlhf_hparams"]
