"""``StepRecorder``: capture one optimizer step of any PyTorch trainer as ONE v2 dump.

The trainer's micro-batch loop calls :meth:`StepRecorder.record` with each micro-batch's tensors
*before* its backward; tensor hooks on ``logprobs`` and ``values`` (when they require grad) keep
``g = ∂(loss passed to backward)/∂logprobs`` of that micro-batch. After the step's last backward
(before or after ``optimizer.step()``), every rank calls :meth:`StepRecorder.write`::

    rec = StepRecorder(hparams=hp, conventions={"loss_agg": "token-mean"}, reduce="mean")
    for k, mb in enumerate(micro_batches):
        logprobs, values = policy(mb), critic(mb)
        rec.record(micro_batch=k, logprobs=logprobs, values=values, response_mask=mb.mask,
                   old_logprobs=mb.old_logprobs, ref_logprobs=mb.ref_logprobs,
                   old_values=mb.old_values, scores=mb.scores,
                   advantages=mb.advantages, returns=mb.returns)
        loss(logprobs, values, mb).backward()
    rec.write("step.safetensors")          # every rank; rank 0 writes
    optimizer.step()

Under AMP loss scaling pass ``StepRecorder(loss_scale=scaler)``: the hooks see ``S·g``, the dump
holds ``g`` (:mod:`refppo.capture.scale`).

What the dump holds (spec/dump-format.md, contract v2): the rows of every micro-batch of every
rank (``[B, T]``, ``B = Σ_r Σ_k b_rk``, ``T`` the widest micro-batch, zero-padded with mask 0),
``micro_batch`` and ``rank`` per row, and

    grad_logprobs[row] = s · g_rk[row],   s = 1/W for reduce="mean" (DDP averages gradients),
                                          s = 1   for reduce="sum"  (gradients summed over ranks)

which is ``∂J/∂logprobs`` of the objective ``J`` the optimizer stepped on (likewise
``grad_values``). The loss scalars (``pg_loss`` … ``loss``), when recorded, are summed over
micro-batches and ranks with the same factor ``s``: record the losses *as passed to backward*.
The sidecar holds ``hparams``, ``conventions``, ``world_size``, ``micro_batches`` (per rank, the
largest count when ranks differ) and ``separate_critic``.

Ranks are gathered with tensor ``all_gather`` (padded to a common shape; never pickled objects).
Every rank must call :meth:`write` (it is a collective); an error found on any rank (a missing
backward, mismatched keys) is raised on every rank, so no rank hangs waiting for the others.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from refppo.capture import gather
from refppo.capture.gather import all_gather_cpu as _all_gather
from refppo.capture.gather import dist_rank_world as _dist
from refppo.capture.gather import hash_names
from refppo.capture.inputs import (
    CaptureError,
    as_dict,
    check_policy_version,
    mask_shape,
    needs_problem,
    sampling_of,
    scalar,
)
from refppo.capture.scale import LossScale, loss_scale_of, nonfinite_problem
from refppo.dump.keys import suggest
from refppo.dump.write import check_sidecar, write_dump
from refppo.errors import RefPPOError

TOKEN_KEYS: tuple[str, ...] = (
    "response_mask",
    "old_logprobs",
    "ref_logprobs",
    "old_values",
    "logprobs",
    "values",
    "entropy",
    "rollout_logprobs",
    "advantages",
    "returns",
    "kl",
    "token_rewards",
)
"""Per-token ``[b, T]`` keys a micro-batch may carry (dump names, spec/dump-format.md)."""
ROW_KEYS: tuple[str, ...] = ("scores", "group_index", "policy_version", "bootstrap_values", "truncated")
"""Per-row ``[b]`` keys; ``policy_version`` (integer: the policy update that sampled the row);
``bootstrap_values`` (float: the critic's value of the state after the row's last token) and
``truncated`` (0/1 or bool: the row was cut at the generation limit), read by GAE under
``gae_bootstrap=truncated`` and by the loss under ``truncated_rows`` ≠ ``keep``;
``group_index`` (integer: the prompt each row answers) for the critic-free
group estimators (issue #13). Its values must be GLOBAL prompt ids (the same id on every rank only for
the same prompt, as verl's ``uid``): the rows of all ranks are gathered into one dump, where equal ids
form one group."""
LOSS_KEYS: tuple[str, ...] = ("pg_loss", "vf_loss", "entropy_loss", "kl_loss", "loss")
"""Additive loss scalars: summed over micro-batches and ranks (times ``1/W`` under ``mean``)."""
GRAD_KEYS: dict[str, str] = {"logprobs": "grad_logprobs", "values": "grad_values"}
Reduce = Literal["mean", "sum"]


@dataclass
class _Micro:
    """One recorded micro-batch: detached CPU copies, and the gradients the hooks caught."""

    index: int
    tensors: dict[str, Tensor]
    losses: dict[str, float]
    grads: dict[str, Tensor | None] = field(default_factory=dict)
    scale: float = 1.0
    """The loss scale ``S`` its backward ran under (:mod:`refppo.capture.scale`)."""


def _refuse_unknown(given: Mapping[str, object], valid: frozenset[str]) -> None:
    """One line naming the keys of ``given`` not in ``valid``, each with its "did you mean"."""
    unknown = sorted(set(given) - valid)
    if unknown:
        hints = {k: h for k in unknown if (h := suggest(k, valid)) in valid}
        named = ", ".join(f"{k!r}" + (f" (did you mean {hints[k]}?)" if k in hints else "") for k in unknown)
        tail = "" if len(hints) == len(unknown) else f"; valid keys are {sorted(valid)}"
        raise CaptureError(f"record: unknown key{'s' if len(unknown) > 1 else ''} {named}{tail}")


class StepRecorder:
    """Records one optimizer step's micro-batches on this rank; :meth:`write` makes one v2 dump.

    ``hparams``/``conventions``: mappings or refppo's ``Hyperparams``/``Convention`` (written to the
    sidecar). ``reduce``: how the ranks' parameter gradients are combined — ``"mean"`` (DDP, FSDP:
    averaged) or ``"sum"``. ``separate_critic``: the critic has its own optimizer (sidecar key).
    ``sampling``: the engine's sampling parameters (a mapping of ``temperature``, ``top_p``,
    ``top_k``, ``min_p``, ``logprobs_processed`` or vLLM's ``logprobs_mode``; or vLLM's
    ``SamplingParams`` itself), written to the sidecar (:func:`refppo.capture.inputs.sampling_of`).
    ``loss_scale``: the trainer's ``torch.amp.GradScaler`` (its scale read at each :meth:`record`) or
    a fixed positive scale; the captured gradients are divided by it and the sidecar says
    ``loss_scale`` (:mod:`refppo.capture.scale`). Record the losses unscaled (before ``scaler.scale``).
    """

    def __init__(
        self,
        *,
        hparams: Mapping[str, Any] | Any = None,
        conventions: Mapping[str, Any] | Any = None,
        reduce: Reduce = "mean",
        separate_critic: bool = False,
        grads: bool = True,
        sampling: Mapping[str, Any] | Any = None,
        loss_scale: LossScale = None,
    ) -> None:
        if reduce not in ("mean", "sum"):
            raise CaptureError(f"reduce: expected 'mean' or 'sum', got {reduce!r}")
        self.hparams = as_dict(hparams)
        self.conventions = as_dict(conventions)
        for key, value in sampling_of(sampling).items():
            if key in self.hparams and self.hparams[key] != value:
                raise CaptureError(f"sampling: {key}={value!r} but hparams has {key}={self.hparams[key]!r}")
            self.hparams[key] = value
        try:  # a bad key or value fails here, at the trainer's line, not at diff time
            check_sidecar("StepRecorder", {**self.hparams, **self.conventions})
        except RefPPOError as exc:
            raise CaptureError(str(exc)) from None
        self.reduce: Reduce = reduce
        loss_scale_of(loss_scale)  # a bad value fails here
        self._loss_scale = loss_scale
        self.separate_critic = bool(separate_critic)
        self._grads = bool(grads)
        """False: a dump without gradients: no hook is registered, even on tensors that require grad."""
        self._micro: list[_Micro] = []
        self._handles: list[RemovableHandle] = []
        self._written = False

    # ------------------------------------------------------------------------------------ record
    def record(
        self,
        *,
        micro_batch: int | None = None,
        response_mask: Tensor,
        old_logprobs: Tensor,
        ref_logprobs: Tensor | None = None,
        old_values: Tensor | None = None,
        scores: Tensor,
        logprobs: Tensor | None = None,
        values: Tensor | None = None,
        rollout_logprobs: Tensor | None = None,
        policy_version: Tensor | None = None,
        **more: Tensor | float,
    ) -> None:
        """Record one micro-batch (call it before that micro-batch's backward).

        Token tensors are ``[b, T]`` (``T`` may differ between micro-batches), ``scores`` ``[b]``;
        ``old_values`` None: a critic-free step (no value quantity is written); ``ref_logprobs``
        None: no reference (a step with no KL term, β = 0). The three log-prob roles:
        ``rollout_logprobs`` (behaviour: the engine's log-probs of the sampled tokens),
        ``old_logprobs`` (proximal: the trainer's recompute before the update), ``logprobs``
        (current); ``policy_version`` ``[b]`` integers ≥ 0 (the policy update that sampled each
        row). An optional input the recorder's setting reads is required (``rollout_logprobs``
        with ``rollout_is`` on, ``ref_logprobs`` with a KL term of β > 0): one line names it.
        ``more`` takes the other keys of :data:`TOKEN_KEYS` (``advantages``, ``returns``,
        ``entropy``, ...), of :data:`ROW_KEYS` (``group_index``, ``bootstrap_values``,
        ``truncated``) and the loss scalars of
        :data:`LOSS_KEYS`; the sampling parameters go in ``StepRecorder(sampling=...)``.
        """
        k = self._next_index(micro_batch)
        given: dict[str, Any] = {
            "response_mask": response_mask,
            "old_logprobs": old_logprobs,
            "ref_logprobs": ref_logprobs,
            "old_values": old_values,
            "scores": scores,
            "logprobs": logprobs,
            "values": values,
            "rollout_logprobs": rollout_logprobs,
            "policy_version": policy_version,
            **more,
        }
        _refuse_unknown(given, frozenset({*TOKEN_KEYS, *ROW_KEYS, *LOSS_KEYS}))
        micro = _Micro(k, {}, {}, scale=loss_scale_of(self._loss_scale))
        shape = mask_shape(response_mask)
        problem = needs_problem(
            {n for n, v in given.items() if v is not None}, self.hparams, self.conventions
        )
        if problem:
            raise CaptureError(problem)
        for name, value in given.items():
            if value is None:
                continue
            if name in LOSS_KEYS:
                micro.losses[name] = scalar(name, value)
                continue
            self._keep(micro, name, value, shape)
        self._micro.append(micro)

    def _next_index(self, micro_batch: int | None) -> int:
        """The micro-batch index of a :meth:`record` call (the next one when None); refuses a
        recorder that has written its dump, a non-int index and an index already recorded."""
        if self._written:
            raise CaptureError("record: this recorder has already written its dump; make a new one per step")
        if micro_batch is not None and (isinstance(micro_batch, bool) or not isinstance(micro_batch, int)):
            raise CaptureError(f"record: micro_batch must be an int index, got {micro_batch!r}")
        k = len(self._micro) if micro_batch is None else micro_batch
        if any(m.index == k for m in self._micro):
            raise CaptureError(f"record: micro_batch={k} was already recorded in this step")
        return k

    def _keep(self, micro: _Micro, name: str, value: object, shape: tuple[int, ...]) -> None:
        """Check tensor ``name`` (``[b, T]`` token key or ``[b]`` row key, ``shape`` = the mask's),
        keep a detached CPU copy in ``micro`` and hook its gradient (:data:`GRAD_KEYS`)."""
        if not isinstance(value, Tensor):
            raise CaptureError(f"record: {name} must be a tensor, got {type(value).__name__}")
        want = shape if name in TOKEN_KEYS else shape[:1]
        if tuple(value.shape) != want:
            raise CaptureError(f"record: {name} has shape {list(value.shape)}, expected {list(want)}")
        if name == "policy_version":
            check_policy_version(value)
        t = value.detach().to("cpu", copy=True)
        micro.tensors[name] = t.to(torch.uint8) if name == "response_mask" else t
        if name == "truncated":  # 0/1 rows (bool accepted): int64, as the other integer row keys
            micro.tensors[name] = t.to(torch.int64)
        if name in GRAD_KEYS and not value.requires_grad and self._grads and torch.is_grad_enabled():
            raise CaptureError(
                f"record: {name} does not require grad (recorded after .detach()?), so its gradient "
                "cannot be captured; record the tensor the loss is computed from, or pass "
                "StepRecorder(grads=False) for a dump without gradients"
            )
        if name in GRAD_KEYS and value.requires_grad and self._grads:
            micro.grads[name] = None
            # Tensor.register_hook is untyped in torch's stubs
            self._handles.append(value.register_hook(self._hook(micro, name)))  # type: ignore[no-untyped-call]

    @staticmethod
    def _hook(micro: _Micro, name: str) -> Any:
        def keep(grad: Tensor) -> None:
            g = grad.detach().to("cpu", copy=True)
            prev = micro.grads[name]
            micro.grads[name] = g if prev is None else prev + g

        return keep

    # ------------------------------------------------------------------------------------- write
    def _local_problem(self) -> str:
        """'' when this rank's recording is complete, else what is wrong (one line)."""
        if not self._micro:
            return "write: nothing was recorded on this rank"
        first = self._micro[0]
        indices = sorted(m.index for m in self._micro)
        if indices != list(range(len(indices))):
            n = len(indices) - 1
            return f"write: micro_batch indices must be 0..{n} (one per micro-batch), got {indices}"
        for m in self._micro:
            pairs: tuple[tuple[str, set[str], set[str]], ...] = (
                ("keys", set(m.tensors), set(first.tensors)),
                ("grads", set(m.grads), set(first.grads)),
                ("losses", set(m.losses), set(first.losses)),
            )
            for name, got, want in pairs:
                if got != want:
                    return (
                        f"write: micro-batch {m.index} recorded {name} {sorted(got)} but micro-batch "
                        f"{first.index} recorded {sorted(want)}"
                    )
            for key, g in m.grads.items():
                if g is None:
                    return (
                        f"write: no gradient captured for {key} of micro-batch {m.index}: call write() "
                        "after the backward of every recorded micro-batch (and record the very tensor "
                        "the loss is computed from)"
                    )
                if bad := nonfinite_problem(key, m.index, g, m.scale):
                    return bad
        return ""

    def _local_tensors(self, rank: int, world: int) -> dict[str, Tensor]:
        """This rank's rows of every key (micro-batches in recording order), gradients scaled."""
        scale = 1.0 / world if self.reduce == "mean" else 1.0
        out: dict[str, Tensor] = {}
        for key in self._micro[0].tensors:
            out[key] = gather.concat_padded([m.tensors[key] for m in self._micro], key in TOKEN_KEYS)
        for key, gkey in GRAD_KEYS.items():
            if key in self._micro[0].grads:
                parts = [g * (scale / m.scale) for m in self._micro if (g := m.grads[key]) is not None]
                out[gkey] = gather.concat_padded(parts, token=True)
        sizes = [int(m.tensors["response_mask"].shape[0]) for m in self._micro]
        out["micro_batch"] = torch.cat(
            [torch.full((n,), m.index) for n, m in zip(sizes, self._micro, strict=True)]
        )
        out["rank"] = torch.full((sum(sizes),), rank, dtype=torch.int64)
        return out

    def write(self, path: str | Path) -> Path | None:
        """Gather every rank's rows and write ONE dump on rank 0 (every rank must call it).

        Returns the sidecar's path on rank 0, None on the other ranks. Call it after the step's
        last backward; the recorder is spent afterwards.
        """
        if self._written:
            raise CaptureError("write: this recorder has already written its dump; make a new one per step")
        self._written = True
        for h in self._handles:
            h.remove()
        rank, world = _dist()
        problem = self._local_problem()
        local = self._local_tensors(rank, world) if not problem else {}
        names = sorted(local) + [f"loss:{k}" for k in sorted(self._micro[0].losses)] if local else []
        if world > 1:
            flags = gather.gather_ints([int(bool(problem)), hash_names(names)], world, _all_gather)
            bad = [r for r, f in enumerate(flags) if f[0]]
            if problem:
                raise CaptureError(f"rank {rank}: {problem}")
            if bad:
                raise CaptureError(f"write: rank(s) {bad} failed to record this step (see their error)")
            if len({f[1] for f in flags}) > 1:
                raise CaptureError(f"write: ranks recorded different keys (this rank: {names})")
        elif problem:
            raise CaptureError(problem)
        tensors, losses, n_micro = self._gathered(local, world)
        if rank != 0:
            return None
        tensors.update({k: torch.tensor(v, dtype=torch.float64) for k, v in losses.items()})
        side = {**self.conventions, "world_size": world, "micro_batches": n_micro}
        side["separate_critic"] = self.separate_critic
        if self._loss_scale is not None:  # the gradients are already divided by it
            side["loss_scale"] = self._micro[0].scale
        return write_dump(path, tensors, hparams=self.hparams, convention=side)

    def _gathered(
        self, local: dict[str, Tensor], world: int
    ) -> tuple[dict[str, Tensor], dict[str, float], int]:
        """Every rank's rows, the loss sums (scaled) and the micro-batch count (largest per rank)."""
        scale = 1.0 / world if self.reduce == "mean" else 1.0
        loss_keys = sorted(self._micro[0].losses)
        sums = [scale * sum(m.losses[k] for m in self._micro) for k in loss_keys]
        if world == 1:
            return local, dict(zip(loss_keys, sums, strict=True)), len(self._micro)
        mask = local["response_mask"]
        sizes = gather.gather_ints(
            [int(mask.shape[0]), int(mask.shape[1]), len(self._micro)], world, _all_gather
        )
        out = {k: gather.gather_rows(v, sizes, _all_gather) for k, v in sorted(local.items())}
        totals = [0.0] * len(loss_keys)
        if loss_keys:
            vec = torch.tensor(sums, dtype=torch.float64)
            parts = [torch.zeros_like(vec) for _ in range(world)]
            _all_gather(parts, vec)
            totals = [float(v) for v in torch.stack(parts).sum(dim=0)]
        return out, dict(zip(loss_keys, totals, strict=True)), max(s[2] for s in sizes)


__all__ = ["GRAD_KEYS", "LOSS_KEYS", "ROW_KEYS", "TOKEN_KEYS", "CaptureError", "StepRecorder"]
