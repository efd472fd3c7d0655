"""The trainer: models, data, logging and checkpoints around ONE per-iteration algorithm.

Each iteration is :func:`refppo.rollout.generate_rollout` followed by :func:`refppo.ppo.iteration`
(scoring → :func:`refppo.pipeline.rollout_quantities` → :func:`refppo.ppo.ppo_update`) — the same
functions the golden trajectories and the oracle check; this module adds no PPO math of its own.
(``generate_rollout`` is called here and its batch handed to ``iteration(batch=...)``, which is
exactly what ``iteration`` does itself when no batch is given; it lets the trainer time the
rollout separately.)

Numbered skeleton of :meth:`Trainer.train`::

    0. setup: seed every RNG; tokenizer; policy (tiny from config, or --model DIR); warm start
       (embedded task); reference = frozen copy; reward (model trained on rule-labelled pairs,
       --reward-model DIR, the rule, or module:function); critic (none when ppo.advantage is
       critic-free); AdamW ×2 (×1 without critic); KL controller;
       DDP wrap (torchrun); --resume restores weights, optimizers, RNGs, controller, iteration
    per iteration:
    1. prompts from the task's RNG, each repeated rollout.group_size times with its group_index
       (whole groups per rank: refppo.train_group) → token ids (length checked) → left-padded batch
    2. responses = generate_rollout(actor, prompts)                    (timed: rollout)
    3. result = ppo.iteration(..., hp with β from the KL controller)  (timed: score + update;
       under torchrun with the all_reduce hook: global normalisers and whitening)
    4. metrics reduced over ranks; non-finite loss → error (or skip + restore, run.on_nan)
    5. β ← controller.update(KL, global batch)
    6. log: JSONL, tqdm, TensorBoard, sample generations; checkpoint
    end: plot.png, final checkpoint
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import random
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as torch_dist
from torch import Tensor, nn

from refppo import checkpoint as ckpt
from refppo import models, ppo, rundir, train_dump, train_group
from refppo import rollout as rl
from refppo.atomic import atomic_write_text, atomic_write_with, pause_for_test
from refppo.config import ConfigError, TrainConfig
from refppo.errors import RefPPOError
from refppo.kl_controller import AdaptiveKLController, FixedKLController, make_kl_controller
from refppo.logging_utils import MetricsLog, Progress, TensorBoard, format_samples, plot_metrics, read_metrics
from refppo.reward_fn import RewardFunctionError, TextRewardFn, load_reward_function, text_reward
from refppo.reward_fn import resolve_reward_function as resolve_reward_function
from refppo.tasks.warmstart import sft, train_reward_model
from refppo.tasks.words import PROMPT_HEAD, WordsTask, build_tokenizer, rule_reward

ROLLOUT_KEYS = (
    "score",
    "raw_score",
    "kl",
    "non_score_reward",
    "response_length",
    "eos_frac",
    "old_entropy",
    "advantage_mean",
    "return_mean",
    "value_mean",
)
"""Keys of :func:`refppo.ppo.rollout_metrics` (logged as ``rollout/<key>``; the rest as ``ppo/<key>``)."""
SUMMED_OVER_RANKS = ("loss", "pg_loss", "vf_loss", "entropy", "kl_loss")
"""Update metrics that are per-rank shares of a global value (global normalisers): summed over ranks."""
RESUMABLE_KEYS = (
    "iterations",
    "out_dir",
    "progress",
    "plot",
    "tensorboard",
    "sample_every",
    "checkpoint_every",
    "dump_iteration",
)
"""``[run]`` keys that may change when resuming; any other config change is refused."""


EMBEDDED_POLICIES = ("tiny_gpt2", "tiny_llama")
"""``model.policy`` values built from a config (anything else is a local model directory)."""
RULE_REWARD = "refppo.tasks.words:rule_reward"
"""The embedded task's hidden rule as a text reward (``task.reward=rule``, and the logged ``rule_score``)."""
SMALL_MODEL_PARAMS = 50_000_000
"""Below this many policy parameters ``model.threads=0`` (auto) uses ONE intra-op thread on CPU
(measured in benchmarks/bench_train.py --threads; see :func:`set_threads`)."""


class TrainingError(RefPPOError):
    """A run that cannot go on correctly (bad model/tokenizer/prompt, non-finite loss, ...)."""


# ------------------------------------------------------------------------------------------ distributed


