"""Convention settings an estimator ignores or cannot run, named in one line (the user-facing entry
points call :func:`unread_convention`: ``refppo diff``'s setting and the trainer's config).
"""

from __future__ import annotations

from refppo.conventions import AdvantageEstimator
from refppo.group_conventions import GroupSingleton, GroupStdLevel
from refppo.pipeline.settings import Convention

SIGMA_ESTIMATORS = (AdvantageEstimator.GRPO, AdvantageEstimator.GRPO_PASSK)
"""The estimators with a σ (:func:`refppo.core.group.group_scalar_advantages`): only they read
``group_std``, ``group_std_level`` and ``group_eps``."""


def unread_std_level(conv: Convention, prefix: str = "") -> str | None:
    """One line when ``group_std_level`` is off ``group`` but ``advantage`` has no σ, else None."""
    adv, level = conv.adv.estimator, conv.adv.group_std_level
    if level is GroupStdLevel.GROUP or adv in SIGMA_ESTIMATORS:
        return None
    return (
        f"{prefix}group_std_level={level.value} is set but {prefix}advantage={adv.value} "
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
    adv = conv.adv.estimator
    level = unread_std_level(conv, prefix)
    if level is not None:
        return level
    if adv is AdvantageEstimator.GRPO_PASSK and conv.adv.group_singleton is GroupSingleton.SCORE:
        return (
            f"{prefix}group_singleton=score is set but {prefix}advantage=grpo-passk has no second-best "
            f"score in a group of one (use {prefix}group_singleton=error or zero)"
        )
    return None


__all__ = ["SIGMA_ESTIMATORS", "unread_convention", "unread_std_level"]
