"""A refppo dump from one PPO step of TRL 1.12.0's own ``PPOTrainer.train``, captured with a tracer.

TRL keeps the step's tensors in the locals of one long method,
``trl/experimental/ppo/ppo_trainer.py::PPOTrainer.train`` (``trl/trainer/ppo_trainer.py`` before
0.26), so :func:`trace_ppo_step` runs ``trainer.train()`` unmodified under ``sys.settrace`` with a
line tracer on that frame only:

- at the line after ``loss = pg_loss + args.vf_coef * vf_loss`` of the chosen PPO epoch (first
  minibatch, first micro-batch) it calls ``retain_grad()`` on the live ``new_logprobs`` and
  ``vpred``, so that ``accelerator.backward(loss)`` leaves ``∂loss/∂new_logprobs`` and
  ``∂loss/∂vpred`` on them (dump v2 ``grad_logprobs`` / ``grad_values``; TRL has one optimizer for
  policy and value head, so ``grad_values`` is ``vf_coef``·∂vf_loss/∂values);
- at the first line where ``approxkl`` exists it copies the locals of :data:`WANTED` and stops.

Local → dump key (spec/dump-format.md): ``~padding_mask`` → ``response_mask``; ``logprobs``,
``ref_logprobs``, ``values`` → ``old_logprobs``, ``ref_logprobs``, ``old_values``; ``scores`` (after
``missing_eos_penalty``); ``new_logprobs``/``vpred`` → ``logprobs``/``values`` (put back into
rollout order: TRL shuffles with ``np.random.permutation``); ``kl``; ``rewards`` →
``token_rewards``; ``advantages``; ``returns``; ``pg_loss``, ``pg_clipfrac``, ``approxkl`` →
``approx_kl``, ``vf_loss``, ``vf_clipfrac``, ``loss``. Padded positions keep TRL's sentinels
(``INVALID_LOGPROB = 1.0``), junk to refppo.

The dump is the whole optimizer step only when the first micro-batch is the whole batch
(``num_mini_batches = 1``, ``gradient_accumulation_steps = 1``); otherwise it is refused. Nothing
here imports TRL.
"""

from __future__ import annotations

import copy
import sys
import types
from typing import Any

import torch
from torch import Tensor

WANTED: tuple[str, ...] = (
    "logprobs",
    "ref_logprobs",
    "values",
    "scores",
    "kl",
    "rewards",
    "advantages",
    "returns",
    "padding_mask",
    "padding_mask_p1",
    "sequence_lengths",
    "micro_batch_inds",
    "new_logprobs",
    "vpred",
    "pg_loss",
    "vf_loss",
    "pg_clipfrac",
    "vf_clipfrac",
    "approxkl",
    "loss",
    "contain_eos_token",
)
"""Locals of ``PPOTrainer.train`` that the tracer copies."""


def _copy(x: Any) -> Any:
    return x.detach().clone() if isinstance(x, Tensor) else copy.deepcopy(x)


