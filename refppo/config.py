"""Every hyperparameter of a training run in one typed, frozen config (CleanRL style).

Sections (TOML tables; ``--set SECTION.KEY=VALUE`` on the command line)::

    [model]      policy / reward-model sources, tiny-model sizes, device, dtype
    [task]       the embedded task (warm start, reward model training) and the reward source
    [rollout]    prompts per iteration, generation length, sampling
    [ppo]        epochs × minibatches × micro-batches, grad clipping, plus EVERY field of
                 :class:`refppo.pipeline.Hyperparams` and :class:`refppo.pipeline.Convention`
                 (flattened: ``ppo.cliprange``, ``ppo.loss_agg``)
    [optimizer]  AdamW
    [kl]         fixed or adaptive KL coefficient (the initial β is ``ppo.kl_coef``)
    [run]        iterations, seed, output, logging, checkpoints

Unknown keys raise a :class:`ConfigError` listing the valid keys of that section; derived sizes
(uneven minibatch / micro-batch / rank splits) are checked on construction.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar, Union

from refppo.conventions import AdvantageEstimator, parse
from refppo.core.group import GROUP_ESTIMATORS
from refppo.errors import RefPPOError
from refppo.pipeline import Convention, Hyperparams


class ConfigError(RefPPOError):
    """A bad config: unknown key, wrong type, or sizes that do not split evenly."""


# --------------------------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class ModelConfig:
    """Where the policy, reference, critic and reward model come from, and how they run."""

    policy: str = "tiny_gpt2"
    """``tiny_gpt2`` / ``tiny_llama`` (random init from a config, sized below) or a local directory
    holding any causal LM and its tokenizer (``AutoModelForCausalLM/AutoTokenizer.from_pretrained``;
    ``--model DIR``). The reference model is a frozen copy of the initial policy."""
    reward_model: str | None = None
    """Local directory of an ``AutoModelForSequenceClassification`` (``--reward-model DIR``), used
    when ``task.reward = "model"``. None: the embedded task trains a tiny reward model itself."""
    critic_init: str = "policy"
    """Critic initialisation: ``policy`` (policy backbone + fresh value head) or ``reward``
    (reward-model backbone, as TRL; needs a reward model)."""
    vocab_size: int = 0
    """Vocabulary of the tiny models (0: the tokenizer's size)."""
    n_embd: int = 64
    """Hidden size of the tiny models."""
    n_layer: int = 2
    """Layers of the tiny models."""
    n_head: int = 4
    """Attention heads of the tiny models."""
    n_positions: int = 64
    """Context length of the tiny models (prompt + response must fit)."""
    device: str = "auto"
    """``cpu``, ``cuda`` (``cuda:N`` or the local rank under torchrun), or ``auto`` (cuda if available)."""
    dtype: str = "auto"
    """``float32``, ``bfloat16``, ``float64`` or ``auto`` (bfloat16 on GPU, float32 on CPU)."""
    threads: int = 0
    """Intra-op CPU threads (``torch.set_num_threads``). 0 (auto): ONE thread when the policy has
    fewer than 50M parameters and runs on CPU, torch's default (one per core) otherwise. Small
    models gain nothing from a second thread and lose badly when the cores are shared (measured:
    benchmarks/bench_train.py --threads); set N to force N threads."""

    def __post_init__(self) -> None:
        _choice("model.critic_init", self.critic_init, ("policy", "reward"))
        _choice("model.dtype", self.dtype, ("auto", "float32", "bfloat16", "float64"))
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"model.device: expected cpu, cuda, cuda:N or auto, got {self.device!r}")
        for name in ("n_embd", "n_layer", "n_head", "n_positions"):
            _positive(f"model.{name}", getattr(self, name))
        if self.vocab_size < 0 or self.threads < 0:
            raise ConfigError("model.vocab_size and model.threads must be ≥ 0")
        if self.n_embd % self.n_head:
            raise ConfigError(f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}")


