"""The whole run's config, :class:`TrainConfig`: seven sections, the checks spanning them, the
derived per-rank sizes, and loading (defaults < TOML file < ``SECTION.KEY=VALUE`` overrides).

Cross-section checks (on construction, one :class:`ConfigError` each): the batch splits evenly
into ranks × minibatches × micro-batches of whole groups; ``model.critic_init=reward`` needs a
reward model; a critic-free ``ppo.advantage`` takes no critic option and a group estimator (``grpo``,
``dr-grpo``, ``rloo``, ``reinforce++-baseline``, ``opo``, ``gpg``, ``grpo-passk``) a
``rollout.group_size`` ≥ 2; a non-default ``ppo.group_std_level`` needs ``grpo`` or ``grpo-passk``
(the only estimators with a σ). A non-default ``ppo.group_std`` (``population``) elsewhere is
refused for a new run by :meth:`TrainConfig.unread_options` (called by the trainer, not on
construction: ``--resume`` of a run an older refppo started with it only warns, see that method);
``run.dump_iteration`` with whitening, groups or a batch baseline
(``gpg``'s α, ``flash-reinforce``'s mean) needs ``ppo.minibatches=1`` (the oracle's statistics are
over the dump's rows). Every estimator runs in the trainer: the batch statistics of ``gpg`` and
``flash-reinforce`` are all-reduced under torchrun; ``opo``'s lengths are the response mask's.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refppo.config.codec import apply_overrides, from_plain, to_plain
from refppo.config.sections import (
    ConfigError,
    KLConfig,
    ModelConfig,
    OptimizerConfig,
    PPOConfig,
    RolloutConfig,
    RunConfig,
    TaskConfig,
)
from refppo.conventions import AdvantageEstimator, GroupStdLevel, Variance
from refppo.core.group import GROUP_ESTIMATORS

STD_LEVEL_ESTIMATORS = (AdvantageEstimator.GRPO, AdvantageEstimator.GRPO_PASSK)
"""The estimators whose σ ``ppo.group_std_level`` chooses (:func:`refppo.core.group.group_scalar_advantages`
passes it to ``group_sigma`` for these two only); a non-default level with any other is refused."""


@dataclass(frozen=True)
class TrainConfig:
    """The whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Models and devices."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Prompts, warm start and reward."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """PPO update and pipeline conventions."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """AdamW."""
    kl: KLConfig = field(default_factory=KLConfig)
    """KL coefficient schedule."""
    run: RunConfig = field(default_factory=RunConfig)
    """Run length, output, logging."""

    def __post_init__(self) -> None:
        self.check_world_size(1)
        if self.model.critic_init == "reward" and self.task.reward != "model":
            raise ConfigError("model.critic_init='reward' needs task.reward='model'")
        self._check_critic_free()
        conv = self.ppo.convention
        whitened = conv.whiten_advantages.value != "none" or conv.whiten_rewards.value != "none"
        grouped = conv.advantage in GROUP_ESTIMATORS or conv.advantage is AdvantageEstimator.FLASH_REINFORCE
        if self.run.dump_iteration is not None and self.ppo.minibatches > 1 and grouped:
            raise ConfigError(
                f"run.dump_iteration needs ppo.minibatches=1 (got {self.ppo.minibatches}) with "
                f"ppo.advantage={conv.advantage.value}: the oracle computes the group (or batch) statistics "
                "over the dump's rows, so they must hold every group of the rollout batch whole"
            )
        if self.run.dump_iteration is not None and self.ppo.minibatches > 1 and whitened:
            raise ConfigError(
                f"run.dump_iteration needs ppo.minibatches=1 (got {self.ppo.minibatches}) while advantages "
                "or rewards are whitened: the oracle whitens over the dump's rows, so they must be the "
                "whole rollout batch (or set ppo.whiten_advantages=none and ppo.whiten_rewards=none)"
            )

    @property
    def critic_free(self) -> bool:
        """``ppo.advantage`` is not ``gae``: no critic model, no value loss, no critic optimizer."""
        return self.ppo.convention.advantage is not AdvantageEstimator.GAE

    def _check_critic_free(self) -> None:
        """The group size fits the estimator; no critic-only option is set without a critic."""
        adv, g = self.ppo.convention.advantage, self.rollout.group_size
        if adv in GROUP_ESTIMATORS and g < 2:
            raise ConfigError(
                f"ppo.advantage={adv.value} needs rollout.group_size >= 2 (responses per prompt), got {g}"
            )
        level = self.ppo.convention.group_std_level
        if level is not GroupStdLevel.GROUP and adv not in STD_LEVEL_ESTIMATORS:
            raise ConfigError(
                f"ppo.group_std_level={level.value} is set but ppo.advantage={adv.value} takes no group std "
                f"(only {', '.join(e.value for e in STD_LEVEL_ESTIMATORS)} read it)"
            )
        if not self.critic_free:
            return
        if self.optimizer.critic_lr is not None:
            raise ConfigError(f"optimizer.critic_lr is set but ppo.advantage={adv.value} has no critic")
        if self.model.critic_init != "policy":
            raise ConfigError(
                f"model.critic_init={self.model.critic_init!r} is set but ppo.advantage={adv.value} "
                "has no critic"
            )

    def unread_options(self) -> str | None:
        """One line naming a set option that no step of this config reads, else None: a non-default
        ``ppo.group_std`` (the divisor of σ) where ``ppo.advantage`` takes no group std (only
        :data:`STD_LEVEL_ESTIMATORS` read it; ``group_std_level``'s twin check is on construction).

        Not checked on construction: refppo releases up to 61be225 accepted it, so a run started
        then may hold it in its checkpoints, and ``--resume`` (which rebuilds this config from the
        same flags) must still work. The trainer refuses it for a new run (:class:`ConfigError`)
        and prints it as a one-line warning on ``--resume`` (the option had, and has, no effect)."""
        adv, std = self.ppo.convention.advantage, self.ppo.convention.group_std
        if std is Variance.UNBIASED or adv in STD_LEVEL_ESTIMATORS:
            return None
        return (
            f"ppo.group_std={std.value} is set but ppo.advantage={adv.value} takes no group std "
            f"(only {', '.join(e.value for e in STD_LEVEL_ESTIMATORS)} read it)"
        )

    # ----------------------------------------------------------------------------------- derived sizes
    def check_world_size(self, world_size: int) -> None:
        """Fail loudly unless batch / world_size / minibatches / micro_batches all split evenly and
        every rank holds whole groups of ``rollout.group_size`` responses."""
        b, w, g = self.rollout.batch_size, world_size, self.rollout.group_size
        mb, mu = self.ppo.minibatches, self.ppo.micro_batches
        if b % w:
            raise ConfigError(f"rollout.batch_size={b} does not split evenly over {w} ranks")
        if (b // w) % g:
            raise ConfigError(
                f"rollout.batch_size={b} / {w} ranks = {b // w} responses per rank is not a multiple of "
                f"rollout.group_size={g} (a group's responses must sit on one rank)"
            )
        local = b // w
        if local % mb:
            raise ConfigError(
                f"per-rank batch {local} (rollout.batch_size={b} / {w} ranks) does not split into "
                f"ppo.minibatches={mb} equal minibatches"
            )
        if (local // mb) % mu:
            raise ConfigError(
                f"per-rank minibatch {local // mb} does not split into ppo.micro_batches={mu} equal "
                f"micro-batches (rollout.batch_size={b}, ranks={w}, ppo.minibatches={mb})"
            )

    def minibatch_size(self, world_size: int = 1) -> int:
        """Sequences per minibatch on one rank."""
        return self.rollout.batch_size // world_size // self.ppo.minibatches

    def micro_batch_size(self, world_size: int = 1) -> int:
        """Sequences per micro-batch on one rank."""
        return self.minibatch_size(world_size) // self.ppo.micro_batches

    # ---------------------------------------------------------------------------------- (de)serialise
    def to_dict(self) -> dict[str, Any]:
        """Nested plain dict (TOML/JSON-friendly; enums as their names, ``hp``/``convention`` flattened)."""
        out: dict[str, Any] = to_plain(self)
        return out

    def to_json(self) -> str:
        """``to_dict`` as indented JSON."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from a nested dict; unknown keys raise a ConfigError listing the valid ones."""
        return from_plain(cls, data)

    def with_overrides(self, overrides: list[str] | tuple[str, ...]) -> TrainConfig:
        """A copy with ``SECTION.KEY=VALUE`` overrides applied (values parsed as TOML, else strings)."""
        return TrainConfig.from_dict(apply_overrides(TrainConfig, self.to_dict(), overrides))


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Defaults, updated from a TOML file (if given), then from ``SECTION.KEY=VALUE`` overrides."""
    cfg = TrainConfig()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(p)!r}: {e}") from e
        cfg = TrainConfig.from_dict(data)
    return cfg.with_overrides(list(overrides)) if overrides else cfg


__all__ = ["TrainConfig", "load_config"]