class _Tracer:
    """A ``sys.settrace`` tracer on the frames of one code object (``PPOTrainer.train``)."""

    def __init__(self, code: types.CodeType, epoch: int, grads: bool) -> None:
        self.code = code
        self.epoch = epoch
        self.grads = grads
        self.locals: dict[str, Any] | None = None
        self.live: dict[str, Tensor] = {}
        self.previous = sys.gettrace()  # a debugger's or coverage's tracer, restored once done

    def global_trace(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code is self.code:
            return self.local_trace
        return None

    def _at_step(self, loc: dict[str, Any]) -> bool:
        return (
            loc.get("ppo_epoch_idx") == self.epoch
            and loc.get("minibatch_idx") == 0
            and loc.get("gradient_accumulation_idx") == 0
        )

    def local_trace(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if self.locals is not None or event != "line":
            return None if self.locals is not None else self.local_trace
        loc = frame.f_locals
        if not self._at_step(loc):
            return self.local_trace
        if self.grads and not self.live and "loss" in loc and "approxkl" not in loc:
            # the line about to run is `accelerator.backward(loss)`: keep the gradients of the
            # tensors the loss was computed from (TRL `del`s `loss` at the end of each minibatch)
            for name in ("new_logprobs", "vpred"):
                t = loc[name]
                if isinstance(t, Tensor) and t.requires_grad:
                    t.retain_grad()
                    self.live[name] = t
        if "approxkl" in loc:
            self.locals = {k: _copy(loc[k]) for k in WANTED if k in loc}
            sys.settrace(self.previous)
            return None
        return self.local_trace


def capture_train_locals(trainer: Any, *, epoch: int = 0, grads: bool = True) -> dict[str, Any]:
    """Run ``trainer.train()`` and return copies of the :data:`WANTED` locals of PPO epoch
    ``epoch`` (first minibatch, first micro-batch), plus ``grad_new_logprobs`` / ``grad_vpred``
    when ``grads`` and autograd reached them. Raises ``RuntimeError`` naming what was not seen."""
    tracer = _Tracer(type(trainer).train.__code__, epoch, grads)
    sys.settrace(tracer.global_trace)
    try:
        trainer.train()
    finally:
        sys.settrace(tracer.previous)
    if tracer.locals is None:
        raise RuntimeError(
            f"the tracer never saw `approxkl` in {type(trainer).__name__}.train (PPO epoch {epoch})"
        )
    missing = [k for k in WANTED if k not in tracer.locals]
    if missing:
        raise RuntimeError(f"locals not found in {type(trainer).__name__}.train: {missing}")
    out = dict(tracer.locals)
    for name, t in tracer.live.items():
        if t.grad is not None:
            out[f"grad_{name}"] = t.grad.detach().clone()
    return out


def dump_from_locals(c: dict[str, Any]) -> dict[str, Tensor]:
    """The dump tensors (refppo key names) of locals captured by :func:`capture_train_locals`."""
    order = torch.as_tensor(c["micro_batch_inds"], dtype=torch.long)
    b = int(c["logprobs"].shape[0])
    if sorted(order.tolist()) != list(range(b)):
        raise ValueError(
            f"TRL PPOTrainer: the first micro-batch holds {order.numel()} of {b} rows; a dump is the whole "
            "optimizer step: set num_mini_batches=1 and gradient_accumulation_steps=1"
        )

    def unshuffle(x: Tensor) -> Tensor:
        full = torch.empty_like(x)
        full[order] = x
        return full

    out: dict[str, Tensor] = {
        "response_mask": ~c["padding_mask"],
        "old_logprobs": c["logprobs"],
        "ref_logprobs": c["ref_logprobs"],
        "old_values": c["values"],
        "scores": c["scores"],
        "logprobs": unshuffle(c["new_logprobs"]),
        "values": unshuffle(c["vpred"]),
        "kl": c["kl"],
        "token_rewards": c["rewards"],
        "advantages": c["advantages"],
        "returns": c["returns"],
        "pg_loss": c["pg_loss"],
        "pg_clipfrac": c["pg_clipfrac"],
        "approx_kl": c["approxkl"],
        "vf_loss": c["vf_loss"],
        "vf_clipfrac": c["vf_clipfrac"],
        "loss": c["loss"],
    }
    if "grad_new_logprobs" in c:
        out["grad_logprobs"] = unshuffle(c["grad_new_logprobs"])
    if "grad_vpred" in c:
        out["grad_values"] = unshuffle(c["grad_vpred"])
    return out


def trace_ppo_step(trainer: Any, *, epoch: int = 0, grads: bool = True) -> dict[str, Tensor]:
    """Run TRL's ``PPOTrainer.train()`` and return the dump of PPO epoch ``epoch`` of its first
    iteration (``{dump key: tensor}``; write it with :func:`refppo.dump.write.write_dump` and
    :func:`trl_hparams`)."""
    return dump_from_locals(capture_train_locals(trainer, epoch=epoch, grads=grads))


def trl_hparams(args: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(hparams, convention)`` from TRL's ``PPOConfig``: ``gamma``, ``lam``, ``kl_coef``,
    ``cliprange``, ``cliprange_value``, ``vf_coef`` and ``kl_estimator``; ``whiten_rewards=True``
    is TRL's ``masked_whiten(rewards, shift_mean=False)`` → ``whiten_rewards=masked_no_shift``."""
    hp = {
        "gamma": float(args.gamma),
        "lam": float(args.lam),
        "kl_coef": float(args.kl_coef),
        "cliprange": float(args.cliprange),
        "cliprange_value": float(args.cliprange_value),
        "vf_coef": float(args.vf_coef),
        "ent_coef": 0.0,
    }
    conv: dict[str, Any] = {"kl_estimator": str(args.kl_estimator)}
    if bool(getattr(args, "whiten_rewards", False)):
        conv["whiten_rewards"] = "masked_no_shift"
    return hp, conv


__all__ = ["WANTED", "capture_train_locals", "dump_from_locals", "trace_ppo_step", "trl_hparams"]
