"""A refppo dump from verl 0.9.1's own containers: the ``DataProto`` batch and the loss metrics.

verl keeps one PPO step in the ``TensorDict`` of a ``DataProto`` (``verl/protocol.py``), filled by
``verl/trainer/ppo/ray_trainer.py`` (``apply_kl_penalty``, ``compute_advantage``), and reports the
update's losses as metrics of ``verl/workers/utils/losses.py::ppo_loss`` / ``value_loss``
(``verl.utils.metric.Metric`` objects, or plain numbers once reduced). Key map (verl → dump):

=========================  ===================================================================
``response_mask``          ``response_mask`` (else ``attention_mask[:, -responses.size(1):]``,
                           as ``ray_trainer.compute_response_mask`` slices it)
``old_log_probs``          ``old_logprobs`` (the proximal policy: the trainer's recompute)
``rollout_log_probs``      ``rollout_logprobs`` (the behaviour policy: the engine's log-probs,
                           ``trainer/ppo/rollout_corr_helper.py``); optional
``ref_log_prob``           ``ref_logprobs`` (optional: absent without a KL term)
``values``                 ``old_values`` (rollout-time critic values; absent without a critic)
``token_level_scores``     ``scores`` = row sums (the reward manager puts the score on one token)
``token_level_rewards``    ``token_rewards``
``advantages``/``returns`` ``advantages``/``returns``
``actor/pg_loss`` ...      ``pg_loss``, ``pg_clipfrac``, ``approx_kl`` (``actor/ppo_kl``),
                           ``entropy_loss``, ``kl_loss``, ``vf_loss``, ``vf_clipfrac``
=========================  ===================================================================

The update-step tensors are not in the batch (verl's engine pops the model output): pass the
actor forward's ``log_probs`` / ``entropy`` and the critic's ``vpreds`` as ``[B, T]`` (padded)
tensors. When they are leaves that autograd went through (``requires_grad_()`` before verl's
loss, then ``backward``), their ``.grad`` becomes ``grad_logprobs`` / ``grad_values`` (dump v2).
Nothing here imports verl.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from refppo.capture.adapters._common import (
    batch_of,
    float_dtype,
    from_metrics,
    get,
    row_origin,
    scalar,
    update_inputs,
)

VERL_BATCH: dict[str, str] = {
    "old_log_probs": "old_logprobs",
    "rollout_log_probs": "rollout_logprobs",
    "ref_log_prob": "ref_logprobs",
    "values": "old_values",
    "token_level_rewards": "token_rewards",
    "advantages": "advantages",
    "returns": "returns",
}
"""verl batch key → dump key (``response_mask`` and ``scores`` are derived, see the module doc)."""

VERL_METRICS: dict[str, str] = {
    "actor/pg_loss": "pg_loss",
    "actor/pg_clipfrac": "pg_clipfrac",
    "actor/ppo_kl": "approx_kl",
    "actor/entropy_loss": "entropy_loss",
    "kl_loss": "kl_loss",  # ppo_loss's own name
    "actor/kl_loss": "kl_loss",  # after the worker prefixes it
    "critic/vf_loss": "vf_loss",
    "critic/vf_clipfrac": "vf_clipfrac",
}
"""verl metric name → dump key."""

VERL_KL: dict[str, str] = {
    "kl": "k1",
    "k1": "k1",
    "mse": "k2",
    "k2": "k2",
    "low_var_kl": "k3",
    "k3": "k3",
    "abs": "abs",
    # straight-through (verl 0.9.1 core_algos.kl_penalty: the base's value, ½d²'s gradient);
    # k2+/mse+ return plain k2 there (½d²'s value and gradient either way)
    "kl+": "k1+",
    "k1+": "k1+",
    "low_var_kl+": "k3+",
    "k3+": "k3+",
    "abs+": "abs+",
    "mse+": "k2",
    "k2+": "k2",
}
"""verl's ``kl_penalty`` / ``kl_loss_type`` names → refppo's ``kl_estimator``."""

_REQUIRED = ("old_log_probs", "token_level_scores")
"""The reference (``ref_log_prob``) and the critic (``values``) are optional: a step with β = 0 has no
reference, a critic-free one no values; the oracle requires what its setting reads (one line)."""


def from_verl(
    batch: Any,
    metrics: Mapping[str, Any] | None = None,
    *,
    logprobs: Tensor | None = None,
    values: Tensor | None = None,
    entropy: Tensor | None = None,
    kl: Tensor | None = None,
    loss: Any = None,
    grad_logprobs: Tensor | None = None,
    grad_values: Tensor | None = None,
    micro_batch: Tensor | None = None,
    rank: Tensor | None = None,
) -> dict[str, Tensor]:
    """``{dump key: tensor}`` from a verl ``DataProto`` (or its ``.batch``) and its loss metrics.

    Args: ``batch`` — after ``compute_advantage``; ``metrics`` — ``ppo_loss``/``value_loss``
    metrics of the step (a ``Metric`` summed over micro-batches is read with ``aggregate()``; a
    mean over several micro-batches is refused, see ``_common.scalar``); ``logprobs``, ``values``,
    ``entropy`` [B, T] — the update's forward outputs, padded like ``responses``; ``kl`` [B, T] —
    ``kl_penalty(old_log_probs, ref_log_prob)`` if you kept it; ``loss`` — the ``policy_loss``
    ``ppo_loss`` returned (summed over micro-batches); ``grad_*`` — explicit gradients (default:
    ``.grad`` of ``logprobs`` / ``values``); ``micro_batch``, ``rank`` [B] — the micro-batch and the
    data-parallel rank of each row (dump v2; the sidecar then names ``micro_batches``/``world_size``).
    Raises ``ValueError`` naming the verl key that is missing.
    """
    b = batch_of(batch)
    missing = [k for k in _REQUIRED if get(b, k) is None]
    if missing:
        raise ValueError(f"verl batch: missing {', '.join(missing)} (needed for a dump; spec/dump-format.md)")
    out: dict[str, Tensor] = {}
    mask = get(b, "response_mask")
    if mask is None:
        responses, attention = get(b, "responses"), get(b, "attention_mask")
        if responses is None or attention is None:
            raise ValueError("verl batch: missing response_mask (and responses/attention_mask to derive it)")
        mask = attention[:, -responses.size(1) :]
    out["response_mask"] = mask.detach()
    for verl_key, key in VERL_BATCH.items():
        t = get(b, verl_key)
        if t is not None:
            out[key] = t.detach()
    scores = get(b, "token_level_scores")
    assert scores is not None  # checked in _REQUIRED
    out["scores"] = scores.detach().sum(dim=-1)
    if kl is not None:
        out["kl"] = kl.detach()
    out.update(update_inputs(logprobs, values, entropy, grad_logprobs, grad_values))
    dtype = float_dtype(out["old_logprobs"])
    out.update(from_metrics(metrics, VERL_METRICS, dtype))
    if loss is not None:
        out["loss"] = scalar("loss", loss, dtype)
    out.update(row_origin(micro_batch, rank))
    return out


def _cfg(config: Any, path: str, default: Any = None) -> Any:
    """``config.a.b.c`` through mappings (dict, OmegaConf) or attributes; ``default`` if absent."""
    node = config
    for part in path.split("."):
        node = node.get(part, None) if isinstance(node, Mapping) else getattr(node, part, None)
        if node is None:
            return default
    return node


def verl_hparams(config: Any, *, kl_coef: float | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(hparams, convention)`` for the sidecar, read from verl's trainer config.

    Reads ``algorithm.{gamma, lam, use_kl_in_reward, kl_penalty, kl_ctrl.kl_coef, rollout_correction}``
    (:func:`verl_correction`),
    ``actor_rollout_ref.actor.{clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c,
    loss_agg_mode, entropy_coeff, use_kl_loss, kl_loss_coef, kl_loss_type, loss_scale_factor}`` and
    ``critic.{cliprange_value, loss_agg_mode}`` (verl/trainer/config/ppo_trainer.yaml). ``kl_coef``
    overrides the coefficient (an adaptive controller's value at the step: ``kl_ctrl.value``).
    verl's critic has its own optimizer: ``separate_critic`` is true, ``vf_coef`` is 1 (the value
    loss's weight in the critic's objective) and the dump's ``loss`` is the actor's.
    """
    actor = _cfg(config, "actor_rollout_ref.actor", {})
    use_kl_loss = bool(_cfg(actor, "use_kl_loss", False))
    both = use_kl_loss and bool(_cfg(config, "algorithm.use_kl_in_reward", False))  # the loss's own keys:
    use_kl_loss = use_kl_loss and not both  # _kl_loss_keys; the reward's here
    est_name = str(
        _cfg(actor, "kl_loss_type", "low_var_kl")
        if use_kl_loss
        else _cfg(config, "algorithm.kl_penalty", "kl")
    )
    if est_name not in VERL_KL:
        raise ValueError(
            f"verl config: kl estimator {est_name!r} has no refppo counterpart; valid: {sorted(VERL_KL)}"
        )
    if use_kl_loss:
        coef = _cfg(actor, "kl_loss_coef", 0.001)
    elif bool(_cfg(config, "algorithm.use_kl_in_reward", False)):
        coef = _cfg(config, "algorithm.kl_ctrl.kl_coef", 0.001)
    else:  # no KL anywhere: ray_trainer copies token_level_scores to token_level_rewards
        coef = 0.0
    clip = float(_cfg(actor, "clip_ratio", 0.2))
    hp: dict[str, Any] = {
        "gamma": float(_cfg(config, "algorithm.gamma", 1.0)),
        "lam": float(_cfg(config, "algorithm.lam", 1.0)),
        "kl_coef": float(coef if kl_coef is None else kl_coef),
        "cliprange": float(_cfg(actor, "clip_ratio_low", clip)),
        "cliprange_high": float(_cfg(actor, "clip_ratio_high", clip)),
        "cliprange_value": float(_cfg(config, "critic.cliprange_value", 0.5)),
        "vf_coef": 1.0,
        "ent_coef": float(_cfg(actor, "entropy_coeff", 0.0)),
        "separate_critic": True,
    }
    scale = _cfg(actor, "loss_scale_factor", None)
    if scale is not None:
        hp["horizon"] = float(scale)
    agg = str(_cfg(actor, "loss_agg_mode", "token-mean"))
    conv: dict[str, Any] = {
        "kl_estimator": VERL_KL[est_name],
        "kl_in": "both" if both else ("loss" if use_kl_loss else "reward"),
        "loss_agg": agg,
        "dual_clip": float(_cfg(actor, "clip_ratio_c", 3.0)),
    }
    critic_agg = _cfg(config, "critic.loss_agg_mode", None)
    if critic_agg is not None and str(critic_agg) != agg:
        conv["value_loss_agg"] = str(critic_agg)
    conv.update(verl_correction(_cfg(config, "algorithm.rollout_correction", None)))
    if both:
        hp["kl_loss_coef"], conv["kl_loss_estimator"] = _kl_loss_keys(actor)
    return hp, conv


