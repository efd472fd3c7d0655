"""The settings of one PPO step: :class:`Convention` (which formulas) and :class:`Hyperparams` (the numbers).

Shared by the pipeline (:mod:`refppo.pipeline`, which re-exports both), the trainer's config, the
oracle's settings and the presets. Each convention key is a typed enum of :mod:`refppo.conventions`
(or a number / clamp pair); spec/dump-format.md lists the keys and the peers that use each value.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from refppo.conventions import (
    AdvantageEstimator,
    GaeHoles,
    GaePadding,
    GroupKL,
    GroupSingleton,
    GroupStdLevel,
    KLEstimator,
    KLPlacement,
    LossAgg,
    PolicyLoss,
    ScorePosition,
    ValueClipForm,
    ValueLoss,
    Variance,
    WhitenEps,
    WhitenHoles,
    Whitening,
    parse,
)
from refppo.core.checks import check_nonneg, check_positive, check_unit_interval
from refppo.core.kl import check_kl_clamps
from refppo.core.score_map import check_score_map
from refppo.errors import ConventionError, HyperparameterError

_ENUM_FIELDS: dict[str, type[Any]] = {
    "kl_estimator": KLEstimator,
    "kl_in": KLPlacement,
    "score_at": ScorePosition,
    "whiten_advantages": Whitening,
    "whiten_variance": Variance,
    "loss_agg": LossAgg,
    "value_loss": ValueLoss,
    "whiten_eps_at": WhitenEps,
    "whiten_rewards": Whitening,
    "gae_padding": GaePadding,
    "value_clip_form": ValueClipForm,
    "policy_loss": PolicyLoss,
    "advantage": AdvantageEstimator,
    "group_std": Variance,
    "group_std_level": GroupStdLevel,
    "group_singleton": GroupSingleton,
    "group_kl": GroupKL,
    "gae_holes": GaeHoles,
    "whiten_holes": WhitenHoles,
}
_OPTIONAL_ENUM_FIELDS: dict[str, type[Any]] = {
    "value_loss_agg": LossAgg,
    "kl_loss_agg": LossAgg,
    "entropy_agg": LossAgg,
}
"""Enum fields that may also be None (parsed like ``_ENUM_FIELDS``; None stays None)."""
_OMITTED_AT_DEFAULT: dict[str, Any] = {
    "value_loss_agg": None,
    "value_clip_form": ValueClipForm.AROUND_OLD,
    "whiten_eps_at": WhitenEps.VARIANCE,
    "whiten_rewards": Whitening.NONE,
    "gae_padding": GaePadding.MASKED,
    "kl_loss_agg": None,
    "entropy_agg": None,
    "policy_loss": PolicyLoss.VANILLA,
    "advantage": AdvantageEstimator.GAE,
    "group_std": Variance.UNBIASED,
    "group_std_level": GroupStdLevel.GROUP,
    "group_singleton": GroupSingleton.ERROR,
    "group_kl": GroupKL.FOLD,
    "group_eps": 1e-6,
    "gae_holes": GaeHoles.SKIP,
    "whiten_holes": WhitenHoles.EXCLUDE,
}
"""Fields added after the golden cases in ``spec/golden`` were written: :meth:`Convention.to_dict`
leaves them out while they hold these defaults, so those stored dicts stay exact."""


@dataclass(frozen=True)
class Convention:
    """Every convention on which PPO trainers differ. Defaults are refppo's own choices."""

    kl_estimator: KLEstimator = KLEstimator.K1
    """Per-token KL estimator (in the reward, or in the loss)."""
    kl_in: KLPlacement = KLPlacement.REWARD
    """KL in the reward (old vs ref) or as a loss term (current vs ref)."""
    score_at: ScorePosition = ScorePosition.LAST_VALID
    """Which position receives the reward-model score."""
    whiten_advantages: Whitening = Whitening.MASKED
    """Advantage whitening after GAE (returns always use the raw advantages)."""
    whiten_variance: Variance = Variance.UNBIASED
    """Variance used by the whitening."""
    loss_agg: LossAgg = LossAgg.TOKEN_MEAN
    """Aggregation of the per-token policy, entropy and KL losses (and of the value loss unless
    ``value_loss_agg`` is set)."""
    value_loss: ValueLoss = ValueLoss.CLIPPED
    """Clipped or unclipped value loss.
    Read by ``advantage=gae`` only (the trainer refuses it off its default without a critic)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 for negative advantages, or None (off)."""
    log_ratio_clamp: float | None = None
    """Clamp of ``logprobs − old_logprobs`` before exp in the ratio (verl, OpenRLHF: 20)."""
    kl_log_ratio_clamp: tuple[float | None, float | None] | None = None
    """Clamp ``(lo, hi)`` of ``log π − log π_ref`` before the KL estimator."""
    kl_value_clamp: float | None = None
    """Symmetric clamp of the KL estimate (OpenRLHF: 10; verl k3: 10)."""
    value_loss_agg: LossAgg | None = None
    """Aggregation of the value loss; None = same as ``loss_agg``. OpenRLHF's critic keeps the value
    loss ``token-mean`` whatever the actor's aggregation (its critic builds ``ValueLoss(value_clip)``).
    Read by ``advantage=gae`` only (the trainer refuses it off its default without a critic)."""
    whiten_eps_at: WhitenEps = WhitenEps.VARIANCE
    """Where the whitening's eps enters: ``1/sqrt(σ²+eps)``, ``1/sqrt(max(σ², eps))`` (OpenRLHF) or
    ``1/(σ+eps)`` (AReaL); also used by ``whiten_rewards``."""
    whiten_rewards: Whitening = Whitening.NONE
    """Normalisation of the token rewards over the value mask, after the KL and the score and before
    GAE (TRL ``whiten_rewards=True``: ``masked_no_shift``)."""
    gae_padding: GaePadding = GaePadding.MASKED
    """GAE stops at the value mask (``masked``) or runs through the padding (``through``: SkyRL)."""
    kl_loss_agg: LossAgg | None = None
    """Aggregation of the KL loss (``kl_in=loss``); None = ``loss_agg``. SkyRL-train averages per row
    (``seq-mean-token-mean``) whatever its policy-loss reduction."""
    entropy_agg: LossAgg | None = None
    """Aggregation of the entropy term; None = ``loss_agg``. SkyRL-train: ``token-mean`` always."""

    value_clip_form: ValueClipForm = ValueClipForm.AROUND_OLD
    """How the clipped value is computed: ``around_old`` ``clip(V, V_old ± ε_v)`` (verl, TRL,
    DeepSpeed-Chat) or ``delta`` ``V_old + clip(V − V_old, ±ε_v)`` (OpenRLHF, SkyRL, AReaL); equal in
    exact arithmetic, they can count a different ``vf_clipfrac`` in float32.
    Read by ``advantage=gae`` only (the trainer refuses it off its default without a critic)."""
    policy_loss: PolicyLoss = PolicyLoss.VANILLA
    """The importance ratio of the clipped surrogate: ``vanilla`` (per token) or ``gspo`` (GSPO's
    length-normalised sequence ratio, :mod:`refppo.core.gspo`; needs ``dual_clip`` None, and takes
    ``log_ratio_clamp`` as the upper clamp of the log sequence ratio, verl: 10)."""
    gae_holes: GaeHoles = GaeHoles.SKIP
    """How GAE crosses interior mask holes (multi-turn tool tokens): ``skip`` (verl), ``zero``
    (OpenRLHF agent mode), ``through`` (SkyRL); no effect on a right-padded mask."""
    whiten_holes: WhitenHoles = WhitenHoles.EXCLUDE
    """The advantage whitening's moments over the valid tokens (``exclude``: verl, OpenRLHF) or over
    each row's envelope, holes included (``include``: SkyRL); no effect on a right-padded mask."""

    advantage: AdvantageEstimator = AdvantageEstimator.GAE
    """Step 3's estimator: ``gae`` (with a critic) or a critic-free one (:mod:`refppo.core.group`):
    ``grpo``, ``dr-grpo``, ``rloo``, ``reinforce++-baseline``, ``opo`` (length-weighted group
    mean), ``gpg`` (``α(s − μ_G)``, ``α`` = B / #nonzero scores of the batch), ``grpo-passk`` (the
    unique best response's margin) — these need ``group_index`` —, ``reinforce++`` and
    ``flash-reinforce`` (``s − batch mean``, no group). Step 4 (the ``whiten_*`` keys) still
    applies: the peers' GRPO/RLOO leave it off (``whiten_advantages=none``), REINFORCE++ is its
    discounted returns whitened by step 4."""
    group_std: Variance = Variance.UNBIASED
    """The group std of ``grpo`` and ``grpo-passk``: ``unbiased`` (n−1: ``torch.std``, verl, OpenRLHF,
    SkyRL) or ``population`` (n)."""
    group_std_level: GroupStdLevel = GroupStdLevel.GROUP
    """Over which rows that std is taken: ``group`` (each row's group), ``batch`` (the whole batch
    around its mean: TRL ``scale_rewards="batch"``) or ``batch-centred`` (the batch's ``s − μ_G``:
    AReaL ``std_level: batch`` under ``mean_level: group``); :class:`refppo.conventions.GroupStdLevel`."""
    group_singleton: GroupSingleton = GroupSingleton.ERROR
    """A prompt with one response in a group estimator: ``error``, ``score`` or ``zero``."""
    group_kl: GroupKL = GroupKL.FOLD
    """The reward KL in a group estimator: folded into the score (verl, SkyRL) or added as its
    return-to-go after grouping (OpenRLHF)."""
    group_eps: float = 1e-6
    """ε of ``grpo``'s (and ``grpo-passk``'s) ``(s − μ)/(σ + ε)`` (verl, SkyRL 1e-6; OpenRLHF
    ``group_norm`` 1e-9). Read by these two only (the trainer refuses it off its default elsewhere)."""

    def __post_init__(self) -> None:
        for name, cls in _ENUM_FIELDS.items():
            object.__setattr__(self, name, parse(cls, getattr(self, name), what=name))
        for name, cls in _OPTIONAL_ENUM_FIELDS.items():
            if getattr(self, name) is not None:
                object.__setattr__(self, name, parse(cls, getattr(self, name), what=name))
        # The core's own checks, at construction (a config error before any model is loaded):
        # dual-clip c finite and > 1 (policy.clipped_policy_loss), the clamps (kl, policy_ratio).
        if self.dual_clip is not None and not (math.isfinite(self.dual_clip) and self.dual_clip > 1.0):
            raise HyperparameterError(f"dual_clip: expected c > 1 or None, got {self.dual_clip!r}")
        if self.log_ratio_clamp is not None:
            check_positive("log_ratio_clamp", self.log_ratio_clamp)
        if self.policy_loss is PolicyLoss.GSPO and self.dual_clip is not None:
            raise ConventionError(
                f"dual_clip: policy_loss=gspo has no dual-clip (verl compute_policy_loss_gspo), "
                f"got dual_clip={self.dual_clip!r}; set dual_clip=none"
            )
        check_kl_clamps(self.kl_log_ratio_clamp, self.kl_value_clamp, prefix="kl_")
        check_nonneg("group_eps", self.group_eps)
        if self.group_kl is GroupKL.TO_GO and self.whiten_rewards is not Whitening.NONE:
            raise ConventionError(
                "group_kl=to_go with whiten_rewards: the return-to-go of −β·KL is read before any reward "
                "whitening; no peer combines them (use group_kl=fold)"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (enum values as their names).

        The fields of :data:`_OMITTED_AT_DEFAULT` (``value_loss_agg``, ``value_clip_form``,
        ``whiten_eps_at``, ``whiten_rewards``, ``gae_padding``, ``kl_loss_agg``, ``entropy_agg``,
        ``policy_loss``, ``gae_holes``, ``whiten_holes``, ``group_std_level``, ...) are
        left out while they hold their defaults, so that the dict of a convention that does not use
        them is the one written before they existed (the golden cases in ``spec/golden`` store it);
        :meth:`from_dict` restores the defaults.
        """
        out = asdict(self)
        for name in _ENUM_FIELDS:
            out[name] = getattr(self, name).value
        for name in _OPTIONAL_ENUM_FIELDS:
            value = getattr(self, name)
            out[name] = None if value is None else value.value
        for name, default in _OMITTED_AT_DEFAULT.items():
            if getattr(self, name) == default:
                del out[name]
        if self.kl_log_ratio_clamp is not None:
            out["kl_log_ratio_clamp"] = list(self.kl_log_ratio_clamp)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Convention:
        """Build from convention keys; an unknown key raises a ConventionError listing the valid ones."""
        return cls().with_updates(data)

    def with_updates(self, data: dict[str, Any]) -> Convention:
        """A copy with some fields replaced (values may be strings, as typed on a command line)."""
        valid = {f.name for f in fields(self)}
        unknown = sorted(set(data) - valid)
        if unknown:
            raise ConventionError(f"unknown convention keys {unknown}; valid keys are {sorted(valid)}")
        clean = dict(data)
        if "kl_log_ratio_clamp" in clean and clean["kl_log_ratio_clamp"] is not None:
            lo, hi = clean["kl_log_ratio_clamp"]
            clean["kl_log_ratio_clamp"] = (lo, hi)
        return replace(self, **clean)


@dataclass(frozen=True)
class Hyperparams:
    """Numeric PPO hyperparameters (paper symbols; the peers' names in comments)."""

    gamma: float = 1.0
    """Discount γ."""
    lam: float = 0.95
    """GAE λ (``lam``, ``lambd``).
    Read by ``advantage=gae`` only (the trainer refuses it off its default without a critic)."""
    kl_coef: float = 0.05
    """β, the KL coefficient (``kl_coef``, ``init_kl_coef``, ``kl_ctl``)."""
    cliprange: float = 0.2
    """ε, the policy clip range (``clip_ratio``, ``eps_clip``)."""
    cliprange_high: float | None = None
    """ε_high when asymmetric (``clip_ratio_high``); None = ``cliprange``."""
    cliprange_value: float = 0.2
    """ε_v, the value clip range (``value_clip``).
    Read by ``advantage=gae`` only (the trainer refuses it off its default without a critic)."""
    vf_coef: float = 0.1
    """c1, the value-loss coefficient.
    Read by ``advantage=gae`` only (the trainer refuses it off its default without a critic)."""
    ent_coef: float = 0.0
    """c2, the entropy-bonus coefficient (``entropy_coeff``)."""
    whiten_eps: float = 1e-8
    """ε added to the variance when whitening."""
    horizon: float | None = None
    """Constant H of ``seq-mean-token-sum-norm`` (None: the padded length T)."""

    def __post_init__(self) -> None:
        check_unit_interval("gamma", self.gamma)
        check_unit_interval("lam", self.lam)
        for name in ("kl_coef", "cliprange", "cliprange_value", "vf_coef", "ent_coef", "whiten_eps"):
            check_nonneg(name, getattr(self, name))
        if self.cliprange_high is not None:
            check_nonneg("cliprange_high", self.cliprange_high)
        if self.cliprange >= 1.0:  # as clipped_policy_loss's clip_low, at construction
            raise HyperparameterError(f"cliprange: expected a number in [0, 1), got {self.cliprange!r}")


@dataclass(frozen=True)
class ScoreMap:
    """What the trainer does to the reward model's score first: ``clip((s + bias)·scale, ±clip)``
    (:mod:`refppo.core.score_map`; the pipeline's step 0). The default is the identity.

    The oracle's flat keys ``score_bias``, ``score_scale``, ``score_clip``
    (:class:`refppo.oracle.check.settings.Extras`) are these three numbers.
    """

    bias: float = 0.0
    """Added to the score first (AReaL ``reward_bias``)."""
    scale: float = 1.0
    """Multiplies ``s + bias`` (AReaL ``reward_scaling``)."""
    clip: float | None = None
    """Symmetric clamp after the affine map, or None (AReaL ``reward_clip`` 20, OpenRLHF 10,
    DeepSpeed-Chat 5)."""

    def __post_init__(self) -> None:
        check_score_map(self.bias, self.scale, self.clip)


SIGMA_ESTIMATORS = (AdvantageEstimator.GRPO, AdvantageEstimator.GRPO_PASSK)
"""The estimators with a σ (:func:`refppo.core.group.group_scalar_advantages`): only they read
``group_std``, ``group_std_level`` and ``group_eps``."""


def unread_std_level(conv: Convention, prefix: str = "") -> str | None:
    """One line when ``group_std_level`` is off ``group`` but ``advantage`` has no σ, else None."""
    adv = conv.advantage
    if conv.group_std_level is GroupStdLevel.GROUP or adv in SIGMA_ESTIMATORS:
        return None
    return (
        f"{prefix}group_std_level={conv.group_std_level.value} is set but {prefix}advantage={adv.value} "
        f"takes no group std (only {', '.join(e.value for e in SIGMA_ESTIMATORS)} read it)"
    )


def unread_convention(conv: Convention, prefix: str = "") -> str | None:
    """One line naming a convention setting its estimator ignores or cannot run, else None.

    - ``group_std_level`` off ``group`` where ``advantage`` has no σ (only :data:`SIGMA_ESTIMATORS`);
    - ``group_singleton=score`` with ``grpo-passk``, which has no second-best score in a group of one
      (the core refuses it only when a singleton turns up, mid-rollout).

    Not a check of :class:`Convention` itself: the oracle's ``--detect`` walk
    (:mod:`refppo.oracle.detect.estimator`) builds such Conventions on purpose and discards them.
    The user-facing entry points call it: :func:`refppo.oracle.check.settings.build_setup` (``refppo diff``'s
    ``--preset``/``--set``/sidecar) and the trainer's config. ``prefix``: ``"ppo."`` for the
    trainer's keys."""
    adv = conv.advantage
    level = unread_std_level(conv, prefix)
    if level is not None:
        return level
    if adv is AdvantageEstimator.GRPO_PASSK and conv.group_singleton is GroupSingleton.SCORE:
        return (
            f"{prefix}group_singleton=score is set but {prefix}advantage=grpo-passk has no second-best "
            f"score in a group of one (use {prefix}group_singleton=error or zero)"
        )
    return None


__all__ = ["SIGMA_ESTIMATORS", "Convention", "Hyperparams", "ScoreMap", "unread_convention"]
