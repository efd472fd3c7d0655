"""Peer presets: each open-source trainer's PPO-step conventions as oracle keys.

Every value comes from the survey in ``shared/conventions.md`` (sections 1 and 2) and is spelled out,
with the peer's source file and function, in ``spec/conventions.md``. No peer code is copied.

A preset fixes conventions and supplies the peer's *default* hyperparameters; the dump's sidecar
(the run's real hyperparameters) overrides the defaults, and ``--set`` overrides both.
KL clamps depend on the estimator in verl and OpenRLHF, so they are resolved by
:func:`resolve_preset` once the estimator is known.

The preset table lives in :mod:`refppo.oracle.presets.table_a` (refppo, verl, OpenRLHF) and
:mod:`refppo.oracle.presets.table_b` (TRL, DeepSpeed-Chat, SkyRL, AReaL); the :class:`Preset` type
and the KL-clamp rules in :mod:`refppo.oracle.presets.base`. Every name stays importable from here.
"""

from __future__ import annotations

from typing import Any

from refppo.errors import ConventionError
from refppo.oracle.presets.base import (
    Preset,
)
from refppo.oracle.presets.table_a import PRESETS_A
from refppo.oracle.presets.table_b import PRESETS_B

PRESETS: dict[str, Preset] = {**PRESETS_A, **PRESETS_B}
"""Every preset by name: refppo, verl, openrlhf, trl, deepspeed-chat, skyrl, areal."""

PEER_PRESETS: tuple[str, ...] = ("verl", "openrlhf", "trl", "deepspeed-chat", "skyrl", "areal")


def get_preset(name: str) -> Preset:
    """The preset called ``name``; a ConventionError lists the valid names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConventionError(
            f"--preset: unknown preset {name!r}; valid presets are {sorted(PRESETS)}"
        ) from None


def resolve_preset(
    name: str, estimator: str | None = None, advantage: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(conventions, default hparams)`` of preset ``name`` with the KL clamps of ``estimator``.

    ``estimator`` None keeps the preset's own KL estimator. ``advantage`` (None: ``gae``, the
    preset as written) applies the peer's critic-free variant
    (:func:`refppo.oracle.presets.critic_free.critic_free_variant`; a ConventionError when the peer
    has none).
    """
    from refppo.oracle.presets.critic_free import critic_free_variant

    p = get_preset(name)
    conv = dict(p.conventions)
    if estimator is not None:
        conv["kl_estimator"] = estimator
    conv.update(p.kl_clamps(str(conv["kl_estimator"]).removesuffix("+")))  # k3+ clamps as k3
    if advantage is not None:
        conv.update(critic_free_variant(name, advantage))
    return conv, dict(p.hparams)
