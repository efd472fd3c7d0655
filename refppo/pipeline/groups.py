"""The groups of :class:`refppo.pipeline.settings.Convention`: one frozen dataclass per stage family.

Each field's metadata (:func:`flat_key`) names its FLAT key (``--set KEY``, sidecars, presets, the
trainer's ``ppo.*``): :data:`refppo.pipeline.settings.FLAT` is derived from these classes. Enum
fields are parsed from their names by their type (:func:`_parse_enums`), each group runs the core's
checks of its own numbers at construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from refppo.conventions import (
    AdvantageEstimator,
    GaeBootstrap,
    GaeHoles,
    GaePadding,
    KLEstimator,
    KLPlacement,
    ScorePosition,
    ScoreSlotKL,
    ValueClipForm,
    ValueLoss,
    Variance,
    VfMask,
    WhitenEps,
    WhitenHoles,
    Whitening,
)
from refppo.core.checks import check_nonneg, check_positive
from refppo.core.kl import check_kl_clamps
from refppo.errors import ConventionError, HyperparameterError
from refppo.group_conventions import GroupKL, GroupSingleton, GroupStdLevel
from refppo.pipeline.group_fields import _parse_enums, flat_key
from refppo.pipeline.groups_gate import RolloutGate
from refppo.pipeline.groups_update import AggConvention, PolicyConvention
from refppo.rollout_conventions import ISAgg, ISLevel, ISMode


@dataclass(frozen=True)
class ScoreMap:
    """Step 0, what the trainer does to the reward model's score first: ``clip((s + bias)·scale, ±clip)``
    (:mod:`refppo.core.score_map`). The default is the identity (the scores bit for bit)."""

    bias: float = field(default=0.0, metadata=flat_key("score_bias", omit=True))
    """Score map, step 0 of the pipeline: the score entering the reward is
    ``clip((s + score_bias)·score_scale, ±score_clip)`` (:mod:`refppo.core.score_map`; ``s`` after
    ``rollout.missing_eos_penalty``). ``score_bias`` is added first (AReaL ``reward_bias``). The
    logged ``score`` is ``s``, before the map. Same key in ``refppo diff --set`` and the dump sidecar."""
    scale: float = field(default=1.0, metadata=flat_key("score_scale", omit=True))
    """Multiplies ``s + score_bias`` (AReaL ``reward_scaling``); 1 with ``score_bias`` 0 leaves the
    score bit for bit."""
    clip: float | None = field(default=None, metadata=flat_key("score_clip", omit=True))
    """Symmetric clamp of the mapped score to ``[−C, C]``, a finite number > 0 (OpenRLHF
    ``reward_clip_range`` 10, DeepSpeed-Chat ``clip_reward_value`` 5, AReaL ``reward_clip`` 20);
    none: no clip."""

    def __post_init__(self) -> None:
        if self.clip is not None and not (math.isfinite(self.clip) and self.clip > 0):
            raise HyperparameterError(f"score_clip: expected a finite number > 0 or none, got {self.clip!r}")
        for name, value in (("score_bias", self.bias), ("score_scale", self.scale)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise HyperparameterError(f"{name}: expected a finite number, got {value!r}")

    @property
    def identity(self) -> bool:
        """Bias 0, scale 1, no clip: the scores as given."""
        return self.bias == 0.0 and self.scale == 1.0 and self.clip is None


@dataclass(frozen=True)
class KLConvention:
    """The per-token KL (step 1) and where it enters (the reward, or the loss)."""

    estimator: KLEstimator = field(default=KLEstimator.K1, metadata=flat_key("kl_estimator"))
    """Per-token KL estimator (in the reward, or in the loss)."""
    log_ratio_clamp: tuple[float | None, float | None] | None = field(
        default=None, metadata=flat_key("kl_log_ratio_clamp")
    )
    """Clamp ``(lo, hi)`` of ``log π − log π_ref`` before the KL estimator."""
    value_clamp: float | None = field(default=None, metadata=flat_key("kl_value_clamp"))
    """Symmetric clamp of the KL estimate (OpenRLHF: 10; verl k3: 10)."""
    placement: KLPlacement = field(default=KLPlacement.REWARD, metadata=flat_key("kl_in"))
    """KL in the reward (old vs ref) or as a loss term (current vs ref)."""
    grad_is_clip: float | None = field(
        default=None, metadata=flat_key("kl_grad_is_clip", omit=True, config=False)
    )
    """With ``kl_in=loss``: the KL loss's gradient times ``min(exp(l − l^old), c)`` per token, detached;
    the value unchanged (OpenRLHF 0.11.2 ``algo.kl.unbiased_gradient``: ``c = 10``; :mod:`refppo.core.kl`)."""
    loss_estimator: KLEstimator | None = field(
        default=None, metadata=flat_key("kl_loss_estimator", omit=True, config=False)
    )
    """The KL loss's own estimator (``kl_in=both``: verl 0.9.1 ``actor.kl_loss_type`` beside
    ``algorithm.kl_penalty``); None = ``kl_estimator`` with its clamps (:meth:`loss_kl`)."""
    loss_log_ratio_clamp: tuple[float | None, float | None] | None = field(
        default=None, metadata=flat_key("kl_loss_log_ratio_clamp", omit=True, config=False)
    )
    """With ``kl_loss_estimator`` set: the KL loss's ``kl_log_ratio_clamp`` (None: no clamp)."""
    loss_value_clamp: float | None = field(
        default=None, metadata=flat_key("kl_loss_value_clamp", omit=True, config=False)
    )
    """With ``kl_loss_estimator`` set: the KL loss's ``kl_value_clamp`` (None: no clamp)."""

    def __post_init__(self) -> None:
        _parse_enums(self)
        for name in ("log_ratio_clamp", "loss_log_ratio_clamp"):
            clamp: Any = getattr(self, name)  # a list from JSON or TOML
            if isinstance(clamp, list):
                object.__setattr__(self, name, tuple(clamp))
        check_kl_clamps(self.log_ratio_clamp, self.value_clamp, prefix="kl_")
        check_kl_clamps(self.loss_log_ratio_clamp, self.loss_value_clamp, prefix="kl_loss_")
        if self.grad_is_clip is not None:
            check_positive("kl_grad_is_clip", self.grad_is_clip)
        own = (self.loss_log_ratio_clamp, self.loss_value_clamp)
        if self.loss_estimator is None and own != (None, None):
            raise ConventionError(
                "kl_loss_log_ratio_clamp/kl_loss_value_clamp: set without kl_loss_estimator "
                "(the KL loss reads kl_estimator's clamps then)"
            )

    def loss_kl(self) -> tuple[KLEstimator, tuple[float | None, float | None] | None, float | None]:
        """``(estimator, log_ratio_clamp, value_clamp)`` of the KL loss: ``kl_loss_estimator`` and its
        own clamps when set, else the shared ``kl_estimator`` and its clamps."""
        if self.loss_estimator is None:
            return self.estimator, self.log_ratio_clamp, self.value_clamp
        return self.loss_estimator, self.loss_log_ratio_clamp, self.loss_value_clamp


