"""What each stage cannot run without under a given setting: the :attr:`Stage.needs` functions of the
stage table (:mod:`refppo.pipeline.stages`).

A need is ``{name: the setting that reads it}``: ``name`` is an optional input of the step (one of the
stage's :attr:`~refppo.pipeline.stages.Stage.reads`: ``ref_logprobs``, ``rollout_logprobs``) or a
:class:`~refppo.pipeline.settings.Hyperparams` field (one of its ``hparams``); the value names the
convention setting (and β) under which the stage reads it, for the one-line error when it is absent::

    stage               needs                under
    kl                  ref_logprobs         kl_in=reward (or both) and kl_coef > 0 (the reward's −β·KL, and a
                                             group estimator's ``group_kl``, read the KL)
    rewards             kl_coef              kl_in=reward (or both)
    advantages          gamma, lam           advantage=gae;  gamma alone: advantage=reinforce++
                        bootstrap_values     advantage=gae, gae_bootstrap=truncated
    rollout_correction  rollout_logprobs     rollout_is on
    policy              cliprange            always
    value               cliprange_value      advantage=gae (a critic) with value_loss=clipped
    kl_loss             ref_logprobs         kl_in=loss (or both) and kl_coef > 0 (kl_loss_coef when set)
    total               kl_coef; vf_coef     kl_in=loss (or both); advantage=gae (a critic)

Without ``ref_logprobs`` where nothing needs it, the kl stage makes ``kl`` None (never a silent 0)
and the kl_loss stage ``kl_loss`` None (``kl_coef`` = 0 multiplies it in the total): what the
dump holds of them is then not compared (:func:`refppo.oracle.coverage.not_compared` says why). The
walkers over the table (:func:`refppo.pipeline.reads.required_inputs`, ``required_hparams``) and the
stage functions read these same functions.
"""

from __future__ import annotations

from collections.abc import Mapping

from refppo.conventions import AdvantageEstimator, GaeBootstrap, LossAgg, ValueLoss
from refppo.errors import ConventionError, DumpError
from refppo.pipeline.settings import Convention, Hyperparams

Needs = Mapping[str, str]
"""``{input or hyperparameter: the setting under which the stage reads it}``."""

KEY_SHAPES: dict[str, str] = {
    "ref_logprobs": "[B, T]",
    "rollout_logprobs": "[B, T]",
    "bootstrap_values": "[B]",
}
"""The shape each optional input has in a dump (for the error line)."""


def _beta(hp: Hyperparams) -> str:
    return f"kl_coef={hp.kl_coef:g}"


def kl_needs(conv: Convention, hp: Hyperparams) -> Needs:
    """``ref_logprobs`` when the KL enters the reward with β > 0: the rewards stage subtracts β·KL
    and a group estimator's ``group_kl`` reads it; nothing else reads the stage's ``kl``."""
    if conv.kl.placement.in_reward and hp.kl_coef > 0:
        return {"ref_logprobs": f"{_beta(hp)} (kl_in={conv.kl.placement.value})"}
    return {}


def kl_loss_needs(conv: Convention, hp: Hyperparams) -> Needs:
    """``ref_logprobs`` when a KL loss on the current log-probs enters the total with β > 0."""
    if conv.kl.placement.in_loss and hp.loss_beta > 0:
        beta = _beta(hp) if hp.kl_loss_coef is None else f"kl_loss_coef={hp.kl_loss_coef:g}"
        return {"ref_logprobs": f"{beta} (kl_in={conv.kl.placement.value})"}
    return {}


def rewards_needs(conv: Convention, hp: Hyperparams) -> Needs:
    """β when the KL is in the reward."""
    return {"kl_coef": f"kl_in={conv.kl.placement.value}"} if conv.kl.placement.in_reward else {}