def _kl_loss_keys(actor: Any) -> tuple[float, str]:
    """``(kl_loss_coef, kl_loss_estimator)`` of ``kl_in=both`` (``use_kl_in_reward`` and
    ``actor.use_kl_loss`` both on): verl's loss keeps its own ``actor.kl_loss_coef`` and
    ``kl_loss_type`` (``verl/workers/utils/losses.py::ppo_loss``) beside the reward's."""
    name = str(_cfg(actor, "kl_loss_type", "low_var_kl"))
    if name not in VERL_KL:
        raise ValueError(
            f"verl config: kl estimator {name!r} has no refppo counterpart; valid: {sorted(VERL_KL)}"
        )
    return float(_cfg(actor, "kl_loss_coef", 0.001)), VERL_KL[name]


def verl_correction(rc: Any) -> dict[str, Any]:
    """The ``rollout_is*`` convention keys of verl's ``algorithm.rollout_correction``
    (``trainer/config/algorithm.py::RolloutCorrectionConfig``, applied by
    ``rollout_corr_helper.py::compute_rollout_correction_and_add_to_batch``): ``rollout_is``
    ``token``/``sequence`` (None: no weight), ``rollout_is_threshold`` a number (TIS: truncate at it)
    or ``"lo_hi"`` (IcePop: mask outside ``[lo, hi]``); the rejection sampling ``rollout_rs`` as the
    ``rollout_rs*`` keys (:func:`verl_rejection`). The batch normalisation and the bypass mode have no
    refppo key: refused with one line."""
    if rc is None:
        return {}
    for key, off in (("rollout_is_batch_normalize", False), ("bypass_mode", False)):
        value = _cfg(rc, key, off)
        if value not in (off, None, False):
            raise ValueError(f"verl config: rollout_correction.{key}={value!r} has no refppo counterpart")
    gate = verl_rejection(_cfg(rc, "rollout_rs", None), _cfg(rc, "rollout_rs_threshold", None))
    level = _cfg(rc, "rollout_is", None)
    if level is None:
        return gate
    return {**_verl_is(level, _cfg(rc, "rollout_is_threshold", 2.0)), **gate}