@dataclass(frozen=True)
class RewardConvention:
    """The token rewards (step 2): where the score sits and the optional reward whitening."""

    score_at: ScorePosition = field(default=ScorePosition.LAST_VALID, metadata=flat_key())
    """Which position receives the reward-model score."""
    whiten: Whitening = field(default=Whitening.NONE, metadata=flat_key("whiten_rewards", omit=True))
    """Normalisation of the token rewards over the value mask, after the KL and the score and before
    GAE (TRL ``whiten_rewards=True``: ``masked_no_shift``)."""
    slot_kl: ScoreSlotKL = field(
        default=ScoreSlotKL.NONE, metadata=flat_key("score_slot_kl", omit=True, config=False)
    )
    """The KL penalty at a score slot outside the mask too (``kl``: DeepSpeed-Chat) or not."""

    def __post_init__(self) -> None:
        _parse_enums(self)


@dataclass(frozen=True)
class NormConvention:
    """The moments of a whitening, shared by the reward and the advantage whitening."""

    variance: Variance = field(default=Variance.UNBIASED, metadata=flat_key("whiten_variance"))
    """Variance used by the whitening."""
    eps_at: WhitenEps = field(default=WhitenEps.VARIANCE, metadata=flat_key("whiten_eps_at", omit=True))
    """Where the whitening's eps enters: ``1/sqrt(σ²+eps)``, ``1/sqrt(max(σ², eps))`` (OpenRLHF) or
    ``1/(σ+eps)`` (AReaL); also used by ``whiten_rewards``."""

    def __post_init__(self) -> None:
        _parse_enums(self)


