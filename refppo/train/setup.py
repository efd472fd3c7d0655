"""Setup of a run (skeleton step 0 of :mod:`refppo.train.loop`): the models, the reward, the
optimizers and the per-iteration configs, built from a :class:`refppo.train.config.schema.TrainConfig`.

In the order :meth:`refppo.train.loop.Trainer` calls them (the order fixes every RNG draw)::

    check_inputs         model-free checks first (directories, prompts file): a typo loads nothing
    build_policy         tokenizer + policy: tiny from the config (embedded task) or --model DIR
    warm_start           SFT on task samples (embedded task, unless resuming)
    build_reward         a reward model (given, or tiny and trained on rule-labelled pairs),
                         the hidden rule, or a module:function; build_rule: the logged rule_score
    build_critic         policy (or reward-model) backbone + fresh value head; none when critic-free
    make_optimizers      AdamW for the policy (and the critic)
    rollout_config / update_config, broadcast_frozen, wrap_ddp   (torchrun: same weights everywhere)
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn

from refppo.models import rollout as rl
from refppo.models.loading import load_actor, load_reward_model
from refppo.models.roles import Critic, Reward, RewardFn, RewardModel
from refppo.models.tiny import Arch, tiny_actor, tiny_reward_model
from refppo.train.config.schema import TrainConfig
from refppo.train.config.sections import ConfigError
from refppo.train.reward_fn import TextRewardFn, text_reward
from refppo.train.runtime import TrainingError, rank0_output
from refppo.train.tasks.warmstart import sft, train_reward_model
from refppo.train.tasks.words import PROMPT_HEAD, WordsTask, build_tokenizer, rule_reward
from refppo.train.update_config import PPOUpdateConfig

EMBEDDED_POLICIES = ("tiny_gpt2", "tiny_llama")
"""``model.policy`` values built from a config (anything else is a local model directory)."""
RULE_REWARD = "refppo.train.tasks.words:rule_reward"
"""The embedded task's hidden rule as a text reward (``task.reward=rule``, and the logged ``rule_score``)."""


@dataclass
class SetupContext:
    """What every setup step reads: the config, where the models go, and the setup-time RNG."""

    cfg: TrainConfig
    device: torch.device
    param_dtype: torch.dtype
    """fp32 master weights under bf16 autocast; float64 / float32: the weights themselves."""
    is_main: bool
    resuming: bool
    """A checkpoint will be loaded: no warm start, no reward-model training."""
    rng: random.Random
    """Setup-time RNG shared by every rank (warm start, reward-model pairs)."""
    echo: Callable[[str], None]
    info: dict[str, Any] = field(default_factory=dict)
    """Setup results worth reporting (``Trainer.setup_info``)."""

    @property
    def embedded(self) -> bool:
        """The policy is a tiny model built from the config (the embedded task)."""
        return self.cfg.model.policy in EMBEDDED_POLICIES


def check_model_dir(flag: str, path: str) -> None:
    """``path`` is a local transformers model directory, else one TrainingError naming ``flag``."""
    p = Path(path)
    if not p.is_dir():
        raise TrainingError(f"{flag} {path!r}: no such directory (a local model directory is required)")
    if not (p / "config.json").exists():
        raise TrainingError(f"{flag} {path!r}: no config.json (not a transformers model directory)")


def check_inputs(cfg: TrainConfig) -> None:
    """Checks that need no model, run before any model loads: the model directories exist, the
    prompts file exists, and a local policy comes with its own prompts."""
    embedded = cfg.model.policy in EMBEDDED_POLICIES
    if not embedded:
        check_model_dir("--model", cfg.model.policy)
    if cfg.task.reward == "model" and cfg.model.reward_model is not None:
        check_model_dir("--reward-model", cfg.model.reward_model)
    pf = cfg.task.prompts_file
    if pf is not None and not Path(pf).is_file():
        raise TrainingError(f"task.prompts_file {pf!r} (--prompts): no such file")
    if not embedded and pf is None and not cfg.task.embedded_prompts:
        raise TrainingError(
            f"--model {cfg.model.policy!r} needs --prompts FILE (one prompt per line): without it the "
            "only prompts are the embedded task's synthetic 'review : ...' lines; pass "
            "--embedded-prompts (task.embedded_prompts=true) to train on those anyway"
        )


def _embedded_arch(cfg: TrainConfig) -> Arch:
    return "gpt2" if cfg.model.policy == "tiny_gpt2" else "llama"


def _tiny_sizes(cfg: TrainConfig) -> dict[str, int]:
    m = cfg.model
    return {"hidden": m.n_embd, "layers": m.n_layer, "heads": m.n_head, "max_positions": m.n_positions}


