"""The trainer: models, data, logging and checkpoints around ONE per-iteration algorithm.

Each iteration is :func:`refppo.models.rollout.generate_rollout` followed by
:func:`refppo.train.iteration.iteration`
(scoring → :func:`refppo.pipeline.step.rollout_quantities` → :func:`refppo.train.update.ppo_update`) —
the same
functions the golden trajectories and the oracle check; this package adds no PPO math of its own.
(``generate_rollout`` is called here, through :func:`refppo.train.seam.sample`, and its batch handed
to ``iteration(batch=...)``, which is exactly what ``iteration`` does itself when no batch is
given; it lets the trainer time the rollout separately.)

Numbered skeleton of :meth:`Trainer.train` (where each step lives in :mod:`refppo.train`)::

    0. setup (setup.py): seed every RNG; tokenizer; policy (tiny from config, or --model DIR);
       warm start (embedded task); reference = frozen copy; reward (model trained on
       rule-labelled pairs, --reward-model DIR, the rule, or module:function); critic (none when
       ppo.advantage is critic-free); AdamW ×2 (×1 without critic); KL controller;
       DDP wrap (torchrun); --resume restores weights, optimizers, RNGs, controller, iteration
       (checkpointing.py)
    per iteration:
    1. prompts from the task's RNG, each repeated rollout.group_size times with its group_index
       (whole groups per rank: group.py) → token ids (length checked) → left-padded batch (prompts.py)
    2. responses = generate_rollout(actor, prompts)                    (timed: rollout)
       (seam mode: the rollout engine's, with its log-probs: seam.py; seam.sample either way)
    3. result = iteration(..., hp with β from the KL controller, the score map in ppo.convention)
       (timed: score + update; under torchrun with the all_reduce hook: global normalisers and
       whitening; dump.py)
    4. metrics reduced over ranks (dist.py); non-finite loss → error (or skip + restore, run.on_nan)
    5. β ← controller.update(KL, global batch)
    6. log: JSONL, tqdm, TensorBoard, sample generations (report.py); checkpoint (checkpointing.py)
    end: plot.png, final checkpoint
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from refppo.models.batch import SequenceBatch
from refppo.models.roles import make_reference
from refppo.pipeline.settings import Hyperparams
from refppo.train import checkpoint as ckpt
from refppo.train import checkpointing, dump, prompts, report, rundir, setup
from refppo.train.config.schema import TrainConfig
from refppo.train.config.sections import ConfigError
from refppo.train.dist import (
    DistContext,
    init_distributed,
    mean_over_ranks,
    reduce_metrics,
    shutdown_distributed,
)
from refppo.train.iteration import IterationResult, iteration
from refppo.train.kl_controller import AdaptiveKLController, FixedKLController, make_kl_controller
from refppo.train.reward_fn import TextRewardFn, resolve_reward_function
from refppo.train.runlog import MetricsLog, Progress, TensorBoard, kl_label
from refppo.train.runtime import (
    TrainingError,
    resolve_device,
    resolve_dtype,
    reward_errors_at,
    seed_everything,
    set_threads,
)
from refppo.train.seam import RolloutEngine, sample
from refppo.train.tasks.words import WordsTask
from refppo.train.update_config import Behaviour, CaptureRequest


class Trainer:
    """One training run of ``cfg`` (see the module docstring).

    ``resume``: continue the run in ``run.out_dir`` from its newest complete checkpoint (which must
    belong to that run: same run id and config hash, see :mod:`refppo.train.rundir`). ``resume_fallback``
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
        unread = cfg.unread_options()
        if unread is not None and not resume:
            raise ConfigError(unread)
        self.out_dir = Path(cfg.run.out_dir)
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise TrainingError(f"run.out_dir {str(self.out_dir)!r} exists and is not a directory")
        if not resume:
            rundir.check_fresh(self.out_dir, overwrite=overwrite)  # before any model loads
        self.config_hash = rundir.config_hash(cfg.to_dict(), checkpointing.RESUMABLE_KEYS)
        self.config_absent: tuple[str, ...] = ()  # --resume of an older refppo's run: keys it lacked
        self.identity = rundir.new_identity(self.config_hash)  # --resume: replaced by run.json's
        self.ckpt_dir = self.out_dir / "checkpoints"
        self._echo = echo
        if unread is not None:  # --resume of a run that an older refppo started with it: no effect
            self.echo(f"warning: {unread}; resuming as the run began (it has no effect)")
        self.start_iteration = 0
        self.setup_info: dict[str, Any] = {}
        self._setup()

    def echo(self, text: str) -> None:
        """Print a line on the main rank."""
        if not self.dist.is_main:
            return
        if self._echo is not None:
            self._echo(text)
        else:
            print(text, flush=True)

    # ------------------------------------------------------------------------------------------ setup
    def _setup(self) -> None:
        """Skeleton step 0 (:mod:`refppo.train.setup`), in an order that fixes every RNG draw."""
        cfg = self.cfg
        setup.check_inputs(cfg)  # cheap checks first: a typo costs no model loading
        user_reward: TextRewardFn | None = None
        if cfg.task.reward not in ("model", "rule"):
            user_reward = resolve_reward_function(cfg.task.reward)  # import + signature, before models
        resuming = self._setup_process()
        self._setup_models(resuming, user_reward)
        self._setup_rest(resuming)

    def _setup_process(self) -> bool:
        """Seeds, device, dtype, the task and this rank's RNGs; returns whether a checkpoint will
        be resumed."""
        cfg, d = self.cfg, self.dist
        seed_everything(cfg.run.seed)
        self.device = resolve_device(cfg.model.device, d)
        self.dtype = resolve_dtype(cfg.model.dtype, self.device)
        # bf16: fp32 master weights + autocast; float64 / float32: the weights themselves
        self.param_dtype = torch.float32 if self.dtype == torch.bfloat16 else self.dtype
        self.task = WordsTask(cfg.task.prompt_words, cfg.task.response_words)
        # per-rank prompt stream and sampling generator
        self.task_rng = random.Random(cfg.run.seed * 1_000_003 + d.rank)
        self.generator = torch.Generator().manual_seed(cfg.run.seed * 1_000_003 + d.rank)
        resuming = self.resume and ckpt.latest_checkpoint(self.ckpt_dir) is not None
        if self.resume and not resuming:
            raise TrainingError(f"--resume: no complete checkpoint under {str(self.ckpt_dir)!r}")
        return resuming

    def _setup_models(self, resuming: bool, user_reward: TextRewardFn | None) -> None:
        """Tokenizer, policy (warm-started), reference, reward, critic, prompts, optimizers."""
        cfg = self.cfg
        ctx = setup.SetupContext(
            cfg,
            self.device,
            self.param_dtype,
            is_main=self.dist.is_main,
            resuming=resuming,
            rng=random.Random(cfg.run.seed),  # setup-time RNG shared by every rank
            echo=self.echo,
            info=self.setup_info,
        )
        self.tokenizer, self.actor = setup.build_policy(ctx)
        self.actor.to(self.device, self.param_dtype)
        self.threads = set_threads(cfg.model.threads, self.actor, self.device)
        setup.warm_start(ctx, self.actor, self.tokenizer, self.task)
        self.reference = make_reference(self.actor)
        self.reward_model, self.reward = setup.build_reward(
            ctx, self.actor, self.tokenizer, self.task, user_reward
        )
        # the hidden rule, logged alongside a learned reward (the embedded task's true objective)
        self.rule = setup.build_rule(ctx, self.tokenizer)
        # none for a critic-free ppo.advantage
        self.critic = setup.build_critic(ctx, self.actor, self.reward_model)
        self.actor.train()
        # checks that need the models
        limit = prompts.max_prompt_tokens(
            self.actor, cfg.rollout.max_new_tokens, cfg.rollout.max_prompt_tokens
        )
        self.prompt_encoder = prompts.PromptEncoder(
            self.tokenizer,
            add_special_tokens=cfg.task.add_special_tokens,
            max_tokens=limit,
            device=self.device,
        )
        pool = cfg.task.prompts_file
        self.prompt_pool = self.prompt_encoder.read_file(pool) if pool else None
        self.actor_opt, self.critic_opt = setup.make_optimizers(cfg, self.actor, self.critic)

    def _setup_rest(self, resuming: bool) -> None:
        cfg, d = self.cfg, self.dist
        self.kl_ctl: FixedKLController | AdaptiveKLController = make_kl_controller(
            cfg.ppo.hp.kl_coef, adaptive=cfg.kl.adaptive, target=cfg.kl.target, horizon=cfg.kl.horizon
        )
        self.rollout_cfg = setup.rollout_config(cfg, self.tokenizer)
        self.update_cfg = setup.update_config(cfg, d.world_size)
        self.seam = RolloutEngine(cfg.seam, self.actor) if cfg.seam.enabled else None  # spec/trainer.md
        if d.world_size > 1:  # identical starting weights on every rank
            setup.broadcast_frozen(self.reference, self.reward_model)
        if resuming:
            checkpointing.resume(self)
        self.actor_train: nn.Module = self.actor
        self.critic_train: nn.Module | None = self.critic
        if d.world_size > 1:
            self.actor_train = setup.wrap_ddp(self.actor, self.device)
            if self.critic is not None:
                self.critic_train = setup.wrap_ddp(self.critic, self.device)

    def encode_prompts(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        """Token ids of ``texts`` (``task.add_special_tokens``: with the tokenizer's BOS etc.),
        checked against the context, left-padded: ``([B, P] ids, [B, P] mask)``."""
        return self.prompt_encoder.encode(texts)

    # --------------------------------------------------------------------------------------- iteration
    def _autocast(self) -> Any:
        if self.dtype == torch.bfloat16:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return torch.autocast(device_type=self.device.type, enabled=False)

    def step(self, it: int) -> tuple[dict[str, Any], IterationResult, list[str]]:
        """One iteration (skeleton steps 1–5); returns the record, the raw result and the prompts."""
        cfg, d = self.cfg, self.dist
        texts, group_index = prompts.draw(cfg, self.task, self.task_rng, self.prompt_pool, d, self.device)
        prompt_ids, prompt_mask = self.encode_prompts(texts)
        hp = replace(cfg.ppo.hp, kl_coef=self.kl_ctl.value)
        snapshot = checkpointing.snapshot(self) if cfg.run.on_nan == "skip" else None
        capture = dump.request(cfg, it, self.out_dir, hp)
        t0 = time.perf_counter()
        with self._autocast(), reward_errors_at(it):
            batch, behaviour = sample(
                self.seam, self.actor, prompt_ids, prompt_mask, self.rollout_cfg, self.generator, it
            )
            t1 = time.perf_counter()
            result = self._score_and_update(
                batch, prompt_ids, prompt_mask, hp, capture, group_index, behaviour
            )
        if capture is not None:
            self.echo(f"iteration {it + 1}: wrote {capture.path} (check it: refppo diff {capture.path})")
        t2 = time.perf_counter()
        metrics = self._metrics(it, result, batch)
        eos = cfg.rollout.missing_eos_penalty is not None
        record = report.make_record(it, hp.kl_coef, metrics, eos, critic=self.critic is not None)
        bad = report.non_finite(metrics, checkpointing.trained(self))
        if bad:
            if snapshot is None:
                raise report.non_finite_error(it, bad, metrics, ckpt.latest_checkpoint(self.ckpt_dir))
            checkpointing.restore(self, snapshot)
            record["skipped"] = 1
            self.echo(f"iteration {it + 1}: non-finite {', '.join(bad)}; update skipped, weights restored")
        else:
            self.kl_ctl.update(metrics["kl"], cfg.rollout.batch_size)
        report.add_timing(record, t0, t1, t2, float(batch.response_mask.sum()) * d.world_size)
        return record, result, texts

    def _score_and_update(
        self,
        batch: SequenceBatch,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        hp: Hyperparams,
        capture: CaptureRequest | None,
        group_index: Tensor,
        behaviour: Behaviour | None = None,
    ) -> IterationResult:
        """Skeleton step 3 on the sampled ``batch``: :func:`refppo.train.iteration.iteration`."""
        d = self.dist
        return iteration(
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
            conv=self.cfg.ppo.convention,
            generator=self.generator,
            world_size=d.world_size,
            all_reduce=d.all_reduce(),
            batch=batch,
            capture=capture,
            group_index=group_index.to(self.device),
            groups_on_rank=True,
            behaviour=behaviour,
        )

    def _metrics(self, it: int, result: IterationResult, batch: SequenceBatch) -> dict[str, float]:
        """The iteration's metrics over every rank, with the hidden rule's mean score when logged."""
        metrics = reduce_metrics(self.dist, result.metrics, self.device)
        if self.rule is not None:
            with reward_errors_at(it):
                rule = [self.rule(*batch.unpadded(b)) for b in range(batch.batch_size)]
            metrics["rule_score"] = mean_over_ranks(self.dist, sum(rule) / len(rule), self.device)
        return metrics

    def save(self, iteration: int) -> Path:
        """Checkpoint after ``iteration`` completed iterations (call on every rank):
        :func:`refppo.train.checkpointing.save`."""
        return checkpointing.save(self, iteration)

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
            report.prepare_out_dir(
                self.out_dir, cfg, self.identity, resume=self.resume, overwrite=self.overwrite, echo=self.echo
            )
        log = MetricsLog(
            self.out_dir / "metrics.jsonl",
            resume_from=self.start_iteration if self.resume else None,
            enabled=d.is_main,
        )
        for note in log.notes:
            self.echo(f"metrics.jsonl: {note}")
        tb = TensorBoard(self.out_dir / "tensorboard", enabled=cfg.run.tensorboard and d.is_main)
        est = cfg.ppo.convention.kl.estimator.value
        bar = Progress(
            cfg.run.iterations,
            self.start_iteration,
            enabled=d.is_main,
            bar=cfg.run.progress,
            kl_label=kl_label(est),
        )
        records: list[dict[str, Any]] = []
        try:
            self._iterate(log, tb, bar, records)
        finally:
            bar.close()
            tb.close()
        if d.is_main and cfg.run.plot:
            report.write_plot(self.out_dir, self.echo, est)
        return records

    def _iterate(
        self, log: MetricsLog, tb: TensorBoard, bar: Progress, records: list[dict[str, Any]]
    ) -> None:
        """Iterations ``start_iteration`` … ``run.iterations``, each logged (and checkpointed every
        ``run.checkpoint_every``), then the final checkpoint unless it exists already."""
        cfg, d = self.cfg, self.dist
        last_saved = self.start_iteration
        for it in range(self.start_iteration, cfg.run.iterations):
            record, result, texts = self.step(it)
            records.append(record)
            log.write(record)
            tb.write(record, it + 1)
            bar.update(record)
            n = it + 1
            if d.is_main and cfg.run.sample_every and (n % cfg.run.sample_every == 0 or n == 1):
                bar.write(report.samples_text(n, texts, result, self.tokenizer))
            if cfg.run.checkpoint_every and n % cfg.run.checkpoint_every == 0:
                self.save(n)
                last_saved = n
        if cfg.run.iterations > last_saved or not (self.ckpt_dir / f"iter_{last_saved:06d}").exists():
            self.save(cfg.run.iterations)


def run(
    cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, resume_fallback: bool = False
) -> list[dict[str, Any]]:
    """Build a :class:`Trainer` (joining a torchrun job if there is one), train, and leave the job
    cleanly (:func:`refppo.train.dist.shutdown_distributed`). The flags: see :class:`Trainer`."""
    d = init_distributed(cfg.model.device)
    trainer = Trainer(cfg, dist=d, resume=resume, overwrite=overwrite, resume_fallback=resume_fallback)
    records = trainer.train()
    shutdown_distributed(d)
    return records


__all__ = ["Trainer", "run"]