@dataclass(frozen=True)
class AdvantageConvention:
    """Step 3's estimator: GAE (with a critic) or a critic-free one, and their options."""

    estimator: AdvantageEstimator = field(
        default=AdvantageEstimator.GAE, metadata=flat_key("advantage", omit=True)
    )
    """Step 3's estimator: ``gae`` (with a critic) or a critic-free one (:mod:`refppo.core.group`):
    ``grpo``, ``dr-grpo``, ``rloo``, ``reinforce++-baseline``, ``opo`` (length-weighted group
    mean), ``gpg`` (``α(s − μ_G)``, ``α`` = B / #nonzero scores of the batch), ``grpo-passk`` (the
    unique best response's margin) — these need ``group_index`` —, ``reinforce++`` and
    ``flash-reinforce`` (``s − batch mean``, no group). Step 4 (the ``whiten_*`` keys) still
    applies: the peers' GRPO/RLOO leave it off (``whiten_advantages=none``), REINFORCE++ is its
    discounted returns whitened by step 4."""
    gae_padding: GaePadding = field(default=GaePadding.MASKED, metadata=flat_key(omit=True))
    """GAE stops at the value mask (``masked``) or runs through the padding (``through``: SkyRL)."""
    gae_holes: GaeHoles = field(default=GaeHoles.SKIP, metadata=flat_key(omit=True))
    """How GAE crosses interior mask holes (multi-turn tool tokens): ``skip`` (verl), ``zero``
    (OpenRLHF agent mode), ``through`` (SkyRL); no effect on a right-padded mask."""
    gae_bootstrap: GaeBootstrap = field(default=GaeBootstrap.NONE, metadata=flat_key(omit=True, config=False))
    """GAE's ``V_{t_L}``: 0 (``none``) or the dumped ``bootstrap_values`` on truncated rows
    (``truncated``: AReaL); :class:`refppo.conventions.GaeBootstrap`."""
    group_std: Variance = field(default=Variance.UNBIASED, metadata=flat_key(omit=True))
    """The group std of ``grpo`` and ``grpo-passk``: ``unbiased`` (n−1: ``torch.std``, verl, OpenRLHF,
    SkyRL) or ``population`` (n)."""
    group_std_level: GroupStdLevel = field(default=GroupStdLevel.GROUP, metadata=flat_key(omit=True))
    """Over which rows that std is taken: ``group`` (each row's group), ``batch`` (the whole batch
    around its mean: TRL ``scale_rewards="batch"``) or ``batch-centred`` (the batch's ``s − μ_G``:
    AReaL ``std_level: batch`` under ``mean_level: group``); :class:`refppo.conventions.GroupStdLevel`."""
    group_singleton: GroupSingleton = field(default=GroupSingleton.ERROR, metadata=flat_key(omit=True))
    """A prompt with one response in a group estimator: ``error``, ``score`` or ``zero``."""
    group_kl: GroupKL = field(default=GroupKL.FOLD, metadata=flat_key(omit=True))
    """The reward KL in a group estimator: folded into the score (verl, SkyRL) or added as its
    return-to-go after grouping (OpenRLHF)."""
    group_eps: float = field(default=1e-6, metadata=flat_key(omit=True))
    """ε of ``grpo``'s (and ``grpo-passk``'s) ``(s − μ)/(σ + ε)`` (verl, SkyRL 1e-6; OpenRLHF
    ``group_norm`` 1e-9). Read by these two only (the trainer refuses it off its default elsewhere)."""

    def __post_init__(self) -> None:
        _parse_enums(self)
        check_nonneg("group_eps", self.group_eps)


@dataclass(frozen=True)
class WhitenConvention:
    """Step 4: the advantage whitening (its moments: :class:`NormConvention`)."""

    advantages: Whitening = field(default=Whitening.MASKED, metadata=flat_key("whiten_advantages"))
    """Advantage whitening after GAE (returns always use the raw advantages)."""
    holes: WhitenHoles = field(default=WhitenHoles.EXCLUDE, metadata=flat_key("whiten_holes", omit=True))
    """The advantage whitening's moments over the valid tokens (``exclude``: verl, OpenRLHF) or over
    each row's envelope, holes included (``include``: SkyRL); no effect on a right-padded mask."""

    def __post_init__(self) -> None:
        _parse_enums(self)


