"""A run's checkpoints (skeleton: "checkpoint" and ``--resume`` of :mod:`refppo.train.loop`):
saving on every rank into one atomic folder, and resuming only the same run.

A checkpoint holds the models (policy, reference, critic, reward model), the optimizers, every
rank's RNGs, the KL controller, the config, the world size, the run id and the config hash
(:mod:`refppo.train.checkpoint` writes it, :mod:`refppo.train.rundir` names the run). ``--resume`` refuses a
checkpoint of another run, another config (except :data:`RESUMABLE_KEYS`) or another world
size; with ``--resume-fallback`` a DAMAGED newest checkpoint is skipped (and named) for the
previous complete one.

A checkpoint written by an older refppo, whose saved config lacks keys added since, is resumed when
each such key is at its default (the rule: :mod:`refppo.train.rundir`). The run's identity stays the older
config's: ``Trainer.config_absent`` names those keys (``--resume`` prints them in one line), and
every checkpoint written afterwards stores the config without them and the run's hash
(:func:`refppo.train.rundir.without_keys`).
"""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from refppo.atomic import pause_for_test
from refppo.train import checkpoint as ckpt
from refppo.train import rundir
from refppo.train.config.schema import TrainConfig
from refppo.train.dist import DistContext
from refppo.train.kl_controller import AdaptiveKLController, FixedKLController
from refppo.train.runtime import TrainingError
from refppo.train.seam import RolloutEngine

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


class Run(Protocol):
    """What a checkpoint reads from a run and what a resume sets on it (the trainer,
    :class:`refppo.train.loop.Trainer`, is one): the attributes set by a resume, then the
    read-only parts."""

    identity: rundir.RunIdentity
    """The run's id and config hash (``run.json``); a resume sets the checkpoint's."""
    config_hash: str
    config_absent: tuple[str, ...]
    """Config keys the resumed checkpoint's refppo did not have (accepted at their defaults)."""
    start_iteration: int

    @property
    def cfg(self) -> TrainConfig: ...
    @property
    def dist(self) -> DistContext: ...
    @property
    def out_dir(self) -> Path: ...
    @property
    def ckpt_dir(self) -> Path: ...
    @property
    def resume_fallback(self) -> bool: ...
    @property
    def actor(self) -> nn.Module: ...
    @property
    def reference(self) -> nn.Module: ...
    @property
    def critic(self) -> nn.Module | None: ...
    @property
    def reward_model(self) -> nn.Module | None: ...
    @property
    def actor_opt(self) -> torch.optim.Optimizer: ...
    @property
    def critic_opt(self) -> torch.optim.Optimizer | None: ...
    @property
    def kl_ctl(self) -> FixedKLController | AdaptiveKLController: ...
    @property
    def task_rng(self) -> random.Random: ...
    @property
    def generator(self) -> torch.Generator: ...
    @property
    def seam(self) -> RolloutEngine | None: ...

    def echo(self, text: str) -> None: ...


def models(tr: Run) -> dict[str, nn.Module]:
    """Checkpointed models: policy, reference, and the critic and reward model when there are, and
    the seam mode's k policy snapshots (:meth:`refppo.train.seam.RolloutEngine.snapshots`)."""
    out: dict[str, nn.Module] = {"policy": tr.actor, "reference": tr.reference}
    if tr.critic is not None:
        out["critic"] = tr.critic
    if tr.reward_model is not None:
        out["reward"] = tr.reward_model
    return {**out, **(tr.seam.snapshots() if tr.seam is not None else {})}


def optimizers(tr: Run) -> dict[str, torch.optim.Optimizer]:
    """Checkpointed optimizers: the policy's, and the critic's when there is one."""
    return {"policy": tr.actor_opt, **({"critic": tr.critic_opt} if tr.critic_opt is not None else {})}


def trained(tr: Run) -> dict[str, nn.Module]:
    """The models the update changes: the actor, and the critic when there is one."""
    return {"actor": tr.actor, **({"critic": tr.critic} if tr.critic is not None else {})}


def snapshot(tr: Run) -> dict[str, Any]:
    """An in-memory copy of the trained models' and their optimizers' states (``run.on_nan=skip``:
    an update with a non-finite loss is undone by :func:`restore`)."""
    out = {n: copy.deepcopy(m.state_dict()) for n, m in trained(tr).items()}
    out.update({f"{n}_opt": copy.deepcopy(o.state_dict()) for n, o in optimizers(tr).items()})
    return out


def restore(tr: Run, s: dict[str, Any]) -> None:
    """Load what :func:`snapshot` copied."""
    for n, m in trained(tr).items():
        m.load_state_dict(s[n])
    for n, o in optimizers(tr).items():
        o.load_state_dict(s[f"{n}_opt"])