@dataclass(frozen=True)
class TaskConfig:
    """The prompts, the warm start and the reward."""

    name: str = "words"
    """The embedded task: ``words``, the synthetic review language (:mod:`refppo.tasks.words`)."""
    prompts_file: str | None = None
    """A UTF-8 text file with one prompt per line (blank lines skipped), sampled uniformly with the
    run's seeded RNG; None: prompts from the embedded task's generator."""
    reward: str = "model"
    """``model`` (a reward model: ``model.reward_model`` or one trained here on preference pairs
    labelled by the task's hidden rule), ``rule`` (the hidden rule itself, programmatic), or
    ``package.module:function`` (``--reward``; the module is looked up in the current directory
    first, as ``python -m``) called as ``function(prompt: str, response: str)`` once per response
    and returning one finite real number (what it receives: :mod:`refppo.reward_fn`)."""
    reward_special_tokens: bool = False
    """What a reward function (``module:function`` or ``rule``) sees: false (default) decodes the
    prompt and response with ``skip_special_tokens=True`` (no EOS, no sampled padding, no BOS);
    true keeps every special token spelled out (``</s>``, ``<pad>``, ``<s>``)."""
    add_special_tokens: bool = False
    """Tokenize prompts with the tokenizer's special tokens (e.g. the BOS of Llama-style models);
    False: the prompt text's tokens only, no BOS (the embedded task)."""
    embedded_prompts: bool = False
    """With a local policy (``--model DIR``) and no ``prompts_file``, train on the embedded task's
    synthetic prompts anyway (``--embedded-prompts``); false: such a run is refused."""
    sft_steps: int = 150
    """Warm-start (supervised) steps on task samples before PPO; 0 skips the warm start (as for
    ``--model DIR``, which is assumed to be trained already)."""
    sft_batch_size: int = 32
    """Sequences per warm-start step."""
    sft_lr: float = 3e-3
    """Warm-start AdamW learning rate."""
    rm_pairs: int = 2048
    """Preference pairs (from the task's sample generator, labelled by the hidden rule) to train the
    reward model."""
    rm_steps: int = 150
    """Reward-model training steps (Bradley–Terry loss); 0 keeps the random-init reward model
    (benchmarks)."""
    rm_batch_size: int = 64
    """Pairs per reward-model step."""
    rm_lr: float = 3e-3
    """Reward-model AdamW learning rate."""
    prompt_words: tuple[int, int] = (2, 5)
    """Range (inclusive) of prompt lengths in words; variable lengths exercise left padding."""
    response_words: tuple[int, int] = (3, 10)
    """Range (inclusive) of warm-start response lengths in words (before the end token)."""

    def __post_init__(self) -> None:
        _choice("task.name", self.name, ("words",))
        if self.reward not in ("model", "rule") and ":" not in self.reward:
            raise ConfigError(
                f"task.reward: expected 'model', 'rule' or 'module:function', got {self.reward!r}"
            )
        for name in ("sft_batch_size", "rm_batch_size"):
            _positive(f"task.{name}", getattr(self, name))
        for name in ("sft_steps", "rm_steps", "rm_pairs"):
            if getattr(self, name) < 0:
                raise ConfigError(f"task.{name}: expected ≥ 0, got {getattr(self, name)}")
        for name in ("prompt_words", "response_words"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ConfigError(f"task.{name}: expected 1 ≤ lo ≤ hi, got {(lo, hi)}")


@dataclass(frozen=True)
class RolloutConfig:
    """Generation of one iteration's batch."""

    batch_size: int = 64
    """Responses (rows) per iteration over ALL ranks (the global PPO batch): ``batch_size /
    group_size`` prompts, each answered ``group_size`` times."""
    group_size: int = 1
    """Responses sampled per prompt (GRPO's G, verl ``rollout.n``, OpenRLHF
    ``n_samples_per_prompt``): the group of a critic-free group estimator (``ppo.advantage`` =
    ``grpo``, ``dr-grpo``, ``rloo``, ``reinforce++-baseline``: needs ≥ 2). A group's rows always
    sit on one rank: ``batch_size`` must split into whole groups on every rank."""
    max_new_tokens: int = 12
    """Response length cap; responses stop early at the end-of-sequence token."""
    temperature: float = 1.0
    """Sampling temperature (the log-probs are those of the tempered distribution, as TRL)."""
    top_k: int = 0
    """Top-k filter of the sampler (0: off; the log-probs ignore the filter)."""
    top_p: float = 1.0
    """Nucleus filter of the sampler (1.0: off; the log-probs ignore the filter)."""
    missing_eos_penalty: float | None = 1.0
    """Subtracted from the score of a response truncated without EOS (TRL ``missing_eos_penalty``);
    None: off."""
    max_prompt_tokens: int = 0
    """Longest prompt accepted in tokens (0: context length − ``max_new_tokens``); a longer
    prompt raises an error instead of being truncated silently."""
    use_cache: bool = True
    """Generate with the model's KV cache (same tokens, ~8× faster); false re-runs the whole prefix
    each step, for models whose forward rejects ``past_key_values``."""

    def __post_init__(self) -> None:
        _positive("rollout.batch_size", self.batch_size)
        _positive("rollout.group_size", self.group_size)
        _positive("rollout.max_new_tokens", self.max_new_tokens)
        if not self.temperature > 0:
            raise ConfigError(f"rollout.temperature: expected > 0, got {self.temperature}")
        if self.max_prompt_tokens < 0:
            raise ConfigError("rollout.max_prompt_tokens must be ≥ 0")


@dataclass(frozen=True)
class PPOConfig:
    """The update schedule, plus the numeric hyperparameters and conventions of the pipeline.

    In TOML and ``--set`` the fields of ``hp`` and ``convention`` sit directly in ``[ppo]``.
    """

    epochs: int = 4
    """PPO epochs over each rollout batch."""
    minibatches: int = 4
    """Minibatches per epoch: one optimizer step each."""
    micro_batches: int = 1
    """Gradient-accumulation micro-batches per minibatch (per rank); the loss is normalised over
    the whole minibatch, so the step equals the un-split one."""
    max_grad_norm: float | None = 1.0
    """Global gradient-norm clip per optimizer step (None: off)."""
    hp: Hyperparams = field(default_factory=Hyperparams, metadata={"flatten": True})
    """Numeric hyperparameters (γ, λ, β, ε, ...): :class:`refppo.pipeline.Hyperparams`."""
    convention: Convention = field(default_factory=Convention, metadata={"flatten": True})
    """Conventions (KL estimator and placement, score position, loss aggregation, ...):
    :class:`refppo.pipeline.Convention`."""

    def __post_init__(self) -> None:
        for name in ("epochs", "minibatches", "micro_batches"):
            _positive(f"ppo.{name}", getattr(self, name))
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError(f"ppo.max_grad_norm: expected > 0 or none, got {self.max_grad_norm}")


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW for the policy and the critic."""

    lr: float = 3e-4
    """Policy learning rate."""
    critic_lr: float | None = None
    """Critic learning rate (None: ``lr``)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam β1, β2."""
    eps: float = 1e-8
    """Adam ε."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""

    def __post_init__(self) -> None:
        if not self.lr > 0 or (self.critic_lr is not None and not self.critic_lr > 0):
            raise ConfigError("optimizer.lr and optimizer.critic_lr must be > 0")
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optimizer.betas: expected values in [0, 1), got {self.betas}")


@dataclass(frozen=True)
class KLConfig:
    """The KL coefficient β over iterations (its initial value is ``ppo.kl_coef``)."""

    adaptive: bool = False
    """False: β fixed. True: Ziegler et al. (2019) β ← β·(1 + clip(KL/target − 1, ±0.2)·n/horizon)
    (:mod:`refppo.kl_controller`), with n the global batch size."""
    target: float = 1.0
    """Target KL per sequence (sum over response tokens, in nats; lm-human-preferences: 6)."""
    horizon: float = 10000.0
    """Horizon in episodes (lm-human-preferences: 10000)."""

    def __post_init__(self) -> None:
        _positive("kl.target", self.target)
        _positive("kl.horizon", self.horizon)


@dataclass(frozen=True)
class RunConfig:
    """The run itself: length, seed, output and logging."""

    iterations: int = 30
    """PPO iterations (one rollout batch + its update each)."""
    seed: int = 0
    """Seed of every RNG (python, numpy, torch, the sampling generator)."""
    out_dir: str = "runs/refppo"
    """Output directory: config.json, metrics.jsonl, plot.png, checkpoints/."""
    sample_every: int = 10
    """Print sample generations every N iterations (0: never)."""
    checkpoint_every: int = 0
    """Save a checkpoint every N iterations (0: only at the end)."""
    progress: bool = True
    """Show a tqdm progress bar with live reward / KL / loss; false (``--no-progress``): one plain
    line per iteration instead (for logs and pipes)."""
    plot: bool = True
    """Write plot.png (reward, KL, losses, clip fractions, entropy per iteration) at the end."""
    tensorboard: bool = False
    """Also log to TensorBoard (only if ``torch.utils.tensorboard`` can be imported; else a warning)."""
    on_nan: str = "raise"
    """A non-finite loss: ``raise`` (stop with an error naming the iteration) or ``skip`` (drop that
    iteration's remaining updates, restore the weights from before the update, log ``skipped=1``)."""
    dump_iteration: int | None = None
    """Write the last optimizer step of iteration N (1-based, as ``iteration`` in metrics.jsonl) as a
    v2 dump for ``refppo diff`` (``refppo.capture``: every micro-batch of every rank, with the
    gradients ∂J/∂logprobs and ∂J/∂values) to ``<run.out_dir>/dumps/iter_<N>.safetensors``; none: off.
    Needs ``ppo.minibatches=1`` unless advantages and rewards are not whitened (the oracle whitens
    over the dump's rows, which must then be the whole rollout batch)."""

    def __post_init__(self) -> None:
        if self.iterations < 0 or self.sample_every < 0 or self.checkpoint_every < 0:
            raise ConfigError("run.iterations, run.sample_every and run.checkpoint_every must be ≥ 0")
        if self.dump_iteration is not None and not 1 <= self.dump_iteration <= self.iterations:
            raise ConfigError(
                f"run.dump_iteration: expected an iteration in 1..{self.iterations} (run.iterations), "
                f"got {self.dump_iteration}"
            )
        _choice("run.on_nan", self.on_nan, ("raise", "skip"))


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
        grouped = conv.advantage in GROUP_ESTIMATORS
        if self.run.dump_iteration is not None and self.ppo.minibatches > 1 and grouped:
            raise ConfigError(
                f"run.dump_iteration needs ppo.minibatches=1 (got {self.ppo.minibatches}) with "
                f"ppo.advantage={conv.advantage.value}: the oracle computes the group statistics over "
                "the dump's rows, so they must hold every group of the rollout batch whole"
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
        if not self.critic_free:
            return
        if self.optimizer.critic_lr is not None:
            raise ConfigError(f"optimizer.critic_lr is set but ppo.advantage={adv.value} has no critic")
        if self.model.critic_init != "policy":
            raise ConfigError(
                f"model.critic_init={self.model.critic_init!r} is set but ppo.advantage={adv.value} "
                "has no critic"
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
        out: dict[str, Any] = _to_dict(self)
        return out

    def to_json(self) -> str:
        """``to_dict`` as indented JSON."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from a nested dict; unknown keys raise a ConfigError listing the valid ones."""
        return _from_dict(cls, data, "")

    def with_overrides(self, overrides: list[str] | tuple[str, ...]) -> TrainConfig:
        """A copy with ``SECTION.KEY=VALUE`` overrides applied (values parsed as TOML, else strings)."""
        data = self.to_dict()
        for item in overrides:
            key, sep, raw = item.partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"--set {item!r}: expected SECTION.KEY=VALUE, e.g. ppo.cliprange=0.1")
            path = key.strip().split(".")
            if len(path) != 2:
                raise ConfigError(
                    f"--set {item!r}: expected SECTION.KEY with one dot; sections: {_sections()}"
                )
            section, name = path
            if section not in data:
                raise ConfigError(f"unknown config section {section!r}; valid sections are {_sections()}")
            hint = _field_types(section).get(name)
            if hint is None:
                raise ConfigError(
                    f"unknown key {name!r} in [{section}]; valid keys are {sorted(_field_types(section))}"
                )
            data[section][name] = _parse_cli_value(raw.strip(), hint)
        return TrainConfig.from_dict(data)


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


# ----------------------------------------------------------------------------------------------- helpers

D = TypeVar("D")


def _choice(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ConfigError(f"{name}: expected one of {list(valid)}, got {value!r}")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{name}: expected > 0, got {value!r}")


def _sections() -> list[str]:
    return [f.name for f in fields(TrainConfig)]


def _flat_fields(cls: type[Any]) -> dict[str, tuple[str | None, Any]]:
    """``name -> (flattened sub-field or None, type hint)`` of the keys a section accepts."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[str | None, Any]] = {}
    for f in fields(cls):
        if f.metadata.get("flatten"):
            sub = hints[f.name]
            for name, tp in typing.get_type_hints(sub).items():
                if name in {g.name for g in fields(sub)}:
                    out[name] = (f.name, tp)
        else:
            out[f.name] = (None, hints[f.name])
    return out


def _field_types(section: str) -> dict[str, Any]:
    cls = typing.get_type_hints(TrainConfig)[section]
    return {k: tp for k, (_, tp) in _flat_fields(cls).items()}


def _to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: dict[str, Any] = {}
        for f in fields(obj):
            v = _to_dict(getattr(obj, f.name))
            if f.metadata.get("flatten"):
                out.update(v)
            else:
                out[f.name] = v
        return out
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, tuple):
        return [_to_dict(v) for v in obj]
    return obj


def _from_dict(cls: type[D], data: Any, where: str) -> D:
    label = f"[{where}]" if where else "the top level"
    if not isinstance(data, dict):
        raise ConfigError(f"{label}: expected a table, got {type(data).__name__}")
    if cls is TrainConfig:
        valid_top = _sections()
        unknown = sorted(set(data) - set(valid_top))
        if unknown:
            raise ConfigError(f"unknown config sections {unknown}; valid sections are {valid_top}")
        hints = typing.get_type_hints(cls)
        kwargs = {k: _from_dict(hints[k], v, k) for k, v in data.items()}
        return cls(**kwargs)
    accepted = _flat_fields(cls)
    unknown = sorted(set(data) - set(accepted))
    if unknown:
        raise ConfigError(f"unknown keys {unknown} in {label}; valid keys are {sorted(accepted)}")
    own: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for key, value in data.items():
        parent, tp = accepted[key]
        coerced = _coerce(value, tp, f"{where}.{key}")
        if parent is None:
            own[key] = coerced
        else:
            nested.setdefault(parent, {})[key] = coerced
    hints = typing.get_type_hints(cls)
    try:
        for parent, sub in nested.items():
            own[parent] = replace(hints[parent](), **sub)
        return cls(**own)
    except ConfigError:
        raise
    except RefPPOError as e:  # Hyperparams / Convention validation
        raise ConfigError(f"[{where}]: {e}") from e


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert one value against its field's type hint."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        is_none = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
        if is_none and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: {value!r} does not match {tp}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    if isinstance(tp, type) and issubclass(tp, Enum):
        try:
            return parse(tp, value, what=key)
        except RefPPOError as e:
            raise ConfigError(str(e)) from e
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(v, a, key) for v, a in zip(value, args, strict=True))
    raise ConfigError(f"{key}: unsupported field type {tp}")  # pragma: no cover - config bug


def _parse_cli_value(raw: str, hint: Any) -> Any:
    """A command-line value: strings stay raw (``none`` → None); the rest parse as a TOML value."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    if raw.lower() in ("none", "null") and type(None) in args:
        return None
    stringy = str in args or any(isinstance(a, type) and issubclass(a, Enum) for a in args)
    if stringy and not raw.startswith(('"', "'")):
        return raw
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


__all__ = [
    "ConfigError",
    "KLConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PPOConfig",
    "RolloutConfig",
    "RunConfig",
    "TaskConfig",
    "TrainConfig",
    "load_config",
]