@dataclass(frozen=True)
class ValueConvention:
    """The value loss (step 7). Read by ``advantage=gae`` only (the trainer refuses its keys off their
    defaults without a critic)."""

    loss: ValueLoss = field(default=ValueLoss.CLIPPED, metadata=flat_key("value_loss"))
    """Clipped or unclipped value loss.
    Read by ``advantage=gae`` only (the trainer refuses it off its default without a critic)."""
    clip_form: ValueClipForm = field(
        default=ValueClipForm.AROUND_OLD, metadata=flat_key("value_clip_form", omit=True)
    )
    """How the clipped value is computed: ``around_old`` ``clip(V, V_old ± ε_v)`` (verl, TRL,
    DeepSpeed-Chat) or ``delta`` ``V_old + clip(V − V_old, ±ε_v)`` (OpenRLHF, SkyRL, AReaL); equal in
    exact arithmetic, they can count a different ``vf_clipfrac`` in float32.
    Read by ``advantage=gae`` only (the trainer refuses it off its default without a critic)."""
    mask: VfMask = field(default=VfMask.VALUE, metadata=flat_key("vf_mask", omit=True, config=False))
    """Mask of the value loss and ``vf_clipfrac`` (:class:`refppo.conventions.VfMask`)."""

    def __post_init__(self) -> None:
        _parse_enums(self)


@dataclass(frozen=True)
class RolloutCorrection:
    """The rollout correction (spec/rollout-correction.md): the importance weight ``w'`` of the
    proximal policy (``old_logprobs``) over the behaviour policy (``rollout_logprobs``, the engine's),
    multiplied into the per-token policy surrogate, ``ℓ_t ← w'_t·ℓ^PPO_t``
    (:func:`refppo.core.rollout_correction.is_weights`, detached; rejected tokens count in the
    normalisers: ``Rejected.zero``). Off by default: no weight, and ``rollout_logprobs`` is not read."""

    level: ISLevel | None = field(default=None, metadata=flat_key("rollout_is", omit=True))
    """``token`` (TIS / MIS per token: verl ``rollout_is: token``, SkyRL ``use_tis``, TRL ``token_*``),
    ``sequence`` (one weight per row, by ``rollout_is_agg``), or none (off, the default)."""
    agg: ISAgg = field(default=ISAgg.PRODUCT, metadata=flat_key("rollout_is_agg", omit=True))
    """A sequence weight's log: the row's summed log-ratio (``product``: verl, TRL) or its mean
    (``geometric``: AReaL, OpenRLHF). Read at ``rollout_is=sequence`` only."""
    mode: ISMode = field(default=ISMode.TRUNCATE, metadata=flat_key("rollout_is_mode", omit=True))
    """``truncate`` (``clamp(w, C_low, C_high)``, TIS) or ``mask`` (``w·[C_low ≤ w ≤ C_high]``, MIS /
    IcePop: weight 0 outside the closed band)."""
    low: float | None = field(default=None, metadata=flat_key("rollout_is_low", omit=True))
    """``C_low``, a finite ratio bound ≥ 0, or none (no lower bound)."""
    high: float | None = field(default=None, metadata=flat_key("rollout_is_high", omit=True))
    """``C_high``, a finite ratio bound ≥ 0, or none (no upper bound; verl's threshold, SkyRL
    ``tis_imp_ratio_cap``, oat ``tis_c``)."""

    def __post_init__(self) -> None:
        _parse_enums(self)
        for name, value in (("rollout_is_low", self.low), ("rollout_is_high", self.high)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise HyperparameterError(f"{name}: expected a finite number >= 0 or none, got {value!r}")
            if value < 0:
                raise HyperparameterError(f"{name}: expected a ratio bound >= 0, got {value!r}")
        if self.low is not None and self.high is not None and self.low > self.high:
            raise HyperparameterError(
                f"rollout_is_low, rollout_is_high: expected low <= high, got {self.low!r} > {self.high!r}"
            )

    @property
    def on(self) -> bool:
        """A weight is applied (``rollout_is`` is ``token`` or ``sequence``)."""
        return self.level is not None


GROUPS: dict[str, type[Any]] = {
    "score": ScoreMap,
    "kl": KLConvention,
    "reward": RewardConvention,
    "norm": NormConvention,
    "adv": AdvantageConvention,
    "whiten": WhitenConvention,
    "policy": PolicyConvention,
    "agg": AggConvention,
    "value": ValueConvention,
    "rollout": RolloutCorrection,
    "gate": RolloutGate,
}
"""The groups of :class:`Convention`: attribute name → class (the order of its fields)."""


__all__ = [
    "GROUPS",
    "AdvantageConvention",
    "KLConvention",
    "NormConvention",
    "RewardConvention",
    "RolloutCorrection",
    "RolloutGate",
    "ScoreMap",
    "ValueConvention",
    "WhitenConvention",
    "flat_key",
]