def advantages_needs(conv: Convention, hp: Hyperparams) -> Needs:
    """γ and λ for GAE (and ``bootstrap_values`` under ``gae_bootstrap=truncated``), γ for
    REINFORCE++'s discounted returns; a group estimator reads neither."""
    est = conv.adv.estimator
    if est is AdvantageEstimator.GAE:
        out = {"gamma": "advantage=gae", "lam": "advantage=gae"}
        if conv.adv.gae_bootstrap is GaeBootstrap.TRUNCATED:
            out["bootstrap_values"] = "advantage=gae, gae_bootstrap=truncated"
        return out
    if est is AdvantageEstimator.REINFORCE_PP:
        return {"gamma": "advantage=reinforce++"}
    return {}


def policy_needs(conv: Convention, hp: Hyperparams) -> Needs:
    """ε, read by every policy loss."""
    return {"cliprange": f"policy_loss={conv.policy.loss.value}"}


def has_critic(conv: Convention) -> bool:
    """The convention trains a critic: ``advantage=gae`` (a critic-free estimator has no value loss
    unless the dump carries a critic's ``values`` and ``old_values``: :func:`critic_needs`)."""
    return conv.adv.estimator is AdvantageEstimator.GAE


def value_needs(conv: Convention, hp: Hyperparams) -> Needs:
    """ε_v with a critic and the clipped value loss."""
    if has_critic(conv) and conv.value.loss is ValueLoss.CLIPPED:
        return {"cliprange_value": "advantage=gae (a critic), value_loss=clipped"}
    return {}


def total_needs(conv: Convention, hp: Hyperparams) -> Needs:
    """β with a KL loss; c1 with a critic."""
    out = {"kl_coef": f"kl_in={conv.kl.placement.value}"} if conv.kl.placement.in_loss else {}
    if has_critic(conv):
        out["vf_coef"] = "advantage=gae (a critic)"
    return out


def critic_needs(conv: Convention) -> Needs:
    """What the value and total stages read when a dump of a critic-free estimator carries a critic's
    ``values`` and ``old_values`` (the value stage then computes a value loss from them)."""
    out: dict[str, str] = {}
    if conv.value.loss is ValueLoss.CLIPPED:
        out["cliprange_value"] = "a value loss (the dump holds values and old_values), value_loss=clipped"
    out["vf_coef"] = "a value loss (the dump holds values and old_values)"
    return out


def missing_line(key: str, stage: str, why: str, *, kind: str = "key") -> str:
    """The one line naming a needed input that is absent: the key, its shape, the stage, the setting.
    ``kind="hyperparameter"`` for a sidecar hyperparameter (``missing required hyperparameter
    'vf_coef': read by the total stage under advantage=gae (a critic)``)."""
    shape = KEY_SHAPES.get(key)
    what = f"{key!r}" + (f" {shape}" if shape else "")
    return f"missing required {kind} {what}: read by the {stage} stage under {why}"


def require_input(q: Mapping[str, object], key: str, stage: str, needs: Needs) -> None:
    """A :class:`DumpError` (:func:`missing_line`) when ``needs`` names ``key`` and ``q`` lacks it."""
    if key in needs and q.get(key) is None:
        raise DumpError(missing_line(key, stage, needs[key]))


def refuse_prompt_mean(conv: Convention, term: str, key: str) -> None:
    """``prompt-mean`` is the policy loss's (and entropy's) only (SkyRL 0.4.0 scales the policy's
    advantages; its KL and entropy terms are not prompt-scaled): refused for ``term`` naming ``key``."""
    if conv.agg.of(term) is LossAgg.PROMPT_MEAN:
        raise ConventionError(
            f"{key}=prompt-mean is not supported for the {term} term; set {key} to another mode"
        )


__all__ = [
    "KEY_SHAPES",
    "Needs",
    "advantages_needs",
    "critic_needs",
    "has_critic",
    "kl_loss_needs",
    "kl_needs",
    "missing_line",
    "policy_needs",
    "refuse_prompt_mean",
    "require_input",
    "rewards_needs",
    "total_needs",
    "value_needs",
]
