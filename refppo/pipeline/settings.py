"""The settings of one PPO step: :class:`Convention` (which formulas) and :class:`Hyperparams` (the numbers).

A :class:`Convention` is one frozen group per stage family of :mod:`refppo.pipeline.stages`
(:mod:`refppo.pipeline.groups`)::

    score    ScoreMap             score_bias, score_scale, score_clip          (score map)
    kl       KLConvention         kl_estimator, kl_log_ratio_clamp, kl_value_clamp, kl_in,
                                  kl_grad_is_clip, kl_loss_estimator, kl_loss_log_ratio_clamp,
                                  kl_loss_value_clamp
    reward   RewardConvention     score_at, whiten_rewards, score_slot_kl
    norm     NormConvention       whiten_variance, whiten_eps_at    (both whitenings read them)
    adv      AdvantageConvention  advantage, gae_padding, gae_holes, group_std, group_std_level,
                                  group_singleton, group_kl, group_eps, gae_bootstrap
    whiten   WhitenConvention     whiten_advantages, whiten_holes
    policy   PolicyConvention     policy_loss, dual_clip, log_ratio_clamp, approx_kl, clipfrac_counts
    agg      AggConvention        loss_agg, value_loss_agg, kl_loss_agg, entropy_agg, kl_metric_agg
    value    ValueConvention      value_loss, value_clip_form, vf_mask
    rollout  RolloutCorrection    rollout_is, rollout_is_agg, rollout_is_mode, rollout_is_low,
                                  rollout_is_high
    gate     RolloutGate          rollout_rs, rollout_rs_stat, rollout_rs_order, rollout_rs_reduce,
                                  rollout_rs_low, rollout_rs_high, rollout_rs_effect

The FLAT keys (``--set KEY``, sidecars, presets, the JSON report's ``convention`` object,
:meth:`Convention.to_dict`, the trainer's ``ppo.*`` keys) are derived from the groups: each field's
metadata names its flat key (:func:`refppo.pipeline.groups.flat_key`; the field name when it names
none), :data:`FLAT` maps every flat key to its group and field.
spec/conventions.md lists the keys and the peers that use each value.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any

from refppo.conventions import PolicyLoss, Whitening
from refppo.core.checks import check_nonneg, check_unit_interval
from refppo.errors import ConventionError, HyperparameterError
from refppo.group_conventions import GroupKL
from refppo.pipeline.groups import (
    GROUPS,
    AdvantageConvention,
    KLConvention,
    NormConvention,
    RewardConvention,
    RolloutCorrection,
    RolloutGate,
    ScoreMap,
    ValueConvention,
    WhitenConvention,
)
from refppo.pipeline.groups_update import AggConvention, PolicyConvention


@dataclass(frozen=True)
class Convention:
    """Every convention on which PPO trainers differ, one group per stage family (module docstring).
    Defaults are refppo's own choices. Build one from flat keys with :meth:`of` / :meth:`from_dict`;
    read one flat key with :meth:`get`; vary some with :meth:`with_updates`."""

    score: ScoreMap = field(default_factory=ScoreMap)
    """Step 0: the score map."""
    kl: KLConvention = field(default_factory=KLConvention)
    """Step 1: the per-token KL and its placement."""
    reward: RewardConvention = field(default_factory=RewardConvention)
    """Step 2: the token rewards."""
    norm: NormConvention = field(default_factory=NormConvention)
    """The whitening moments (steps 2b and 4)."""
    adv: AdvantageConvention = field(default_factory=AdvantageConvention)
    """Step 3: the advantage estimator."""
    whiten: WhitenConvention = field(default_factory=WhitenConvention)
    """Step 4: the advantage whitening."""
    policy: PolicyConvention = field(default_factory=PolicyConvention)
    """Steps 5–6: the clipped surrogate and the ``approx_kl`` metric."""
    agg: AggConvention = field(default_factory=AggConvention)
    """The aggregations of the loss terms."""
    value: ValueConvention = field(default_factory=ValueConvention)
    """Step 7: the value loss."""
    rollout: RolloutCorrection = field(default_factory=RolloutCorrection)
    """The rollout correction's weight on the policy surrogate (off by default)."""
    gate: RolloutGate = field(default_factory=RolloutGate)
    """The rollout correction's rejection gate, multiplied into that weight (off by default)."""

    def __post_init__(self) -> None:
        if self.adv.group_kl is GroupKL.TO_GO and self.reward.whiten is not Whitening.NONE:
            raise ConventionError(
                "group_kl=to_go with whiten_rewards: the return-to-go of −β·KL is read before any reward "
                "whitening; no peer combines them (use group_kl=fold)"
            )
        if (self.rollout.on or self.gate.on) and self.policy.loss is PolicyLoss.GSPO:
            raise ConventionError(
                "rollout_is or rollout_rs with policy_loss=gspo: GSPO's sequence ratio against the "
                "behaviour policy is not composed with a rollout-correction weight "
                "(spec/rollout-correction.md); "
                "set rollout_is=none and rollout_rs=none"
            )

    @classmethod
    def of(cls, **flat: Any) -> Convention:
        """A Convention from flat keys (``Convention.of(kl_estimator="k3", loss_agg="token-sum")``)."""
        return cls().with_updates(flat)

    def get(self, key: str) -> Any:
        """The value of flat key ``key``."""
        fk = FLAT[key]
        return getattr(getattr(self, fk.group), fk.name)

    def flat(self) -> dict[str, Any]:
        """Every flat key's typed value, in :data:`FLAT_ORDER`."""
        return {k: self.get(k) for k in FLAT_ORDER}

    def with_updates(self, data: dict[str, Any]) -> Convention:
        """A copy with some flat keys replaced (values may be strings, as typed on a command line)."""
        unknown = sorted(set(data) - set(FLAT))
        if unknown:
            raise ConventionError(f"unknown convention keys {unknown}; valid keys are {sorted(FLAT)}")
        by_group: dict[str, dict[str, Any]] = {}
        for key, value in data.items():
            fk = FLAT[key]
            by_group.setdefault(fk.group, {})[fk.name] = value
        return replace(self, **{g: replace(getattr(self, g), **upd) for g, upd in by_group.items()})

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly flat dict (enum values as their names, tuples as lists), in :data:`FLAT_ORDER`.

        The keys marked ``omit`` (:func:`flat_key`: ``value_loss_agg``, ``whiten_rewards``,
        ``gae_padding``, ``advantage``, the ``group_*`` keys, the score map, ...) are left out while
        they hold their defaults, so that the dict of a convention that does not use them is the one
        written before they existed (the golden cases in ``spec/golden`` store it); :meth:`from_dict`
        restores the defaults.
        """
        out: dict[str, Any] = {}
        for key in FLAT_ORDER:
            fk, value = FLAT[key], self.get(key)
            if not (fk.omit and value == fk.default):
                out[key] = json_value(value)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Convention:
        """Build from flat keys; an unknown key raises a ConventionError listing the valid ones."""
        return cls().with_updates(data)

    @classmethod
    def config_hints(cls) -> dict[str, Any]:
        """``{flat key: type}`` of the keys of the trainer's ``[ppo]`` section (:data:`CONFIG_KEYS`,
        in order): what a config codec flattens this class into."""
        return {k: FLAT[k].hint for k in CONFIG_KEYS}


def json_value(value: Any) -> Any:
    """A flat key's value as JSON has it: an enum by its name, a tuple as a list."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    return value