_RS_STAT = {"k1": "ratio", "k2": "k2", "k3": "k3"}
_RS_LEVEL = {"token": ("token", None), "seq_sum": ("sequence", "sum"), "seq_mean": ("sequence", "mean"),
             "seq_max": ("sequence", "max")}  # fmt: skip


def verl_rejection(option: Any, threshold: Any) -> dict[str, Any]:
    """The ``rollout_rs*`` keys of verl 0.9.1's rejection sampling (``rollout_corr_helper.py::
    compute_rollout_rejection_mask``): ``token_k1|k2|k3``, ``seq_sum_*``, ``seq_mean_*``,
    ``seq_max_k2|k3`` on ``x = −(l^old − l^rollout)`` (``behaviour`` order); a ``*_k1`` threshold is a
    ratio band ``"lo_hi"`` (or ``hi``, ``lo = 1/hi``: refppo's ``ratio`` statistic), a k2/k3 one an
    upper bound. The trainer writes the kept tokens into ``response_mask`` before
    ``compute_advantage``: ``rollout_rs_effect=drop_mask``. None: no gate. Chained options
    (``"token_k1,seq_max_k2"``) have no refppo key (one gate): refused with one line."""
    if option is None:
        return {}
    name = str(option)
    head, _, stat = name.rpartition("_")
    if "," in name or head not in _RS_LEVEL or stat not in _RS_STAT or name == "seq_max_k1":
        raise ValueError(f"verl config: rollout_correction.rollout_rs={name!r} has no refppo counterpart "
                         "(one of token_k1|k2|k3, seq_sum_*, seq_mean_*, seq_max_k2|k3)")  # fmt: skip
    if threshold is None:
        raise ValueError(
            f"verl config: rollout_correction.rollout_rs_threshold: required with rollout_rs={name!r}"
        )
    level, reduce = _RS_LEVEL[head]
    try:
        parts = [float(v) for v in str(threshold).split("_")]
    except ValueError:
        raise ValueError(
            f"verl config: rollout_correction.rollout_rs_threshold={threshold!r}: expected a number or "
            "'LOW_HIGH'"
        ) from None
    if stat == "k1":
        lo, hi = (parts[0], parts[1]) if len(parts) == 2 else (1.0 / parts[0], parts[0])
    elif len(parts) == 1:
        lo, hi = None, parts[0]
    else:
        raise ValueError(
            f"verl config: rollout_correction.rollout_rs_threshold={threshold!r}: {name} takes one "
            "upper bound"
        )
    out: dict[str, Any] = {
        "rollout_rs": level,
        "rollout_rs_stat": _RS_STAT[stat],
        "rollout_rs_order": "behaviour",
    }
    if reduce is not None:
        out["rollout_rs_reduce"] = reduce
    return {**out, "rollout_rs_low": lo, "rollout_rs_high": hi, "rollout_rs_effect": "drop_mask"}


def _verl_is(level: Any, thr: Any) -> dict[str, Any]:
    if str(level) not in ("token", "sequence"):
        raise ValueError(f"verl config: rollout_correction.rollout_is={level!r}: expected token or sequence")
    if isinstance(thr, str) and "_" in thr:
        try:
            lo, hi = (float(v) for v in thr.split("_"))
        except ValueError:
            raise ValueError(
                f"verl config: rollout_correction.rollout_is_threshold={thr!r}: "
                "expected a number or 'LOW_HIGH'"
            ) from None
        return {
            "rollout_is": str(level),
            "rollout_is_mode": "mask",
            "rollout_is_low": lo,
            "rollout_is_high": hi,
        }
    return {"rollout_is": str(level), "rollout_is_mode": "truncate", "rollout_is_low": None,
            "rollout_is_high": float(thr)}  # fmt: skip


__all__ = [
    "VERL_BATCH",
    "VERL_KL",
    "VERL_METRICS",
    "from_verl",
    "verl_correction",
    "verl_hparams",
    "verl_rejection",
]
