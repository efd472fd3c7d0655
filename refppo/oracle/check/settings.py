"""What one oracle comparison runs under: a pipeline ``Convention``, ``Hyperparams`` and oracle extras.

The flat key space (``--set KEY=VALUE``, the sidecar JSON, the ``convention`` object of the JSON
report) is the union of

- the fields of :class:`refppo.pipeline.settings.Convention` (``kl_estimator``, ``kl_in``, ``score_at``,
  ``whiten_advantages``, ``whiten_variance``, ``loss_agg``, ``value_loss``, ``dual_clip``,
  ``log_ratio_clamp``, ``kl_log_ratio_clamp``, ``kl_value_clamp``, ``value_loss_agg``,
  ``value_clip_form``, ``whiten_eps_at``, ``whiten_rewards``, ``gae_padding``, ``kl_loss_agg``,
  ``entropy_agg``, ``gae_holes``, ``whiten_holes``, and the critic-free estimator's ``advantage``,
  ``group_std``, ``group_std_level``, ``group_singleton``, ``group_kl``, ``group_eps``);
- oracle-only keys for conventions that sit *around* the pipeline rather than in it
  (:class:`Extras`): ``score_clip``, ``score_bias``, ``score_scale``, ``approx_kl`` and ``vf_mask``;
- the fields of :class:`refppo.pipeline.settings.Hyperparams` (``gamma``, ``lam``, ``kl_coef``, ...).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from refppo.errors import ConventionError, HyperparameterError
from refppo.pipeline.settings import Convention, Hyperparams, unread_convention

APPROX_KL_METRICS = ("k1", "k2_all_positions", "neg_k1")
"""``k1``: masked mean of ``old_logprobs − logprobs`` (verl ``ppo_kl``, OpenRLHF ``ppo_kl``, refppo).
``k2_all_positions``: ``½·Σ_valid d² / (B·T)`` — TRL's ``approxkl``, an unmasked mean over every
position, where TRL's INVALID_LOGPROB sentinel (1.0 on both sides) makes padding contribute 0.
``neg_k1``: masked mean of ``logprobs − old_logprobs`` (AReaL 1.0.4 ``ppo_actor_loss_fn`` logs
``approx_kl = logprobs − proximal_logprobs``, the opposite sign of verl's ``ppo_kl``)."""

VF_MASKS = ("value", "response")
"""Mask of the value loss: ``value`` = response mask plus the score slot (refppo pipeline, TRL
``padding_mask_p1``); ``response`` = the response mask only (DeepSpeed-Chat ``critic_loss_fn`` uses
``action_mask`` even though its GAE credits the slot one past the last token)."""


@dataclass(frozen=True)
class Extras:
    """Oracle-only conventions (not fields of the pipeline's ``Convention``)."""

    score_clip: float | None = None
    """Symmetric clamp of the scores before they enter the reward (OpenRLHF 10, DeepSpeed-Chat 5)."""
    score_bias: float = 0.0
    """Added to the scores before ``score_scale`` and ``score_clip`` (AReaL ``reward_bias``)."""
    score_scale: float = 1.0
    """Multiplies ``score + score_bias`` before ``score_clip`` (AReaL ``reward_scaling``):
    the reward's score is ``clip((s + score_bias)·score_scale, ±score_clip)``."""
    approx_kl: str = "k1"
    """Which ``approx_kl`` metric the trainer logs (see :data:`APPROX_KL_METRICS`)."""
    vf_mask: str = "value"
    """Mask of the value loss and ``vf_clipfrac`` (see :data:`VF_MASKS`)."""

    def __post_init__(self) -> None:
        if self.score_clip is not None and not (math.isfinite(self.score_clip) and self.score_clip > 0):
            raise HyperparameterError(f"score_clip: expected a number > 0 or null, got {self.score_clip!r}")
        for name in ("score_bias", "score_scale"):
            if not math.isfinite(getattr(self, name)):
                raise HyperparameterError(f"{name}: expected a finite number, got {getattr(self, name)!r}")
        if self.approx_kl not in APPROX_KL_METRICS:
            raise ConventionError(
                f"approx_kl: unknown name {self.approx_kl!r}; valid names are {list(APPROX_KL_METRICS)}"
            )
        if self.vf_mask not in VF_MASKS:
            raise ConventionError(f"vf_mask: unknown name {self.vf_mask!r}; valid names are {list(VF_MASKS)}")


CONVENTION_KEYS: tuple[str, ...] = tuple(f.name for f in fields(Convention))
EXTRA_KEYS: tuple[str, ...] = tuple(f.name for f in fields(Extras))
HPARAM_KEYS: tuple[str, ...] = tuple(f.name for f in fields(Hyperparams))
REQUIRED_HPARAMS: tuple[str, ...] = ("gamma", "lam", "kl_coef", "cliprange", "cliprange_value", "vf_coef")
ALL_KEYS: tuple[str, ...] = CONVENTION_KEYS + EXTRA_KEYS + HPARAM_KEYS

_FLOAT_OR_NONE = {"dual_clip", "log_ratio_clamp", "kl_value_clamp", "score_clip"}
_FLOAT_EXTRAS = {"score_bias", "score_scale", "group_eps"}
"""Keys holding a plain float (the extras' score map, the convention ``group_eps``)."""
_FLOAT_OR_NONE_HP = {"cliprange_high", "horizon"}
_NAME_OR_NONE = {"value_loss_agg", "kl_loss_agg", "entropy_agg"}


@dataclass(frozen=True)
class Setup:
    """A full oracle setting: conventions, extras and hyperparameters."""

    conv: Convention
    extras: Extras
    hp: Hyperparams

    def convention_dict(self) -> dict[str, Any]:
        """Conventions and extras as one flat JSON-friendly dict (the report's ``convention``)."""
        out = self.conv.to_dict()
        for name in CONVENTION_KEYS:  # Convention.to_dict leaves some defaults out (golden files)
            if name not in out:
                value = getattr(self.conv, name)
                out[name] = getattr(value, "value", value)
        out.update(asdict(self.extras))
        return out

    def hparams_dict(self) -> dict[str, Any]:
        return asdict(self.hp)

    def with_convention(self, updates: dict[str, Any]) -> Setup:
        """A copy with some convention/extra keys replaced (typed values, not strings)."""
        conv_up = {k: v for k, v in updates.items() if k in CONVENTION_KEYS}
        ext_up = {k: v for k, v in updates.items() if k in EXTRA_KEYS}
        unknown = sorted(set(updates) - set(conv_up) - set(ext_up))
        if unknown:
            raise ConventionError(f"unknown convention keys {unknown}")
        return Setup(self.conv.with_updates(conv_up), replace(self.extras, **ext_up), self.hp)


def unknown_key(key: str) -> str:
    """One short line for an unknown setting: the "did you mean" of a close key (``refppo train``'s
    ``SECTION.KEY`` spelling pointed at its bare key), else where the keys are listed."""
    import difflib

    leaf = key.rsplit(".", 1)[-1]
    if leaf != key and leaf in ALL_KEYS:
        return f"unknown key {key!r}: did you mean {leaf}? (refppo diff's keys have no section)"
    close = difflib.get_close_matches(leaf, ALL_KEYS, n=1, cutoff=0.6)
    if close:
        return f"unknown key {key!r}: did you mean {close[0]}?"
    return (
        f"unknown key {key!r}: not a convention key, oracle extra or hyperparameter "
        "(spec/dump-format.md, the sidecar section, lists them)"
    )


def _none_word(text: str) -> bool:
    return text.strip().lower() in ("none", "null", "off", "")


def parse_value(key: str, value: Any) -> Any:
    """Turn a JSON value or a ``--set`` string into the typed value of ``key``.

    Raises ConventionError on an unknown key, HyperparameterError on a malformed value.
    """
    if key not in ALL_KEYS:
        raise ConventionError(unknown_key(key))
    try:
        if key in _FLOAT_OR_NONE or key in _FLOAT_OR_NONE_HP:
            if value is None or (isinstance(value, str) and _none_word(value)):
                return None
            return _to_float(value)
        if key == "kl_log_ratio_clamp":
            if value is None or (isinstance(value, str) and _none_word(value)):
                return None
            parts: list[Any] = value.split(",") if isinstance(value, str) else list(value)
            if len(parts) != 2:
                raise HyperparameterError(
                    f"kl_log_ratio_clamp: expected two bounds LO,HI (either may be none), got {value!r}"
                )
            lo, hi = (
                None if (p is None or (isinstance(p, str) and _none_word(p))) else _to_float(p) for p in parts
            )
            return (lo, hi)
        if key in HPARAM_KEYS or key in _FLOAT_EXTRAS:
            return _to_float(value)
    except (TypeError, ValueError) as exc:
        raise HyperparameterError(f"{key}: expected a number, got {value!r}") from exc
    if key in _NAME_OR_NONE and (value is None or (isinstance(value, str) and _none_word(value))):
        return None
    if not isinstance(value, str):
        raise ConventionError(f"{key}: expected a name (string), got {value!r}")
    return value.strip()


def _to_float(value: Any) -> float:
    if isinstance(value, bool):
        raise TypeError("bool is not a number")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return float(value.strip())
    raise TypeError(f"not a number: {value!r}")


def build_setup(
    *,
    preset_conv: dict[str, Any] | None,
    preset_hp: dict[str, Any] | None,
    sidecar: dict[str, Any],
    overrides: dict[str, Any],
) -> Setup:
    """Resolve the setting: refppo defaults < sidecar < preset conventions < ``--set``.

    Hyperparameters: preset defaults < sidecar < ``--set`` (a preset supplies a peer's default
    hyperparameters, the sidecar records the run's real ones). All values must already be typed
    (see :func:`parse_value`). Raises HyperparameterError when a required hyperparameter is missing,
    ConventionError on a setting its estimator ignores or cannot run
    (:func:`refppo.pipeline.settings.unread_convention`).
    """
    conv_vals: dict[str, Any] = {}
    hp_vals: dict[str, Any] = dict(preset_hp or {})
    for src in (sidecar, preset_conv or {}, overrides):
        for k, v in src.items():
            if k in HPARAM_KEYS:
                if src is not preset_conv:
                    hp_vals[k] = v
            else:
                conv_vals[k] = v
    missing = [k for k in REQUIRED_HPARAMS if k not in hp_vals]
    if missing:
        raise HyperparameterError(
            f"missing hyperparameters {missing}: "
            "give them in the sidecar JSON, --hparams FILE or --set KEY=VALUE"
        )
    hp = Hyperparams(**hp_vals)
    setup = Setup(Convention(), Extras(), hp).with_convention(conv_vals)
    unread = unread_convention(setup.conv)
    if unread is not None:  # here, not in Convention: --detect's walk builds such conventions
        raise ConventionError(unread)
    return setup