@dataclass(frozen=True)
class FlatKey:
    """One flat convention key: where it lives in :class:`Convention` and what it holds."""

    key: str
    group: str
    """The :class:`Convention` attribute of its group (``kl``, ``policy``, ...)."""
    name: str
    """The field of the group."""
    hint: Any
    """Its type (an enum class, ``float | None``, ...)."""
    default: Any
    omit: bool
    """Left out of :meth:`Convention.to_dict` at its default."""
    config: bool
    """A key of the trainer's ``[ppo]`` section."""


FLAT_ORDER: tuple[str, ...] = (
    "kl_estimator",
    "kl_in",
    "score_at",
    "whiten_advantages",
    "whiten_variance",
    "loss_agg",
    "value_loss",
    "dual_clip",
    "log_ratio_clamp",
    "kl_log_ratio_clamp",
    "kl_value_clamp",
    "value_loss_agg",
    "whiten_eps_at",
    "whiten_rewards",
    "gae_padding",
    "kl_loss_agg",
    "entropy_agg",
    "value_clip_form",
    "policy_loss",
    "gae_holes",
    "whiten_holes",
    "advantage",
    "group_std",
    "group_std_level",
    "group_singleton",
    "group_kl",
    "group_eps",
    "score_bias",
    "score_scale",
    "score_clip",
    "approx_kl",
    "vf_mask",
    "rollout_is",
    "rollout_is_agg",
    "rollout_is_mode",
    "rollout_is_low",
    "rollout_is_high",
    "kl_metric_agg",
    "kl_grad_is_clip",
    "rollout_rs",
    "rollout_rs_stat",
    "rollout_rs_order",
    "rollout_rs_reduce",
    "rollout_rs_low",
    "rollout_rs_high",
    "rollout_rs_effect",
    "gae_bootstrap",
    "score_slot_kl",
    "truncated_rows",
    "clipfrac_agg",
    "kl_loss_estimator",
    "kl_loss_log_ratio_clamp",
    "kl_loss_value_clamp",
    "clipfrac_counts",
)
"""The flat keys in the order every listing writes them (:meth:`Convention.to_dict`, the JSON
report, ``refppo train --help-config``): the order they were added in, kept so that those outputs
stay byte for byte. The set is :data:`FLAT`'s (checked at import)."""


