"""The whole run's config, :class:`TrainConfig`: seven sections, the checks spanning them, the
derived per-rank sizes, and loading (defaults < TOML file < ``SECTION.KEY=VALUE`` overrides).

Cross-section checks (on construction, one :class:`ConfigError` each): the batch splits evenly
into ranks × minibatches × micro-batches of whole groups; ``model.critic_init=reward`` needs a
reward model; a critic-free ``ppo.advantage`` takes no critic option and a group estimator (``grpo``,
``dr-grpo``, ``rloo``, ``reinforce++-baseline``, ``opo``, ``gpg``, ``grpo-passk``) a
``rollout.group_size`` ≥ 2; a non-default ``ppo.group_std_level`` needs ``grpo`` or ``grpo-passk``
(the only estimators with a σ). Options no step would read are refused for a new run by
:meth:`TrainConfig.unread_options` (called by the trainer, not on construction: ``--resume`` of a
run an older refppo started with them only warns, see that method): a non-default ``ppo.group_std``
or ``ppo.group_eps`` where no σ is taken, a critic or GAE option (:data:`CRITIC_ONLY_KEYS`) off its
default under a critic-free ``ppo.advantage``, and ``grpo-passk`` with ``group_singleton=score``;
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

from refppo.conventions import AdvantageEstimator, LossAgg, Variance
from refppo.core._group_checks import GROUP_ESTIMATORS
from refppo.pipeline.settings import FLAT, Convention, Hyperparams
from refppo.pipeline.unread import SIGMA_ESTIMATORS, unread_convention, unread_std_level
from refppo.train.config.codec import apply_overrides, from_plain, to_plain
from refppo.train.config.seam import SeamConfig
from refppo.train.config.sections import (
    ConfigError,
    KLConfig,
    ModelConfig,
    OptimizerConfig,
    PPOConfig,
    RolloutConfig,
    RunConfig,
    TaskConfig,
)

STD_LEVEL_ESTIMATORS = SIGMA_ESTIMATORS
"""The estimators whose σ ``ppo.group_std_level`` chooses (:data:`refppo.pipeline.unread.SIGMA_ESTIMATORS`);
a non-default level with any other is refused."""

CRITIC_ONLY_KEYS = ("vf_coef", "cliprange_value", "value_loss", "value_clip_form", "value_loss_agg", "lam")
"""``[ppo]`` keys only ``ppo.advantage=gae`` reads: the value loss
(:func:`refppo.pipeline.step.update_quantities`
computes none without values) and GAE's λ (:func:`refppo.pipeline.step.rollout_quantities`; the critic-free
estimators, ``reinforce++`` included, use γ only). Off their default under a critic-free estimator they
are refused for a new run (:meth:`TrainConfig.unread_options`)."""

_DEFAULT_CONVENTION, _DEFAULT_HP, _DEFAULT_SEAM = Convention(), Hyperparams(), SeamConfig()


def _off_default(conv: Convention, hp: Hyperparams) -> list[tuple[str, Any]]:
    """``(key, value)`` of every :data:`CRITIC_ONLY_KEYS` field that differs from its default."""
    out: list[tuple[str, Any]] = []
    for key in CRITIC_ONLY_KEYS:
        if key in FLAT:
            value, default = conv.get(key), _DEFAULT_CONVENTION.get(key)
        else:
            value, default = getattr(hp, key), getattr(_DEFAULT_HP, key)
        if value != default:
            out.append((key, value))
    return out


def _shown(value: Any) -> str:
    """A value as ``--set`` spells it (an enum by its name, None as ``none``)."""
    if value is None:
        return "none"
    return str(getattr(value, "value", value))


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
    seam: SeamConfig = field(default_factory=SeamConfig)
    """The rollout–trainer seam mode (off by default)."""

    def __post_init__(self) -> None:
        self.check_world_size(1)
        if self.model.critic_init == "reward" and self.task.reward != "model":
            raise ConfigError("model.critic_init='reward' needs task.reward='model'")
        self._check_critic_free()
        self._check_seam()
        conv = self.ppo.convention
        whitened = conv.whiten.advantages.value != "none" or conv.reward.whiten.value != "none"
        est = conv.adv.estimator
        grouped = est in GROUP_ESTIMATORS or est is AdvantageEstimator.FLASH_REINFORCE
        if self.run.dump_iteration is not None and self.ppo.minibatches > 1 and grouped:
            raise ConfigError(
                f"run.dump_iteration needs ppo.minibatches=1 (got {self.ppo.minibatches}) with "
                f"ppo.advantage={est.value}: the oracle computes the group (or batch) statistics "
                "over the dump's rows, so they must hold every group of the rollout batch whole; "
                "add --set ppo.minibatches=1"
            )
        if self.run.dump_iteration is not None and self.ppo.minibatches > 1 and whitened:
            keys = [k for k in ("whiten_advantages", "whiten_rewards") if conv.get(k).value != "none"]
            on = [f"ppo.{k}={conv.get(k).value}" for k in keys]
            off = ", ".join(f"ppo.{k}=none" for k in keys)
            raise ConfigError(
                f"run.dump_iteration needs ppo.minibatches=1 (got {self.ppo.minibatches}) with "
                f"{' and '.join(on)}: one optimizer step is dumped and the oracle whitens over its rows, "
                "which must then be the whole rollout batch; add --set ppo.minibatches=1 (each epoch "
                f"one step over the batch), or turn the whitening off ({off})"
            )

    @property
    def critic_free(self) -> bool:
        """``ppo.advantage`` is not ``gae``: no critic model, no value loss, no critic optimizer."""
        return self.ppo.convention.adv.estimator is not AdvantageEstimator.GAE

    def _check_critic_free(self) -> None:
        """The group size fits the estimator; no critic-only option is set without a critic."""
        adv, g = self.ppo.convention.adv.estimator, self.rollout.group_size
        if adv in GROUP_ESTIMATORS and g < 2:
            raise ConfigError(
                f"ppo.advantage={adv.value} needs rollout.group_size >= 2 (responses per prompt), got {g}"
            )
        level = unread_std_level(self.ppo.convention, prefix="ppo.")
        if level is not None:
            raise ConfigError(level)
        if not self.critic_free:
            return
        if self.optimizer.critic_lr is not None:
            raise ConfigError(f"optimizer.critic_lr is set but ppo.advantage={adv.value} has no critic")
        if self.model.critic_init != "policy":
            raise ConfigError(
                f"model.critic_init={self.model.critic_init!r} is set but ppo.advantage={adv.value} "
                "has no critic"
            )

    def _check_seam(self) -> None:
        """``ppo.rollout_is`` and ``ppo.rollout_rs`` read the engine's log-probs (``seam.enabled``);
        ``seam.*`` options need ``seam.enabled``; ``seam.logprobs=processed`` needs a sampling filter."""
        seam, conv = self.seam, self.ppo.convention
        for key, level in (("rollout_is", conv.rollout.level), ("rollout_rs", conv.gate.level)):
            if level is not None and not seam.enabled:
                raise ConfigError(
                    f"ppo.{key}={level.value} reads the behaviour log-probs of a rollout engine, which "
                    "only the seam mode has: add --set seam.enabled=true"
                )
        keys = [
            k
            for k in ("dtype", "logprobs", "staleness", "staleness_min")
            if getattr(seam, k) != getattr(_DEFAULT_SEAM, k)
        ]
        if keys and not seam.enabled:
            named = ", ".join(f"seam.{k}={getattr(seam, k)}" for k in keys)
            raise ConfigError(
                f"{named} {'is' if len(keys) == 1 else 'are'} set but seam.enabled=false, so no step "
                "reads it: add --set seam.enabled=true"
            )
        self._check_prompt_mean()
        r = self.rollout
        if seam.logprobs == "processed" and r.top_p >= 1.0 and r.top_k == 0:
            raise ConfigError(
                "seam.logprobs=processed renormalises over the sampler's top-k / top-p support, but "
                "rollout.top_p=1.0 and rollout.top_k=0 filter nothing (raw and processed are equal)"
            )

    def _check_prompt_mean(self) -> None:
        """``prompt-mean`` (SkyRL 0.4.0) aggregates the policy and entropy terms only: with a critic
        the value loss, and with ``kl_in`` in the loss the KL term, name their own aggregation."""
        conv = self.ppo.convention
        if conv.agg.loss is not LossAgg.PROMPT_MEAN:
            return
        terms = [("value", "value_loss_agg")] if not self.critic_free else []
        terms += [("kl", "kl_loss_agg")] if conv.kl.placement.in_loss else []
        for term, key in terms:
            if conv.agg.of(term) is LossAgg.PROMPT_MEAN:
                raise ConfigError(
                    f"ppo.loss_agg=prompt-mean aggregates the policy terms only: the {term} term needs its "
                    f"own ppo.{key} (e.g. --set ppo.{key}=token-mean)"
                )

    def unread_options(self) -> str | None:
        """One line naming the set options that no step of this config reads, else None:

        - a non-default ``ppo.group_std`` (the divisor of σ) or ``ppo.group_eps`` (σ's ε) where
          ``ppo.advantage`` takes no group std (only :data:`STD_LEVEL_ESTIMATORS` read them;
          ``group_std_level``'s twin check is on construction);
        - a critic or GAE option (:data:`CRITIC_ONLY_KEYS`: ``vf_coef``, ``cliprange_value``,
          ``value_loss``, ``value_clip_form``, ``value_loss_agg``, ``lam``) off its default where
          ``ppo.advantage`` is critic-free (no critic, no value loss, no GAE; ``reinforce++`` uses
          γ only);
        - ``ppo.group_singleton=score`` with ``grpo-passk``
          (:func:`refppo.pipeline.unread.unread_convention`; it has no score for a group of one).

        Not checked on construction: refppo releases up to 61be225 accepted them, so a run started
        then may hold them in its checkpoints, and ``--resume`` (which rebuilds this config from the
        same flags) must still work. The trainer refuses them for a new run (:class:`ConfigError`)
        and prints the line as a warning on ``--resume`` (the options had, and have, no effect)."""
        adv, conv, hp = self.ppo.convention.adv.estimator, self.ppo.convention, self.ppo.hp
        parts: list[str] = []
        if adv not in STD_LEVEL_ESTIMATORS:
            std = conv.adv.group_std
            std_keys = [f"ppo.group_std={std.value}"] if std is not Variance.UNBIASED else []
            if conv.adv.group_eps != _DEFAULT_CONVENTION.adv.group_eps:
                std_keys.append(f"ppo.group_eps={conv.adv.group_eps!r}")
            if std_keys:
                parts.append(
                    f"{' and '.join(std_keys)} {'is' if len(std_keys) == 1 else 'are'} set but "
                    f"ppo.advantage={adv.value} takes no group std "
                    f"(only {', '.join(e.value for e in STD_LEVEL_ESTIMATORS)} read it)"
                )
        if self.critic_free:
            critic = [f"ppo.{k}={_shown(v)}" for k, v in _off_default(conv, hp)]
            if critic:
                parts.append(
                    f"{', '.join(critic)} {'is' if len(critic) == 1 else 'are'} set but "
                    f"ppo.advantage={adv.value} has no critic and no GAE (only gae reads "
                    f"{'it' if len(critic) == 1 else 'them'})"
                )
        passk = unread_convention(conv, prefix="ppo.")  # group_std_level is refused on construction
        if passk is not None:
            parts.append(passk)
        return "; ".join(parts) if parts else None

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