def load_local_policy(path: str, is_main: bool) -> tuple[Any, nn.Module]:
    """Tokenizer and causal LM of the local directory ``path`` (``--model DIR``)."""
    from transformers import AutoTokenizer

    with rank0_output(is_main):
        try:
            tok = AutoTokenizer.from_pretrained(path)
        except Exception as e:  # transformers raises OSError/ValueError/...: report them all alike
            raise TrainingError(f"--model {path!r}: cannot load its tokenizer: {e}") from e
        try:
            actor = load_actor(path)
        except Exception as e:
            raise TrainingError(f"--model {path!r}: cannot load it as a causal LM: {e}") from e
    return tok, actor


def load_local_reward(path: str, is_main: bool) -> RewardModel:
    """The sequence-classification reward model of the local directory ``path``."""
    with rank0_output(is_main):
        try:
            return load_reward_model(path)
        except Exception as e:
            raise TrainingError(f"--reward-model {path!r}: cannot load it: {e}") from e


def build_policy(ctx: SetupContext) -> tuple[Any, nn.Module]:
    """``(tokenizer, policy)``: the embedded tokenizer and a tiny model seeded by ``run.seed``, or
    those of ``--model DIR``; the tokenizer must have a pad and an EOS token. On the CPU until
    the caller moves it."""
    cfg = ctx.cfg
    if ctx.embedded:
        tokenizer = build_tokenizer()
        vocab = cfg.model.vocab_size or len(tokenizer)
        if vocab < len(tokenizer):
            raise ConfigError(f"model.vocab_size={vocab} is smaller than the tokenizer ({len(tokenizer)})")
        actor = tiny_actor(_embedded_arch(cfg), vocab, seed=cfg.run.seed, **_tiny_sizes(cfg))
    else:
        tokenizer, actor = load_local_policy(cfg.model.policy, ctx.is_main)
    if tokenizer.pad_token_id is None:
        raise TrainingError(
            f"the tokenizer of {cfg.model.policy!r} has no pad token; set one and save it, e.g. "
            "tok.pad_token = tok.eos_token; tok.save_pretrained(DIR)"
        )
    if tokenizer.eos_token_id is None:
        raise TrainingError(
            f"the tokenizer of {cfg.model.policy!r} has no EOS token; responses could never end"
        )
    return tokenizer, actor


def warm_start(ctx: SetupContext, actor: nn.Module, tokenizer: Any, task: WordsTask) -> None:
    """Embedded task: the warm-start and reward-model samples fit the context; then ``task.sft_steps``
    supervised steps on task samples (skipped when resuming). Nothing for a local policy."""
    cfg = ctx.cfg
    if not ctx.embedded:
        return
    if cfg.task.sft_steps or cfg.task.reward == "model":
        longest = len(PROMPT_HEAD) + cfg.task.prompt_words[1] + cfg.task.response_words[1] + 1
        if longest > cfg.model.n_positions:
            raise TrainingError(
                f"warm-start / reward-model samples reach {longest} tokens but model.n_positions="
                f"{cfg.model.n_positions}; raise model.n_positions or lower "
                "task.prompt_words/response_words"
            )
    if cfg.task.sft_steps and not ctx.resuming:
        losses = sft(
            actor,
            tokenizer,
            task,
            steps=cfg.task.sft_steps,
            batch_size=cfg.task.sft_batch_size,
            lr=cfg.task.sft_lr,
            rng=ctx.rng,
            device=ctx.device,
        )
        ctx.info["sft_loss_first_last"] = [losses[0], losses[-1]]
        ctx.echo(f"warm start: {len(losses)} SFT steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")


def _tiny_reward_model(ctx: SetupContext, vocab: int, tokenizer: Any, task: WordsTask) -> RewardModel:
    """The embedded task's reward model: tiny (seed ``run.seed + 2``), trained with the
    Bradley–Terry loss on ``task.rm_pairs`` rule-labelled pairs (not when resuming)."""
    cfg = ctx.cfg
    rm = tiny_reward_model(_embedded_arch(cfg), vocab, seed=cfg.run.seed + 2, **_tiny_sizes(cfg))
    rm.to(ctx.device, ctx.param_dtype)
    if not ctx.resuming and cfg.task.rm_steps > 0:
        stats = train_reward_model(
            rm,
            tokenizer,
            task,
            pairs=cfg.task.rm_pairs,
            steps=cfg.task.rm_steps,
            batch_size=cfg.task.rm_batch_size,
            lr=cfg.task.rm_lr,
            rng=ctx.rng,
            device=ctx.device,
        )
        ctx.info["rm_heldout_accuracy"] = stats.heldout_accuracy
        ctx.echo(
            f"reward model: {cfg.task.rm_steps} steps, {cfg.task.rm_pairs} rule-labelled pairs, "
            f"train acc {stats.train_accuracy:.3f}, held-out acc {stats.heldout_accuracy:.3f}"
        )
    return rm