def save(tr: Run, iteration: int) -> Path:
    """Checkpoint after ``iteration`` completed iterations (call on every rank): every rank writes
    into a staging folder, then the main rank seals it and renames it into place (atomic)."""
    d = tr.dist
    if d.is_main:
        ckpt.begin_checkpoint(tr.ckpt_dir, iteration)
    d.barrier()
    staging = ckpt.save_checkpoint(
        tr.ckpt_dir,
        iteration,
        models=models(tr),
        optimizers=optimizers(tr),
        rng=ckpt.rng_state(tr.task_rng, tr.generator),
        rank=d.rank,
        state={
            "kl_controller": tr.kl_ctl.state_dict(),
            "config": rundir.without_keys(tr.cfg.to_dict(), tr.config_absent),
            "world_size": d.world_size,
            "run_id": tr.identity.run_id,
            "config_hash": tr.config_hash,
            **({"seam": tr.seam.state_dict()} if tr.seam is not None else {}),
        },
        is_main=d.is_main,
    )
    d.barrier()
    path = ckpt.staging_dir(tr.ckpt_dir, iteration).with_name(f"iter_{iteration:06d}")
    if d.is_main:
        pause_for_test(f"checkpoint:{iteration}")  # test-only: the kill tests stop here
        path = ckpt.mark_complete(staging)
    d.barrier()
    return path


def resume(tr: Run) -> None:
    """Resume from the newest complete checkpoint; with ``resume_fallback``, a damaged one is
    skipped (and named) in favour of the previous one. A checkpoint of another run or config is
    never skipped: it is refused."""
    ident = rundir.read_identity(tr.out_dir)
    if ident is None:
        raise TrainingError(
            f"--resume: {str(tr.out_dir)!r} has no {rundir.RUN_FILE}, so its checkpoints cannot be "
            "shown to belong to one run (written by refppo before run identities?); start a fresh run"
        )
    tr.identity = ident
    candidates = ckpt.complete_checkpoints(tr.ckpt_dir)[::-1]
    for i, path in enumerate(candidates):
        try:
            c = _load_one(tr, path, ident)
        except ckpt.CheckpointError as e:
            more = i + 1 < len(candidates)
            if tr.resume_fallback and more:
                tr.echo(f"--resume-fallback: skipped {path.name}: {e}")
                continue
            hint = "; --resume-fallback resumes from the previous complete checkpoint" if more else ""
            raise ckpt.CheckpointError(f"--resume: {e}{hint}") from None
        tr.start_iteration = c.iteration
        tr.echo(f"resumed from {path} (iteration {c.iteration})")
        if tr.config_absent:
            tr.echo(
                f"--resume: checkpoint written by an older refppo without {len(tr.config_absent)} "
                f"config key(s), accepted at their defaults: {', '.join(tr.config_absent)}"
            )
        return


def _load_one(tr: Run, path: Path, ident: rundir.RunIdentity) -> ckpt.Checkpoint:
    state = ckpt.read_state(path)
    check_resume_config(tr, state, ident, path)
    c, rng = ckpt.load_checkpoint(
        path,
        models=models(tr),
        optimizers=optimizers(tr),
        rank=tr.dist.rank,
    )
    try:
        tr.kl_ctl.load_state_dict(c.state["kl_controller"])
    except (KeyError, TypeError, ValueError) as e:
        raise ckpt.CheckpointError(
            f"checkpoint {str(path)!r}: state.json has no valid 'kl_controller' ({e})"
        ) from None
    if tr.seam is not None:
        try:
            tr.seam.load_state_dict(c.state["seam"])
        except (KeyError, TypeError, ValueError) as e:
            raise ckpt.CheckpointError(
                f"checkpoint {str(path)!r}: state.json has no valid 'seam' ({e})"
            ) from None
    ckpt.set_rng_state(rng, tr.task_rng, tr.generator)
    return c


def check_resume_config(tr: Run, state: dict[str, Any], ident: rundir.RunIdentity, path: Path) -> None:
    """The checkpoint ``state`` belongs to this run (run id of ``run.json``), has this config
    (except :data:`RESUMABLE_KEYS`, and keys added since it was written if at their defaults; also
    by hash) and this world size; else TrainingError. Sets ``tr.config_absent`` (the keys added
    since) and ``tr.config_hash`` (the run's) for the checkpoints written from now on."""
    config = tr.cfg.to_dict()
    full_hash = rundir.config_hash(config, RESUMABLE_KEYS)
    problem = rundir.resume_mismatch(
        state, ident, config, full_hash, RESUMABLE_KEYS, path, defaults=TrainConfig().to_dict()
    )
    if problem is not None:
        raise TrainingError(problem)
    absent = rundir.absent_keys(state.get("config", {}), config, RESUMABLE_KEYS)
    tr.config_absent = absent
    tr.config_hash = rundir.config_hash(rundir.without_keys(config, absent), RESUMABLE_KEYS)
    saved_world = int(state.get("world_size", 1))
    if saved_world != tr.dist.world_size:
        raise TrainingError(
            f"--resume: checkpoint was written by {saved_world} ranks, now {tr.dist.world_size}"
        )


__all__ = [
    "RESUMABLE_KEYS",
    "Run",
    "check_resume_config",
    "models",
    "optimizers",
    "restore",
    "resume",
    "save",
    "snapshot",
    "trained",
]