@dataclass(frozen=True)
class DistContext:
    """This process's place in a (torchrun) job; ``world_size == 1`` without torchrun."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0 writes logs, plots and weights."""
        return self.rank == 0

    def all_reduce(self) -> ppo.AllReduce | None:
        """SUM all-reduce hook for :func:`refppo.ppo.iteration` (None on one process): global loss
        normalisers in the update and global advantage-whitening moments (μ, σ² over every rank's
        rows, as verl), so a torchrun step equals one process on the concatenated batch."""
        if self.world_size == 1:
            return None

        def reduce(t: Tensor) -> Tensor:
            torch_dist.all_reduce(t)
            return t

        return reduce

    def barrier(self) -> None:
        """Wait for every rank (no-op on one process)."""
        if self.world_size > 1:
            torch_dist.barrier()


def init_distributed(device: str) -> DistContext:
    """Join the torchrun job described by ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (gloo on CPU,
    NCCL on CUDA); a plain process gets ``DistContext()``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not torch_dist.is_initialized():
        use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        torch_dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return DistContext(rank, world, local)


# ---------------------------------------------------------------------------------------------- helpers


def seed_everything(seed: int) -> None:
    """Seed python ``random``, numpy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_device(name: str, dist: DistContext) -> torch.device:
    """``auto``/``cpu``/``cuda``/``cuda:N`` → a device (under torchrun, ``cuda`` is the local rank's GPU)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise TrainingError(f"model.device={name!r} but CUDA is not available (use --device cpu)")
        if name == "cuda":
            name = f"cuda:{dist.local_rank}"
        torch.cuda.set_device(torch.device(name))
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` → bfloat16 on GPU, float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[name]


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MB (``getrusage``; KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def context_length(model: nn.Module) -> int | None:
    """The model's maximum sequence length from its config (None if unknown)."""
    cfg = getattr(model, "config", None)
    for attr in ("n_positions", "max_position_embeddings"):
        v = getattr(cfg, attr, None)
        if isinstance(v, int):
            return v
    return None


@contextlib.contextmanager
def _reward_errors_at(it: int) -> Iterator[None]:
    """Prefix a reward function's error with the iteration (1-based) it happened in."""
    try:
        yield
    except RewardFunctionError as e:
        raise RewardFunctionError(f"iteration {it + 1}: {e}") from e.__cause__


def _check_model_dir(flag: str, path: str) -> None:
    p = Path(path)
    if not p.is_dir():
        raise TrainingError(f"{flag} {path!r}: no such directory (a local model directory is required)")
    if not (p / "config.json").exists():
        raise TrainingError(f"{flag} {path!r}: no config.json (not a transformers model directory)")


@contextlib.contextmanager
def rank0_output(is_main: bool) -> Iterator[None]:
    """transformers' progress bars and info/warning logs silenced on every rank but 0 (under
    torchrun each rank loads the same model: one "Loading weights" bar is enough); errors still
    print. No-op on the main rank."""
    if is_main:
        yield
        return
    from transformers.utils import logging as hf_logging_module

    hf_logging: Any = hf_logging_module  # untyped module: its functions are called through Any

    bars, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def set_threads(requested: int, model: nn.Module, device: torch.device) -> int:
    """Apply ``model.threads`` (see its docstring) and return the intra-op thread count in use.

    ``requested > 0``: exactly that. ``0`` (auto): one thread on CPU for a policy below
    :data:`SMALL_MODEL_PARAMS` parameters, else torch's default; on GPU torch's default."""
    if requested > 0:
        torch.set_num_threads(requested)
    elif device.type == "cpu" and sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMS:
        torch.set_num_threads(1)
    return torch.get_num_threads()


def _finite(x: float) -> bool:
    return isinstance(x, float) and math.isfinite(x)


# ---------------------------------------------------------------------------------------------- trainer