def build_reward(
    ctx: SetupContext, actor: Any, tokenizer: Any, task: WordsTask, user_reward: TextRewardFn | None
) -> tuple[RewardModel | None, Reward]:
    """``(reward model or None, reward)`` for ``task.reward``: ``model`` (``--reward-model DIR``, or
    the embedded task's tiny trained one; frozen, eval mode), ``rule`` (the hidden rule) or the
    resolved ``module:function`` ``user_reward``, as a text reward. ``actor``: the policy (a
    transformers model; the tiny reward model takes its vocabulary size)."""
    cfg = ctx.cfg
    if cfg.task.reward != "model":
        fn, name = (rule_reward, RULE_REWARD) if user_reward is None else (user_reward, cfg.task.reward)
        keep = cfg.task.reward_special_tokens
        return None, text_reward(fn, tokenizer, keep_special_tokens=keep, name=name)
    if cfg.model.reward_model is not None:
        reward_model = load_local_reward(cfg.model.reward_model, ctx.is_main)
    elif ctx.embedded:
        vocab = int(actor.config.vocab_size)
        reward_model = _tiny_reward_model(ctx, vocab, tokenizer, task)
    else:
        raise ConfigError("task.reward='model' with --model DIR needs --reward-model DIR")
    reward_model.to(ctx.device, ctx.param_dtype)
    reward_model.eval()
    for p in reward_model.parameters():
        p.requires_grad_(False)
    return reward_model, reward_model


def build_rule(ctx: SetupContext, tokenizer: Any) -> RewardFn | None:
    """The hidden rule, logged alongside a learned reward (the embedded task's true objective);
    None for a local policy."""
    if not ctx.embedded:
        return None
    keep = ctx.cfg.task.reward_special_tokens
    return text_reward(rule_reward, tokenizer, keep_special_tokens=keep, name=RULE_REWARD)


def build_critic(ctx: SetupContext, actor: Any, reward_model: RewardModel | None) -> Critic | None:
    """The critic: a copy of the policy's backbone (``model.critic_init=reward``: the reward
    model's) with a fresh value head seeded by ``run.seed + 1`` (the global RNG is left as it was);
    None when ``ppo.advantage`` is critic-free."""
    cfg = ctx.cfg
    if cfg.critic_free:
        return None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.run.seed + 1)
        if cfg.model.critic_init == "reward":
            assert reward_model is not None  # checked by TrainConfig
            backbone = copy.deepcopy(reward_model.model.base_model)
        else:
            backbone = copy.deepcopy(actor.base_model)
        for p in backbone.parameters():
            p.requires_grad_(True)
        critic = Critic(backbone)
    critic.to(ctx.device, ctx.param_dtype)
    critic.train()
    return critic


def make_optimizers(
    cfg: TrainConfig, actor: nn.Module, critic: nn.Module | None
) -> tuple[torch.optim.AdamW, torch.optim.AdamW | None]:
    """AdamW for the policy, and for the critic (``optimizer.critic_lr`` or ``lr``) when there is one."""
    o = cfg.optimizer
    actor_opt = torch.optim.AdamW(
        actor.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
    )
    critic_opt: torch.optim.AdamW | None = None
    if critic is not None:
        critic_opt = torch.optim.AdamW(
            critic.parameters(), lr=o.critic_lr or o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
    return actor_opt, critic_opt


def rollout_config(cfg: TrainConfig, tokenizer: Any) -> rl.RolloutConfig:
    """The sampler's settings (``[rollout]`` plus the tokenizer's EOS and pad ids)."""
    return rl.RolloutConfig(
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_k=cfg.rollout.top_k,
        top_p=cfg.rollout.top_p,
        eos_token_id=int(tokenizer.eos_token_id),
        pad_token_id=int(tokenizer.pad_token_id),
        missing_eos_penalty=cfg.rollout.missing_eos_penalty,
        use_cache=cfg.rollout.use_cache,
    )


def update_config(cfg: TrainConfig, world_size: int) -> PPOUpdateConfig:
    """The update schedule on one rank: epochs, minibatches, micro-batch size, grad clip."""
    return PPOUpdateConfig(
        ppo_epochs=cfg.ppo.epochs,
        num_minibatches=cfg.ppo.minibatches,
        micro_batch_size=cfg.micro_batch_size(world_size),
        max_grad_norm=cfg.ppo.max_grad_norm,
    )


def broadcast_frozen(*frozen: nn.Module | None) -> None:
    """Rank 0's weights of the frozen models (reference, reward model) on every rank (collective;
    DDP broadcasts the trained ones itself)."""
    for module in frozen:
        if module is None:
            continue
        for t in module.state_dict().values():
            torch_dist.broadcast(t, src=0)


def wrap_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` in DistributedDataParallel (on its GPU under CUDA)."""
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


__all__ = [
    "EMBEDDED_POLICIES",
    "RULE_REWARD",
    "SetupContext",
    "broadcast_frozen",
    "build_critic",
    "build_policy",
    "build_reward",
    "build_rule",
    "check_inputs",
    "check_model_dir",
    "load_local_policy",
    "load_local_reward",
    "make_optimizers",
    "rollout_config",
    "update_config",
    "warm_start",
]