def _flat_keys() -> dict[str, FlatKey]:
    found: dict[str, FlatKey] = {}
    for group, cls in GROUPS.items():
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            key = f.metadata.get("key") or f.name
            if key in found:
                raise RuntimeError(f"Convention: flat key {key!r} in two groups")
            meta = f.metadata
            found[key] = FlatKey(key, group, f.name, hints[f.name], f.default, meta["omit"], meta["config"])
    if set(found) != set(FLAT_ORDER) or len(FLAT_ORDER) != len(found):
        raise RuntimeError(f"FLAT_ORDER {sorted(FLAT_ORDER)} is not the groups' keys {sorted(found)}")
    return {k: found[k] for k in FLAT_ORDER}


FLAT: dict[str, FlatKey] = _flat_keys()
"""Every flat convention key (:data:`FLAT_ORDER`), derived from the groups' field metadata."""


def enum_keys() -> dict[str, type[Enum]]:
    """``{flat key: its enum}`` of every key whose value is an enum member (or None)."""
    out: dict[str, type[Enum]] = {}
    for key, fk in FLAT.items():
        for tp in typing.get_args(fk.hint) or (fk.hint,):
            if isinstance(tp, type) and issubclass(tp, Enum):
                out[key] = tp
    return out


CONVENTION_KEYS: tuple[str, ...] = FLAT_ORDER
"""Every flat convention key."""
CONFIG_KEYS: tuple[str, ...] = tuple(k for k in FLAT_ORDER if FLAT[k].config)
"""The flat keys of the trainer's ``[ppo]`` section (``approx_kl``, ``vf_mask`` and ``kl_metric_agg``
describe how an observed trainer logs and masks: refppo's trainer runs their defaults)."""


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
    """ε, the policy clip range (``clip_ratio``, ``eps_clip``); 1: no lower bound (``1 − ε = 0 < ρ``;
    TRL 1.16.0 ``loss_type="cispo"``)."""
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
    kl_loss_coef: float | None = None
    """β_loss, the KL loss's own (``kl_in=both``: verl ``actor.kl_loss_coef`` beside ``kl_ctrl.kl_coef``);
    None = ``kl_coef`` (:attr:`loss_beta`; left out of :meth:`to_dict`)."""

    def __post_init__(self) -> None:
        check_unit_interval("gamma", self.gamma)
        check_unit_interval("lam", self.lam)
        for name in ("kl_coef", "cliprange", "cliprange_value", "vf_coef", "ent_coef", "whiten_eps"):
            check_nonneg(name, getattr(self, name))
        for name in ("cliprange_high", "kl_loss_coef"):
            if getattr(self, name) is not None:
                check_nonneg(name, getattr(self, name))
        if self.cliprange > 1.0:  # as clipped_policy_loss's clip_low, at construction (1: no lower bound)
            raise HyperparameterError(f"cliprange: expected a number in [0, 1], got {self.cliprange!r}")

    @property
    def clip_high(self) -> float:
        """ε_high in use: ``cliprange_high``, or ``cliprange`` when it is None (symmetric clip)."""
        return self.cliprange if self.cliprange_high is None else self.cliprange_high

    @property
    def loss_beta(self) -> float:
        """β of the KL loss: ``kl_loss_coef``, else ``kl_coef``."""
        return self.kl_coef if self.kl_loss_coef is None else self.kl_loss_coef

    @classmethod
    def config_hints(cls) -> dict[str, Any]:
        """The trainer's ``[ppo]`` keys of these fields (:mod:`refppo.train.config.codec`): all but
        ``kl_loss_coef`` (the trainer runs one β, its controller's; the key describes a checked step)."""
        hints = typing.get_type_hints(cls)
        return {f.name: hints[f.name] for f in fields(cls) if f.name != "kl_loss_coef"}

    def get(self, key: str) -> Any:  # the trainer's config reads flattened keys so
        return getattr(self, key)

    def with_updates(self, values: dict[str, Any]) -> Hyperparams:
        """A copy with some fields replaced (the trainer's config builds it so)."""
        return replace(self, **values)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict, ``kl_loss_coef`` left out when None (the dumps and reports written
        before it existed stay byte for byte)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.kl_loss_coef is None:
            del out["kl_loss_coef"]
        return out


HPARAM_KEYS: tuple[str, ...] = tuple(f.name for f in fields(Hyperparams))
"""The fields of :class:`Hyperparams`."""

__all__ = [
    "CONFIG_KEYS",
    "CONVENTION_KEYS",
    "FLAT",
    "FLAT_ORDER",
    "HPARAM_KEYS",
    "Convention",
    "FlatKey",
    "Hyperparams",
    "enum_keys",
    "json_value",
]
