"""What one oracle comparison runs under: a pipeline ``Convention`` and ``Hyperparams``.

The flat key space (``--set KEY=VALUE``, the sidecar JSON, the ``convention`` object of the JSON
report) is the union of

- the flat convention keys of :class:`refppo.pipeline.settings.Convention`
  (:data:`refppo.pipeline.settings.FLAT`, derived from its groups: ``kl_estimator``, ``kl_in``,
  ``score_at``, the whitening, aggregation, value and critic-free keys, the score map's
  ``score_clip``, ``score_bias``, ``score_scale``, the logged ``approx_kl`` metric and the value
  loss's ``vf_mask``);
- the fields of :class:`refppo.pipeline.settings.Hyperparams` (``gamma``, ``lam``, ``kl_coef``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from refppo.errors import ConventionError, HyperparameterError
from refppo.pipeline.reads import missing_hparams, missing_hparams_line
from refppo.pipeline.settings import (
    CONVENTION_KEYS,
    FLAT,
    HPARAM_KEYS,
    Convention,
    Hyperparams,
    json_value,
)
from refppo.pipeline.unread import unread_convention

REQUIRED_HPARAMS: tuple[str, ...] = ("gamma", "lam", "kl_coef", "cliprange", "cliprange_value", "vf_coef")
"""The hyperparameters a setting may require (the order the missing ones are named in); which of them
it does require is the stage table's answer (:func:`refppo.pipeline.reads.required_hparams`)."""
ALL_KEYS: tuple[str, ...] = CONVENTION_KEYS + HPARAM_KEYS

REPORT_TAIL: tuple[str, ...] = ("score_clip", "score_bias", "score_scale", "approx_kl", "vf_mask")
"""The keys the report's ``convention`` object writes last, in this order (the reports' layout
since these keys were the oracle's own, kept byte for byte)."""

_FLOAT_OR_NONE = {
    "dual_clip", "log_ratio_clamp", "kl_value_clamp", "score_clip", "rollout_is_low", "rollout_is_high",
    "kl_grad_is_clip", "rollout_rs_low", "rollout_rs_high", "kl_loss_value_clamp",
}  # fmt: skip
_FLOAT_EXTRAS = {"score_bias", "score_scale", "group_eps"}
"""Keys holding a plain float (the score map's bias and scale, ``group_eps``)."""
_FLOAT_OR_NONE_HP = {"cliprange_high", "horizon", "kl_loss_coef"}
_NAME_OR_NONE = {
    "value_loss_agg",
    "kl_loss_agg",
    "entropy_agg",
    "rollout_is",
    "kl_metric_agg",
    "rollout_rs",
    "kl_loss_estimator",
}


@dataclass(frozen=True)
class Setup:
    """A full oracle setting: conventions and hyperparameters."""

    conv: Convention
    hp: Hyperparams

    def convention_dict(self) -> dict[str, Any]:
        """The conventions as one flat JSON-friendly dict (the report's ``convention``): the keys
        of :meth:`Convention.to_dict` first, then the ones it leaves out at their defaults, then
        :data:`REPORT_TAIL`."""
        full = {k: json_value(v) for k, v in self.conv.flat().items()}
        out = {k: v for k, v in self.conv.to_dict().items() if k not in REPORT_TAIL}
        out.update({k: v for k, v in full.items() if k not in out and k not in REPORT_TAIL})
        out.update({k: full[k] for k in REPORT_TAIL})
        return out

    def hparams_dict(self) -> dict[str, Any]:
        return self.hp.to_dict()

    def with_convention(self, updates: dict[str, Any]) -> Setup:
        """A copy with some flat convention keys replaced (typed values, not strings)."""
        unknown = sorted(set(updates) - set(FLAT))
        if unknown:
            raise ConventionError(f"unknown convention keys {unknown}")
        return Setup(self.conv.with_updates(updates), self.hp)


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
        if key in ("kl_log_ratio_clamp", "kl_loss_log_ratio_clamp"):
            if value is None or (isinstance(value, str) and _none_word(value)):
                return None
            parts: list[Any] = value.split(",") if isinstance(value, str) else list(value)
            if len(parts) != 2:
                raise HyperparameterError(
                    f"{key}: expected two bounds LO,HI (either may be none), got {value!r}"
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
    critic: bool = False,
) -> Setup:
    """Resolve the setting: refppo defaults < sidecar < preset conventions < ``--set``.

    Hyperparameters: preset defaults < sidecar < ``--set`` (a preset supplies a peer's default
    hyperparameters, the sidecar records the run's real ones). All values must already be typed
    (see :func:`parse_value`). Raises HyperparameterError when a hyperparameter the setting reads is
    missing (:func:`refppo.pipeline.reads.missing_hparams`; ``critic``: the dump holds a critic's
    ``values`` and ``old_values``, whose value loss a critic-free estimator then computes too),
    ConventionError on a setting its estimator ignores or cannot run
    (:func:`refppo.pipeline.unread.unread_convention`).
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
    hp = Hyperparams(**hp_vals)
    setup = Setup(Convention(), hp).with_convention(conv_vals)
    missing = missing_hparams(setup.conv, frozenset(hp_vals), critic=critic, order=REQUIRED_HPARAMS)
    if missing:  # only those a stage reads under this setting (pipeline.reads.required_hparams)
        raise HyperparameterError(missing_hparams_line(missing))
    unread = unread_convention(setup.conv)
    if unread is not None:  # here, not in Convention: --detect's walk builds such conventions
        raise ConventionError(unread)
    return setup
