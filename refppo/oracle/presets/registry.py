"""Peer presets: each open-source trainer's PPO-step conventions as oracle keys.

One module per preset (:data:`PRESET_MODULES`, in the order of ``--preset``'s help and of the
"as in preset ..." lists): each holds its ``PRESET`` (:class:`refppo.oracle.presets.base.Preset`,
every value with the peer's source file and function) and, where the peer has them, its
critic-free variants ``CRITIC_FREE`` (:data:`VARIANTS`). Every value is
spelled out in ``spec/conventions.md``. No peer code is copied.

A preset fixes conventions and supplies the peer's *default* hyperparameters; the dump's sidecar
(the run's real hyperparameters) overrides the defaults, and ``--set`` overrides both.
KL clamps depend on the estimator in verl and OpenRLHF, so they are resolved by
:func:`resolve_preset` once the estimator is known (:mod:`refppo.oracle.presets.kl_clamps`).

Critic-free estimators (``--preset PEER --set advantage=EST``): a preset states the peer's
PPO-with-a-critic step; when the run's ``advantage`` (``--set``, else the sidecar) names a
critic-free estimator, the preset's conventions are adjusted by that peer's variant
(:data:`VARIANTS`), the way the KL clamps follow the KL estimator. ``tools/peers presets``
checks each variant against the peer's own code; a peer without the estimator is refused with a
one-line error. The peers' own names: verl 0.9.1 ``algorithm.adv_estimator`` ``grpo``
(``dr-grpo`` here is ``grpo`` with ``norm_adv_by_std_in_grpo=False``), ``rloo``,
``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``; OpenRLHF 0.11.2
``--algo.advantage.estimator`` ``group_norm``, ``dr_grpo``, ``rloo``, ``reinforce``,
``reinforce_baseline``; SkyRL-train 0.3.1 ``algorithm.advantage_estimator`` ``grpo`` (``dr-grpo``:
``grpo_norm_by_std=false``), ``rloo``, ``reinforce++`` (SkyRL 0.4.0, ``skyrl04``, the same four).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from refppo.errors import ConventionError
from refppo.oracle.presets import (
    areal,
    deepspeed_chat,
    oat,
    openrlhf,
    refppo,
    rlinf,
    skyrl,
    skyrl04,
    torchtune,
    trinity,
    trl,
    verl,
)
from refppo.oracle.presets.base import Preset, Variant

PRESET_MODULES: tuple[ModuleType, ...] = (
    refppo,
    verl,
    openrlhf,
    trl,
    deepspeed_chat,
    skyrl,
    areal,
    torchtune,
    trinity,
    oat,
    rlinf,
    skyrl04,
)
"""The preset modules, in the registry's order."""

PRESETS: dict[str, Preset] = {m.PRESET.name: m.PRESET for m in PRESET_MODULES}
"""Every preset by name: refppo, verl, openrlhf, trl, deepspeed-chat, skyrl, areal, torchtune, trinity,
oat, rlinf, skyrl04."""

PEER_PRESETS: tuple[str, ...] = tuple(name for name in PRESETS if name != "refppo")

VARIANTS: dict[str, dict[str, Variant]] = {
    m.PRESET.name: m.CRITIC_FREE for m in PRESET_MODULES if getattr(m, "CRITIC_FREE", None)
}
"""``peer → advantage → {key: (value, source)}``, each peer module's ``CRITIC_FREE``. ``refppo``
itself takes any estimator as set."""


def get_preset(name: str) -> Preset:
    """The preset called ``name``; a ConventionError lists the valid names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConventionError(
            f"--preset: unknown preset {name!r}; valid presets are {sorted(PRESETS)}"
        ) from None


def resolve_preset(
    name: str, estimator: str | None = None, advantage: str | None = None, loss_estimator: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(conventions, default hparams)`` of preset ``name`` with the KL clamps of ``estimator``.

    ``estimator`` None keeps the preset's own KL estimator. ``advantage`` (None: ``gae``, the
    preset as written) applies the peer's critic-free variant
    (:func:`critic_free_variant`; a ConventionError when the peer has none). ``loss_estimator``
    (``kl_loss_estimator``, the KL loss's own under ``kl_in=both``) gets its clamps by the same rule
    as ``kl_loss_log_ratio_clamp`` / ``kl_loss_value_clamp``.
    """
    p = get_preset(name)
    conv = dict(p.conventions)
    if estimator is not None:
        conv["kl_estimator"] = estimator
    conv.update(p.kl_clamps(str(conv["kl_estimator"]).removesuffix("+")))  # k3+ clamps as k3
    if loss_estimator is not None:
        conv["kl_loss_estimator"] = loss_estimator
        conv.update({f"kl_loss_{k[3:]}": v for k, v in p.kl_clamps(loss_estimator.removesuffix("+")).items()})
    if advantage is not None:
        conv.update(critic_free_variant(name, advantage))
    return conv, dict(p.hparams)


def critic_free_variant(preset: str, advantage: str) -> dict[str, Any]:
    """The convention updates of ``preset`` under ``advantage`` (``{}`` for ``gae``).

    Raises ConventionError when the peer has no such estimator (one line, listing those it has).
    """
    if advantage == "gae" or preset == "refppo":
        return {"advantage": advantage}
    have = VARIANTS.get(preset, {})
    if advantage not in have:
        names = ", ".join(["gae", *have]) or "gae"
        raise ConventionError(
            f"--preset {preset}: no critic-free estimator advantage={advantage!r} in this preset "
            f"(it covers: {names}); use --preset refppo with --set keys to check another"
        )
    return {"advantage": advantage, **{k: v for k, (v, _) in have[advantage].items()}}


def variant_sources(preset: str, advantage: str) -> list[str]:
    """``key=value: source`` lines of one variant (for spec/conventions.md and the tests)."""
    return [f"{k}={v}: {src}" for k, (v, src) in VARIANTS.get(preset, {}).get(advantage, {}).items()]


__all__ = [
    "PEER_PRESETS",
    "PRESETS",
    "PRESET_MODULES",
    "VARIANTS",
    "critic_free_variant",
    "get_preset",
    "resolve_preset",
    "variant_sources",
]
