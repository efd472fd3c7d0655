"""The seven sections of a training run's config, each a typed, frozen dataclass (CleanRL style).

Every field carries its docstring (the string literal under it: ``refppo train --help-config``
prints them, :mod:`refppo.train.config.doc`) and each section checks its own values on construction
(``__post_init__``: ranges and choices, one :class:`ConfigError` naming ``section.key``). The
checks spanning sections (critic-free options, dump needs, rank splits) sit on
:class:`refppo.train.config.schema.TrainConfig`.

    [model]      ModelConfig       [rollout]  RolloutConfig     [optimizer]  OptimizerConfig
    [task]       TaskConfig        [ppo]      PPOConfig         [kl]         KLConfig
    [run]        RunConfig
"""

from __future__ import annotations

from dataclasses import dataclass, field

from refppo.errors import RefPPOError
from refppo.pipeline.settings import Convention, Hyperparams


class ConfigError(RefPPOError):
    """A bad config: unknown key, wrong type, or sizes that do not split evenly."""


def _choice(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ConfigError(f"{name}: expected one of {list(valid)}, got {value!r}")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{name}: expected > 0, got {value!r}")


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
    """The embedded task: ``words``, the synthetic review language (:mod:`refppo.train.tasks.words`)."""
    prompts_file: str | None = None
    """A UTF-8 text file with one prompt per line (blank lines skipped), sampled uniformly with the
    run's seeded RNG; None: prompts from the embedded task's generator."""
    reward: str = "model"
    """``model`` (a reward model: ``model.reward_model`` or one trained here on preference pairs
    labelled by the task's hidden rule), ``rule`` (the hidden rule itself, programmatic), or
    ``package.module:function`` (``--reward``; the module is looked up in the current directory
    first, as ``python -m``) called as ``function(prompt: str, response: str)`` once per response
    and returning one finite real number (what it receives: :mod:`refppo.train.reward_fn`)."""
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
    ``grpo``, ``dr-grpo``, ``rloo``, ``reinforce++-baseline``, ``opo``, ``gpg``, ``grpo-passk``:
    needs ≥ 2; ``reinforce++`` and ``flash-reinforce`` need no group). A group's rows always
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
    """Numeric hyperparameters (γ, λ, β, ε, ...): :class:`refppo.pipeline.settings.Hyperparams`."""
    convention: Convention = field(default_factory=Convention, metadata={"flatten": True})
    """Conventions (KL estimator and placement, score position, loss aggregation, the score map
    ``score_bias``/``score_scale``/``score_clip``, ...): the flat keys of
    :class:`refppo.pipeline.settings.Convention` (:data:`refppo.pipeline.settings.CONFIG_KEYS`)."""

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
    (:mod:`refppo.train.kl_controller`), with n the global batch size."""
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
    """Output directory: config.json, run.json, metrics.jsonl, plot.png, checkpoints/iter_000030/
    (one folder per saved iteration, its number in six digits: iteration 2 is iter_000002) and
    dumps/ (``run.dump_iteration``)."""
    sample_every: int = 10
    """Print sample generations every N iterations (0: never)."""
    checkpoint_every: int = 0
    """Save a checkpoint every N iterations (0: only at the end) to
    ``<run.out_dir>/checkpoints/iter_<NNNNNN>/`` (six digits: ``iter_000002`` after iteration 2)."""
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
    gradients ∂J/∂logprobs and ∂J/∂values) to ``<run.out_dir>/dumps/iter_<NNNNNN>.safetensors``
    (``iter_000002.safetensors`` for N = 2); none: off. One optimizer step is dumped, and the oracle
    recomputes the whitening and the group or batch statistics over the dump's rows alone, so with
    the defaults (``ppo.minibatches=4``, ``ppo.whiten_advantages=masked``) also set
    ``ppo.minibatches=1`` (each epoch one step over the whole rollout batch). ``ppo.minibatches`` > 1
    is accepted only without whitening (``ppo.whiten_advantages=none``, ``ppo.whiten_rewards=none``)
    and with ``gae`` or ``reinforce++``, whose advantages are per row."""

    def __post_init__(self) -> None:
        if self.iterations < 0 or self.sample_every < 0 or self.checkpoint_every < 0:
            raise ConfigError("run.iterations, run.sample_every and run.checkpoint_every must be ≥ 0")
        if self.dump_iteration is not None and not 1 <= self.dump_iteration <= self.iterations:
            raise ConfigError(
                f"run.dump_iteration: expected an iteration in 1..{self.iterations} (run.iterations), "
                f"got {self.dump_iteration}"
            )
        _choice("run.on_nan", self.on_nan, ("raise", "skip"))


__all__ = [
    "ConfigError",
    "KLConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PPOConfig",
    "RolloutConfig",
    "RunConfig",
    "TaskConfig",
]