class Trainer:
    """One training run of ``cfg`` (see the module docstring).

    ``resume``: continue the run in ``run.out_dir`` from its newest complete checkpoint (which must
    belong to that run: same run id and config hash, see :mod:`refppo.rundir`). ``resume_fallback``
    (with ``resume``): when that checkpoint is damaged, say so and try the previous complete one.
    ``overwrite`` (without ``resume``): a non-empty ``run.out_dir`` that is a refppo run is cleared
    (refppo's entries only) instead of refused."""

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        dist: DistContext | None = None,
        resume: bool = False,
        overwrite: bool = False,
        resume_fallback: bool = False,
        echo: Callable[[str], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.dist = dist or DistContext()
        cfg.check_world_size(self.dist.world_size)
        self.resume, self.overwrite, self.resume_fallback = resume, overwrite, resume_fallback
        if resume and overwrite:
            raise TrainingError("--resume continues the run in the out dir, --overwrite replaces it")
        if resume_fallback and not resume:
            raise TrainingError("--resume-fallback only applies with --resume")
        self.out_dir = Path(cfg.run.out_dir)
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise TrainingError(f"run.out_dir {str(self.out_dir)!r} exists and is not a directory")
        if not resume:
            rundir.check_fresh(self.out_dir, overwrite=overwrite)  # before any model loads
        self.config_hash = rundir.config_hash(cfg.to_dict(), RESUMABLE_KEYS)
        self.identity = rundir.new_identity(self.config_hash)  # --resume: replaced by run.json's
        self.ckpt_dir = self.out_dir / "checkpoints"
        self._echo = echo
        self.start_iteration = 0
        self.setup_info: dict[str, Any] = {}
        self._setup()

    # ------------------------------------------------------------------------------------------ setup
    def echo(self, text: str) -> None:
        """Print a line on the main rank."""
        if not self.dist.is_main:
            return
        if self._echo is not None:
            self._echo(text)
        else:
            print(text, flush=True)

    def _setup(self) -> None:
        cfg, d = self.cfg, self.dist
        embedded = cfg.model.policy in EMBEDDED_POLICIES
        self._check_inputs(embedded)  # cheap checks first: a typo costs no model loading
        user_reward: TextRewardFn | None = None
        if cfg.task.reward not in ("model", "rule"):
            user_reward = resolve_reward_function(cfg.task.reward)  # import + signature, before models
        seed_everything(cfg.run.seed)
        self.device = resolve_device(cfg.model.device, d)
        self.dtype = resolve_dtype(cfg.model.dtype, self.device)
        # bf16: fp32 master weights + autocast; float64 / float32: the weights themselves
        self.param_dtype = torch.float32 if self.dtype == torch.bfloat16 else self.dtype
        self.task = WordsTask(cfg.task.prompt_words, cfg.task.response_words)
        # per-rank prompt stream and sampling generator; setup-time RNG shared by every rank
        self.task_rng = random.Random(cfg.run.seed * 1_000_003 + d.rank)
        self.generator = torch.Generator().manual_seed(cfg.run.seed * 1_000_003 + d.rank)
        setup_rng = random.Random(cfg.run.seed)
        resuming = self.resume and ckpt.latest_checkpoint(self.ckpt_dir) is not None
        if self.resume and not resuming:
            raise TrainingError(f"--resume: no complete checkpoint under {str(self.ckpt_dir)!r}")

        if embedded:
            self.tokenizer = build_tokenizer()
            arch: models.Arch = "gpt2" if cfg.model.policy == "tiny_gpt2" else "llama"
            vocab = cfg.model.vocab_size or len(self.tokenizer)
            if vocab < len(self.tokenizer):
                raise ConfigError(
                    f"model.vocab_size={vocab} is smaller than the tokenizer ({len(self.tokenizer)})"
                )
            size = {
                "hidden": cfg.model.n_embd,
                "layers": cfg.model.n_layer,
                "heads": cfg.model.n_head,
                "max_positions": cfg.model.n_positions,
            }
            self.actor = models.tiny_actor(arch, vocab, seed=cfg.run.seed, **size)
        else:
            self.tokenizer, self.actor = self._load_local_policy(cfg.model.policy)
        if self.tokenizer.pad_token_id is None:
            raise TrainingError(
                f"the tokenizer of {cfg.model.policy!r} has no pad token; set one and save it, e.g. "
                "tok.pad_token = tok.eos_token; tok.save_pretrained(DIR)"
            )
        if self.tokenizer.eos_token_id is None:
            raise TrainingError(
                f"the tokenizer of {cfg.model.policy!r} has no EOS token; responses could never end"
            )
        self.actor.to(self.device, self.param_dtype)
        self.threads = set_threads(cfg.model.threads, self.actor, self.device)
        if embedded and (cfg.task.sft_steps or cfg.task.reward == "model"):
            longest = len(PROMPT_HEAD) + cfg.task.prompt_words[1] + cfg.task.response_words[1] + 1
            if longest > cfg.model.n_positions:
                raise TrainingError(
                    f"warm-start / reward-model samples reach {longest} tokens but model.n_positions="
                    f"{cfg.model.n_positions}; raise model.n_positions or lower "
                    "task.prompt_words/response_words"
                )
        if embedded and cfg.task.sft_steps and not resuming:
            losses = sft(
                self.actor,
                self.tokenizer,
                self.task,
                steps=cfg.task.sft_steps,
                batch_size=cfg.task.sft_batch_size,
                lr=cfg.task.sft_lr,
                rng=setup_rng,
                device=self.device,
            )
            self.setup_info["sft_loss_first_last"] = [losses[0], losses[-1]]
            self.echo(f"warm start: {len(losses)} SFT steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        self.reference = models.make_reference(self.actor)

        # reward
        keep = cfg.task.reward_special_tokens
        self.reward_model: models.RewardModel | None = None
        self.reward: models.Reward
        if cfg.task.reward == "model":
            if cfg.model.reward_model is not None:
                self.reward_model = self._load_local_reward(cfg.model.reward_model)
            elif embedded:
                vocab = int(self.actor.config.vocab_size)
                rm = models.tiny_reward_model(
                    arch,
                    vocab,
                    seed=cfg.run.seed + 2,
                    hidden=cfg.model.n_embd,
                    layers=cfg.model.n_layer,
                    heads=cfg.model.n_head,
                    max_positions=cfg.model.n_positions,
                )
                rm.to(self.device, self.param_dtype)
                if not resuming and cfg.task.rm_steps > 0:
                    stats = train_reward_model(
                        rm,
                        self.tokenizer,
                        self.task,
                        pairs=cfg.task.rm_pairs,
                        steps=cfg.task.rm_steps,
                        batch_size=cfg.task.rm_batch_size,
                        lr=cfg.task.rm_lr,
                        rng=setup_rng,
                        device=self.device,
                    )
                    self.setup_info["rm_heldout_accuracy"] = stats.heldout_accuracy
                    self.echo(
                        f"reward model: {cfg.task.rm_steps} steps, {cfg.task.rm_pairs} rule-labelled pairs, "
                        f"train acc {stats.train_accuracy:.3f}, held-out acc {stats.heldout_accuracy:.3f}"
                    )
                self.reward_model = rm
            else:
                raise ConfigError("task.reward='model' with --model DIR needs --reward-model DIR")
            self.reward_model.to(self.device, self.param_dtype)
            self.reward_model.eval()
            for p in self.reward_model.parameters():
                p.requires_grad_(False)
            self.reward = self.reward_model
        else:
            fn, name = (rule_reward, RULE_REWARD) if user_reward is None else (user_reward, cfg.task.reward)
            self.reward = text_reward(fn, self.tokenizer, keep_special_tokens=keep, name=name)
        # the hidden rule, logged alongside a learned reward (the embedded task's true objective)
        self.rule: models.RewardFn | None = None
        if embedded:
            self.rule = text_reward(rule_reward, self.tokenizer, keep_special_tokens=keep, name=RULE_REWARD)

        # critic (none for a critic-free ppo.advantage)
        self.critic: models.Critic | None = None if cfg.critic_free else self._build_critic()
        self.actor.train()

        # checks that need the models
        self.max_prompt_tokens = self._max_prompt_tokens()
        self.prompt_pool = self._read_prompts(cfg.task.prompts_file) if cfg.task.prompts_file else None

        # optimizers, KL controller
        o = cfg.optimizer
        self.actor_opt = torch.optim.AdamW(
            self.actor.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
        self.critic_opt: torch.optim.AdamW | None = None
        if self.critic is not None:
            self.critic_opt = torch.optim.AdamW(
                self.critic.parameters(),
                lr=o.critic_lr or o.lr,
                betas=o.betas,
                eps=o.eps,
                weight_decay=o.weight_decay,
            )
        self._setup_rest(resuming)

    def _build_critic(self) -> models.Critic:
        cfg = self.cfg
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.run.seed + 1)
            if cfg.model.critic_init == "reward":
                assert self.reward_model is not None  # checked by TrainConfig
                backbone = copy.deepcopy(self.reward_model.model.base_model)
            else:
                backbone = copy.deepcopy(self.actor.base_model)
            for p in backbone.parameters():
                p.requires_grad_(True)
            critic = models.Critic(backbone)
        critic.to(self.device, self.param_dtype)
        critic.train()
        return critic

    def _setup_rest(self, resuming: bool) -> None:
        cfg, d = self.cfg, self.dist
        self.kl_ctl: FixedKLController | AdaptiveKLController = make_kl_controller(
            cfg.ppo.hp.kl_coef, adaptive=cfg.kl.adaptive, target=cfg.kl.target, horizon=cfg.kl.horizon
        )
        self.rollout_cfg = rl.RolloutConfig(
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_k=cfg.rollout.top_k,
            top_p=cfg.rollout.top_p,
            eos_token_id=int(self.tokenizer.eos_token_id),
            pad_token_id=int(self.tokenizer.pad_token_id),
            missing_eos_penalty=cfg.rollout.missing_eos_penalty,
            use_cache=cfg.rollout.use_cache,
        )
        W = d.world_size
        self.update_cfg = ppo.PPOUpdateConfig(
            ppo_epochs=cfg.ppo.epochs,
            num_minibatches=cfg.ppo.minibatches,
            micro_batch_size=cfg.micro_batch_size(W),
            max_grad_norm=cfg.ppo.max_grad_norm,
        )

        # identical starting weights on every rank (DDP broadcasts the wrapped ones itself)
        if W > 1:
            for module in (self.reference, *([self.reward_model] if self.reward_model is not None else [])):
                for t in module.state_dict().values():
                    torch_dist.broadcast(t, src=0)

        if resuming:
            self._load()
        self.actor_train: nn.Module = self.actor
        self.critic_train: nn.Module | None = self.critic
        if W > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.actor_train = nn.parallel.DistributedDataParallel(self.actor, device_ids=ids)
            if self.critic is not None:
                self.critic_train = nn.parallel.DistributedDataParallel(self.critic, device_ids=ids)

    def _check_inputs(self, embedded: bool) -> None:
        """Checks that need no model, run before any model loads: the model directories exist, the
        prompts file exists, and a local policy comes with its own prompts."""
        cfg = self.cfg
        if not embedded:
            _check_model_dir("--model", cfg.model.policy)
        if cfg.task.reward == "model" and cfg.model.reward_model is not None:
            _check_model_dir("--reward-model", cfg.model.reward_model)
        pf = cfg.task.prompts_file
        if pf is not None and not Path(pf).is_file():
            raise TrainingError(f"task.prompts_file {pf!r} (--prompts): no such file")
        if not embedded and pf is None and not cfg.task.embedded_prompts:
            raise TrainingError(
                f"--model {cfg.model.policy!r} needs --prompts FILE (one prompt per line): without it the "
                "only prompts are the embedded task's synthetic 'review : ...' lines; pass "
                "--embedded-prompts (task.embedded_prompts=true) to train on those anyway"
            )

    def _load_local_policy(self, path: str) -> tuple[Any, nn.Module]:
        from transformers import AutoTokenizer

        with rank0_output(self.dist.is_main):
            try:
                tok = AutoTokenizer.from_pretrained(path)
            except Exception as e:  # transformers raises OSError/ValueError/...: report them all alike
                raise TrainingError(f"--model {path!r}: cannot load its tokenizer: {e}") from e
            try:
                actor = models.load_actor(path)
            except Exception as e:
                raise TrainingError(f"--model {path!r}: cannot load it as a causal LM: {e}") from e
        return tok, actor

    def _load_local_reward(self, path: str) -> models.RewardModel:
        with rank0_output(self.dist.is_main):
            try:
                return models.load_reward_model(path)
            except Exception as e:
                raise TrainingError(f"--reward-model {path!r}: cannot load it: {e}") from e

    def _read_prompts(self, path: str) -> list[str]:
        """The prompts of ``path`` (one per line, blank lines skipped), each checked against the
        context now, not mid-run; an error names the file and the line."""
        numbered = [
            (n, line.strip())
            for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1)
            if line.strip()
        ]
        if not numbered:
            raise TrainingError(f"task.prompts_file {path!r} holds no prompt")
        for n, text in numbered:
            self._check_prompt(self._tokenize(text), text, where=f"{path}:{n}: ")
        return [text for _, text in numbered]

    def _max_prompt_tokens(self) -> int:
        ctx = context_length(self.actor)
        T = self.cfg.rollout.max_new_tokens
        limit = self.cfg.rollout.max_prompt_tokens
        if ctx is not None:
            if ctx <= T:
                raise TrainingError(
                    f"rollout.max_new_tokens={T} leaves no room for a prompt in a context of {ctx}"
                )
            limit = min(limit, ctx - T) if limit else ctx - T
        return limit or 10**9

    # ----------------------------------------------------------------------------------------- prompts
    def _tokenize(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer(text, add_special_tokens=self.cfg.task.add_special_tokens)[
            "input_ids"
        ]
        return ids

    def _check_prompt(self, row: list[int], text: str, where: str = "") -> None:
        if len(row) == 0:
            raise TrainingError(f"{where}prompt {text!r} encodes to no tokens")
        if len(row) > self.max_prompt_tokens:
            shown = text if len(text) <= 80 else text[:80] + "…"
            raise TrainingError(
                f"{where}prompt of {len(row)} tokens is longer than the {self.max_prompt_tokens} allowed "
                f"(context − rollout.max_new_tokens, or rollout.max_prompt_tokens): {shown!r}"
            )

    def encode_prompts(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        """Token ids of ``texts`` (``task.add_special_tokens``: with the tokenizer's BOS etc.),
        checked against the context, left-padded: ``([B, P] ids, [B, P] mask)``."""
        ids = [self._tokenize(t) for t in texts]
        for t, row in zip(texts, ids, strict=True):
            self._check_prompt(row, t)
        pid, pmask = models.left_pad(ids, int(self.tokenizer.pad_token_id))
        return pid.to(self.device), pmask.to(self.device)

    # --------------------------------------------------------------------------------------- iteration
    def _autocast(self) -> Any:
        if self.dtype == torch.bfloat16:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return torch.autocast(device_type=self.device.type, enabled=False)

    def step(self, it: int) -> tuple[dict[str, Any], ppo.IterationResult, list[str]]:
        """One iteration (skeleton steps 1–5); returns the record, the raw result and the prompts."""
        cfg, d = self.cfg, self.dist
        g = cfg.rollout.group_size
        local = cfg.rollout.batch_size // d.world_size // g  # prompts on this rank
        if self.prompt_pool is not None:
            texts = [self.task_rng.choice(self.prompt_pool) for _ in range(local)]
        else:
            texts = self.task.prompts(local, self.task_rng)
        texts, group_index = train_group.expand_groups(texts, g, d.rank)
        if g > 1:  # groups of one are unique by construction; the PPO path gains no collective
            train_group.check_groups_on_rank(group_index, d.world_size, self.device)
        prompt_ids, prompt_mask = self.encode_prompts(texts)
        hp = replace(cfg.ppo.hp, kl_coef=self.kl_ctl.value)
        snapshot = self._snapshot() if cfg.run.on_nan == "skip" else None
        capture = train_dump.request(cfg, it, self.out_dir, hp)
        t0 = time.perf_counter()
        with self._autocast(), _reward_errors_at(it):
            batch = rl.generate_rollout(self.actor, prompt_ids, prompt_mask, self.rollout_cfg, self.generator)
            t1 = time.perf_counter()
            result = ppo.iteration(
                self.actor_train,
                self.reference,
                self.critic_train,
                self.reward,
                self.actor_opt,
                self.critic_opt,
                prompt_ids,
                prompt_mask,
                rollout_cfg=self.rollout_cfg,
                update_cfg=self.update_cfg,
                hp=hp,
                conv=cfg.ppo.convention,
                generator=self.generator,
                world_size=d.world_size,
                all_reduce=d.all_reduce(),
                batch=batch,
                capture=capture,
                group_index=group_index.to(self.device),
                groups_on_rank=True,
            )
        if capture is not None:
            self.echo(f"iteration {it + 1}: wrote {capture.path} (check it: refppo diff {capture.path})")
        t2 = time.perf_counter()
        metrics = self._reduce(result.metrics)
        if self.rule is not None:
            with _reward_errors_at(it):
                rule = [self.rule(*batch.unpadded(b)) for b in range(batch.batch_size)]
            metrics["rule_score"] = self._mean_over_ranks(sum(rule) / len(rule))
        record: dict[str, Any] = {"iteration": it + 1, "kl_coef": hp.kl_coef, "skipped": 0}
        for k, v in metrics.items():
            record[("rollout/" if k in ROLLOUT_KEYS or k == "rule_score" else "ppo/") + k] = v
        if cfg.rollout.missing_eos_penalty is not None:  # mean penalty per response (plotted on its own)
            record["rollout/missing_eos_penalty"] = metrics["raw_score"] - metrics["score"]
        bad = [k for k in ("loss", "pg_loss", "vf_loss") if not _finite(metrics.get(k, 0.0))]
        bad += [n for n, m in self._trained().items() if not _params_finite(m)]
        if bad:
            if snapshot is None:
                last = ckpt.latest_checkpoint(self.ckpt_dir)
                kept = (
                    f"the last checkpoint, {str(last)!r}, is intact" if last else "no checkpoint exists yet"
                )
                raise TrainingError(
                    f"iteration {it + 1}: non-finite {', '.join(bad)} (scores: mean {metrics['score']!r}); "
                    f"stopping — {kept}. Lower optimizer.lr, check the reward, "
                    "or set run.on_nan=skip to drop such updates"
                )
            self._restore(snapshot)
            record["skipped"] = 1
            self.echo(f"iteration {it + 1}: non-finite {', '.join(bad)}; update skipped, weights restored")
        else:
            self.kl_ctl.update(metrics["kl"], cfg.rollout.batch_size)
        n_tokens = float(batch.response_mask.sum()) * d.world_size
        record["time/rollout"] = t1 - t0
        record["time/score_update"] = t2 - t1
        record["time/iteration"] = t2 - t0
        record["time/response_tokens_per_s"] = n_tokens / max(t2 - t0, 1e-9)
        record["time/peak_rss_mb"] = peak_rss_mb()
        return record, result, texts

    def _reduce(self, metrics: dict[str, float]) -> dict[str, float]:
        if self.dist.world_size == 1:
            return dict(metrics)
        keys = sorted(metrics)
        t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.device)
        torch_dist.all_reduce(t)
        W = self.dist.world_size
        return {
            k: float(v) if k in SUMMED_OVER_RANKS else float(v) / W
            for k, v in zip(keys, t.tolist(), strict=True)
        }

    def _mean_over_ranks(self, x: float) -> float:
        if self.dist.world_size == 1:
            return x
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        torch_dist.all_reduce(t)
        return float(t) / self.dist.world_size

    def _trained(self) -> dict[str, nn.Module]:
        """The models the update changes: the actor, and the critic when there is one."""
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    def _optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """Checkpointed optimizers: the policy's, and the critic's when there is one."""
        return {
            "policy": self.actor_opt,
            **({"critic": self.critic_opt} if self.critic_opt is not None else {}),
        }

    def _snapshot(self) -> dict[str, Any]:
        out = {n: copy.deepcopy(m.state_dict()) for n, m in self._trained().items()}
        out.update({f"{n}_opt": copy.deepcopy(o.state_dict()) for n, o in self._optimizers().items()})
        return out

    def _restore(self, s: dict[str, Any]) -> None:
        for n, m in self._trained().items():
            m.load_state_dict(s[n])
        for n, o in self._optimizers().items():
            o.load_state_dict(s[f"{n}_opt"])

    # -------------------------------------------------------------------------------------- checkpoint
    def _models(self) -> dict[str, nn.Module]:
        out: dict[str, nn.Module] = {"policy": self.actor, "reference": self.reference}
        if self.critic is not None:
            out["critic"] = self.critic
        if self.reward_model is not None:
            out["reward"] = self.reward_model
        return out

    def save(self, iteration: int) -> Path:
        """Checkpoint after ``iteration`` completed iterations (call on every rank): every rank writes
        into a staging folder, then the main rank seals it and renames it into place (atomic)."""
        d = self.dist
        if d.is_main:
            ckpt.begin_checkpoint(self.ckpt_dir, iteration)
        d.barrier()
        staging = ckpt.save_checkpoint(
            self.ckpt_dir,
            iteration,
            models=self._models(),
            optimizers=self._optimizers(),
            rng=ckpt.rng_state(self.task_rng, self.generator),
            rank=d.rank,
            state={
                "kl_controller": self.kl_ctl.state_dict(),
                "config": self.cfg.to_dict(),
                "world_size": d.world_size,
                "run_id": self.identity.run_id,
                "config_hash": self.config_hash,
            },
            is_main=d.is_main,
        )
        d.barrier()
        path = ckpt.staging_dir(self.ckpt_dir, iteration).with_name(f"iter_{iteration:06d}")
        if d.is_main:
            pause_for_test(f"checkpoint:{iteration}")  # test-only: the kill tests stop here
            path = ckpt.mark_complete(staging)
        d.barrier()
        return path

    def _load(self) -> None:
        """Resume from the newest complete checkpoint; with ``resume_fallback``, a damaged one is
        skipped (and named) in favour of the previous one. A checkpoint of another run or config is
        never skipped: it is refused."""
        ident = rundir.read_identity(self.out_dir)
        if ident is None:
            raise TrainingError(
                f"--resume: {str(self.out_dir)!r} has no {rundir.RUN_FILE}, so its checkpoints cannot be "
                "shown to belong to one run (written by refppo before run identities?); start a fresh run"
            )
        self.identity = ident
        candidates = ckpt.complete_checkpoints(self.ckpt_dir)[::-1]
        for i, path in enumerate(candidates):
            try:
                c = self._load_one(path, ident)
            except ckpt.CheckpointError as e:
                more = i + 1 < len(candidates)
                if self.resume_fallback and more:
                    self.echo(f"--resume-fallback: skipped {path.name}: {e}")
                    continue
                hint = "; --resume-fallback resumes from the previous complete checkpoint" if more else ""
                raise ckpt.CheckpointError(f"--resume: {e}{hint}") from None
            self.start_iteration = c.iteration
            self.echo(f"resumed from {path} (iteration {c.iteration})")
            return

    def _load_one(self, path: Path, ident: rundir.RunIdentity) -> ckpt.Checkpoint:
        state = ckpt.read_state(path)
        self._check_resume_config(state, ident, path)
        c, rng = ckpt.load_checkpoint(
            path,
            models=self._models(),
            optimizers=self._optimizers(),
            rank=self.dist.rank,
        )
        try:
            self.kl_ctl.load_state_dict(c.state["kl_controller"])
        except (KeyError, TypeError, ValueError) as e:
            raise ckpt.CheckpointError(
                f"checkpoint {str(path)!r}: state.json has no valid 'kl_controller' ({e})"
            ) from None
        ckpt.set_rng_state(rng, self.task_rng, self.generator)
        return c

    def _check_resume_config(self, state: dict[str, Any], ident: rundir.RunIdentity, path: Path) -> None:
        """The checkpoint ``state`` belongs to this run (run id of ``run.json``), has this config
        (except :data:`RESUMABLE_KEYS`; also by hash) and this world size; else TrainingError."""
        problem = rundir.resume_mismatch(
            state, ident, self.cfg.to_dict(), self.config_hash, RESUMABLE_KEYS, path
        )
        if problem is not None:
            raise TrainingError(problem)
        saved_world = int(state.get("world_size", 1))
        if saved_world != self.dist.world_size:
            raise TrainingError(
                f"--resume: checkpoint was written by {saved_world} ranks, now {self.dist.world_size}"
            )

    # -------------------------------------------------------------------------------------------- loop
    def train(self) -> list[dict[str, Any]]:
        """Run to ``run.iterations``; returns every record of this run (main rank; others: [])."""
        cfg, d = self.cfg, self.dist
        if self.resume and self.start_iteration >= cfg.run.iterations:
            self.echo(
                f"nothing to do: the checkpoint is at iteration {self.start_iteration} and "
                f"run.iterations={cfg.run.iterations} (raise --iterations to train further)"
            )
            return []
        if d.is_main:
            self._prepare_out_dir()
        log = MetricsLog(
            self.out_dir / "metrics.jsonl",
            resume_from=self.start_iteration if self.resume else None,
            enabled=d.is_main,
        )
        for note in log.notes:
            self.echo(f"metrics.jsonl: {note}")
        tb = TensorBoard(self.out_dir / "tensorboard", enabled=cfg.run.tensorboard and d.is_main)
        bar = Progress(cfg.run.iterations, self.start_iteration, enabled=d.is_main, bar=cfg.run.progress)
        records: list[dict[str, Any]] = []
        last_saved = self.start_iteration
        try:
            for it in range(self.start_iteration, cfg.run.iterations):
                record, result, texts = self.step(it)
                records.append(record)
                log.write(record)
                tb.write(record, it + 1)
                bar.update(record)
                n = it + 1
                if d.is_main and cfg.run.sample_every and (n % cfg.run.sample_every == 0 or n == 1):
                    b = result.scored.batch
                    responses = [self.tokenizer.decode(b.unpadded(i)[1]) for i in range(min(3, b.batch_size))]
                    bar.write(format_samples(n, texts, responses, result.scored.scores.tolist()))
                if cfg.run.checkpoint_every and n % cfg.run.checkpoint_every == 0:
                    self.save(n)
                    last_saved = n
            if cfg.run.iterations > last_saved or not (self.ckpt_dir / f"iter_{last_saved:06d}").exists():
                self.save(cfg.run.iterations)
        finally:
            bar.close()
            tb.close()
        if d.is_main and cfg.run.plot:
            all_records = read_metrics(self.out_dir / "metrics.jsonl")
            if all_records:
                path = self.out_dir / "plot.png"
                atomic_write_with(path, lambda tmp: plot_metrics(all_records, tmp), suffix=".png")
                self.echo(f"plot: {path}")
        return records

    def _prepare_out_dir(self) -> None:
        """Main rank, before the first iteration: a fresh run clears the out dir (``overwrite``,
        refppo's entries only) and writes ``run.json``; every run writes ``config.json`` (atomically)."""
        if not self.resume:
            if self.overwrite:
                kept = rundir.clear_run(self.out_dir)
                if kept:
                    self.echo(f"--overwrite: kept {len(kept)} entries not refppo's: {', '.join(kept)}")
            self.out_dir.mkdir(parents=True, exist_ok=True)
            rundir.write_identity(self.out_dir, self.identity)
        atomic_write_text(self.out_dir / "config.json", self.cfg.to_json() + "\n")


def _params_finite(m: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in m.parameters())


def shutdown_distributed(d: DistContext) -> None:
    """Leave the torchrun job after this rank finished training (no-op on one process).

    ``barrier()`` first, so no rank closes its gloo/NCCL connections while a peer is still in a
    collective or writing its checkpoint/plot; then ``destroy_process_group()``. Called on
    success only (as torchtitan's ``train.py`` main, pytorch/torchtitan#1342): after an error
    the other ranks may be blocked in a collective this rank will never join, so a barrier or a
    destroy could hang until the backend timeout; the error propagates and torchrun stops them."""
    if d.world_size > 1 and torch_dist.is_initialized():
        torch_dist.barrier()
        torch_dist.destroy_process_group()


def run(
    cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, resume_fallback: bool = False
) -> list[dict[str, Any]]:
    """Build a :class:`Trainer` (joining a torchrun job if there is one), train, and leave the job
    cleanly (:func:`shutdown_distributed`). The flags: see :class:`Trainer`."""
    d = init_distributed(cfg.model.device)
    trainer = Trainer(cfg, dist=d, resume=resume, overwrite=overwrite, resume_fallback=resume_fallback)
    records = trainer.train()
    shutdown_distributed(d)
    return records


__all__ = [
    "DistContext",
    "Trainer",
    "TrainingError",
    "init_distributed",
    "load_reward_function",
    "run",
    "shutdown_distributed",
    "text_reward",
]
