"""``run.dump_iteration``: the trainer's own step as a v2 dump, through ``refppo.capture``.

The trainer checked by its own oracle: :func:`request` asks :func:`refppo.train.update.ppo_update` to
record the LAST optimizer step of the chosen iteration (last epoch, last minibatch: the ratio has
moved away from 1, so the clip is exercised) with a :class:`refppo.capture.recorder.StepRecorder`, the very
recorder any other trainer uses (one capture path). Every rank records its micro-batches; rank 0
writes ``<out_dir>/dumps/iter_<N>.safetensors`` and its sidecar (the iteration's hyperparameters,
with the KL controller's current β, the conventions, and the score map ``score_bias``,
``score_scale``, ``score_clip``: :func:`sidecar_conventions`; in the seam mode the rollout
correction's ``rollout_is*`` and the engine's sampling, :func:`sidecar_hparams`, and the dump holds
``rollout_logprobs`` and ``policy_version``). ``refppo diff`` on it must match
with no ``--set``. The dump's ``scores`` are those before the map (after the missing-EOS penalty),
as ``ppo.iteration`` hands them to the pipeline, which maps them at its step 0, like the oracle.

Why the last minibatch equals the oracle's view only with ``ppo.minibatches=1`` when advantages or
rewards are whitened, or the estimator has group or batch statistics (the group estimators,
``flash-reinforce``): the trainer computes them over the whole rollout batch, the oracle over the dump's
rows (:meth:`refppo.train.config.schema.TrainConfig.__post_init__` refuses the other combinations).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from refppo.capture.recorder import StepRecorder
from refppo.pipeline.settings import Hyperparams
from refppo.train.config.schema import TrainConfig
from refppo.train.update_config import CaptureRequest


def dump_path(out_dir: Path, iteration: int) -> Path:
    """Where iteration ``iteration`` (1-based) is dumped."""
    return out_dir / "dumps" / f"iter_{iteration:06d}.safetensors"


def sidecar_conventions(cfg: TrainConfig) -> dict[str, Any]:
    """The sidecar's conventions: ``ppo.convention.to_dict()`` and the score map's flat keys
    (``score_bias``, ``score_scale``, ``score_clip``), always written, the identity included."""
    conv = cfg.ppo.convention
    return {
        **conv.to_dict(),
        "score_bias": conv.score.bias,
        "score_scale": conv.score.scale,
        "score_clip": conv.score.clip,
    }


def sidecar_hparams(cfg: TrainConfig, hp: Hyperparams) -> Hyperparams | dict[str, Any]:
    """The sidecar's hyperparameters: ``hp``; in the seam mode also the engine's sampling
    (``temperature``, ``top_p``, ``top_k``, ``logprobs_processed``: spec/dump-format.md)."""
    if not cfg.seam.enabled:
        return hp
    r = cfg.rollout
    sampling = {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k}
    return {**hp.to_dict(), **sampling, "logprobs_processed": cfg.seam.logprobs == "processed"}


def request(cfg: TrainConfig, it: int, out_dir: Path, hp: Hyperparams) -> CaptureRequest | None:
    """The capture request of 0-based iteration ``it``, or None when it is not the one to dump."""
    if cfg.run.dump_iteration is None or cfg.run.dump_iteration != it + 1:
        return None
    recorder = StepRecorder(
        hparams=sidecar_hparams(cfg, hp), conventions=sidecar_conventions(cfg), reduce="mean"
    )
    return CaptureRequest(
        epoch=cfg.ppo.epochs - 1,
        minibatch=cfg.ppo.minibatches - 1,
        recorder=recorder,
        path=str(dump_path(out_dir, it + 1)),
    )


__all__ = ["dump_path", "request", "sidecar_conventions", "sidecar_hparams"]
