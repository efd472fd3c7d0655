"""The configuration and record types of :func:`refppo.train.update.ppo_update`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import Tensor

from refppo.capture.recorder import StepRecorder
from refppo.errors import HyperparameterError


@dataclass(frozen=True)
class PPOUpdateConfig:
    """How the cached rollout is consumed by the PPO epochs."""

    ppo_epochs: int = 4
    """K: passes over the rollout batch."""
    num_minibatches: int = 1
    """Optimizer steps per epoch; the batch size must be divisible by it."""
    micro_batch_size: int | None = None
    """Rows per forward/backward (gradient accumulation); None = the whole minibatch."""
    max_grad_norm: float | None = 1.0
    """Clip of the global gradient norm, per model (actor and critic separately); None = off."""
    ptx_coef: float = 0.0
    """γ_ptx of InstructGPT's PPO-ptx: weight of the LM loss on ``ptx_batch`` (0 = off)."""
    dropout_in_update: bool = False
    """False (default, TRL): update forwards in eval mode, same as the cached old log-probs."""
    shuffle: bool = True
    """Shuffle rows (with the ``generator``) at every epoch."""

    def __post_init__(self) -> None:
        if self.ppo_epochs < 1:
            raise HyperparameterError(f"ppo_epochs: expected >= 1, got {self.ppo_epochs}")
        if self.num_minibatches < 1:
            raise HyperparameterError(f"num_minibatches: expected >= 1, got {self.num_minibatches}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise HyperparameterError(f"micro_batch_size: expected >= 1, got {self.micro_batch_size}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise HyperparameterError(f"max_grad_norm: expected > 0 or None, got {self.max_grad_norm}")
        if not (math.isfinite(self.ptx_coef) and self.ptx_coef >= 0):
            raise HyperparameterError(f"ptx_coef: expected >= 0, got {self.ptx_coef}")


@dataclass(frozen=True)
class CaptureRequest:
    """Dump one optimizer step of :func:`ppo_update` as a v2 dump through ``recorder``
    (:class:`refppo.capture.recorder.StepRecorder`, ``reduce="mean"``: DDP averages) to ``path``."""

    epoch: int
    minibatch: int
    recorder: StepRecorder
    path: str

    def wants(self, epoch: int, minibatch: int) -> StepRecorder | None:
        return self.recorder if (epoch, minibatch) == (self.epoch, self.minibatch) else None


@dataclass(frozen=True)
class PtxBatch:
    """Pretraining/SFT token ids for the PPO-ptx term: ``[N, S]`` ids and attention mask."""

    input_ids: Tensor
    attention_mask: Tensor


@dataclass(frozen=True)
class MinibatchRecord:
    """Passed to ``on_minibatch`` after each optimizer step (all tensors detached)."""

    epoch: int
    index: int
    """Minibatch index within the epoch."""
    rows: Tensor
    """``[b]`` row indices of the minibatch in the rollout batch."""
    old_logprobs: Tensor
    """``[b, T]`` the cached π_old log-probs used for the ratio."""
    logprobs: Tensor
    """``[b, T]`` current log-probs before this step (as used in the loss)."""
    stats: dict[str, float] = field(default_factory=dict)
    """Minibatch scalars (losses, clip fractions, approx-KL, grad norms, max |ratio − 1|)."""


@dataclass(frozen=True)
class Behaviour:
    """The behaviour policy's side of one rollout (the seam mode, :mod:`refppo.train.seam`):
    ``rollout_logprobs`` ``[B, T]`` (the engine's log-probs of the sampled tokens, 0 at padding, in
    the dtype of ``old_logprobs``) and ``policy_version`` ``[B]`` int64 (the iteration whose policy
    sampled each row); ``version`` the policy being trained (its staleness is ``version −
    policy_version``). The update passes ``rollout_logprobs`` to
    :func:`refppo.pipeline.step.update_quantities` (read by the ``rollout_correction`` stage when
    ``ppo.rollout_is`` is on) and a dump records both."""

    rollout_logprobs: Tensor
    policy_version: Tensor
    version: int = 0

    def select(self, idx: Tensor) -> dict[str, Tensor]:
        """The rows ``idx`` as a recorder's keywords."""
        return {"rollout_logprobs": self.rollout_logprobs[idx], "policy_version": self.policy_version[idx]}
