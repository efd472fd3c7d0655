"""Shared by the adapters: reading a container by duck typing, scalars from metrics, gradients."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor


def batch_of(container: Any) -> Any:
    """The tensor mapping of ``container``: its ``.batch`` (verl ``DataProto``) or itself."""
    batch = getattr(container, "batch", None)
    return container if batch is None else batch


def get(batch: Any, key: str) -> Tensor | None:
    """``batch[key]`` when the mapping (dict or ``TensorDict``) has it, else None."""
    keys = batch.keys() if hasattr(batch, "keys") else ()
    if key not in keys:
        return None
    value = batch[key]
    if value is not None and not isinstance(value, Tensor):
        raise TypeError(f"{key}: expected a tensor, got {type(value).__name__}")
    return value


def scalar(name: str, value: Any, dtype: torch.dtype) -> Tensor:
    """A 0-dim tensor of ``dtype`` from a number, a one-element tensor or list, or a verl ``Metric``.

    A verl ``Metric`` (``verl/utils/metric/utils.py``: ``values`` + ``aggregation`` +
    ``aggregate()``) is read through its own ``aggregate()`` when that is exact for the step: one
    value, or ``sum`` of per-micro-batch partial sums (verl's ``ppo_loss`` chooses ``sum`` when the
    loss is normalised over the global mini-batch). A ``mean`` of several micro-batch values is not
    the step's value (a clip fraction averaged over micro-batches of unequal token counts), so it is
    refused with one line naming the metric rather than compared as if it were.
    """
    if hasattr(value, "aggregate") and hasattr(value, "values"):
        agg = getattr(value, "aggregation", None)
        how = str(getattr(agg, "value", agg)).lower()
        n = len(list(value.values))
        if n != 1 and how != "sum":
            raise ValueError(
                f"metric {name!r}: {n} micro-batch values aggregated by {how!r} are not the step's value; "
                f"pass the metrics of a single micro-batch or leave {name!r} out"
            )
        value = value.aggregate()
    elif isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(
                f"metric {name!r}: {len(value)} values (one per micro-batch?); expected one for the step"
            )
        value = value[0]
    t = value.detach() if isinstance(value, Tensor) else torch.as_tensor(float(value))
    if t.numel() != 1:
        raise ValueError(f"metric {name!r}: expected a scalar, got shape {tuple(t.shape)}")
    return (
        t.reshape(()).to(device="cpu", dtype=dtype).clone()
    )  # never a view: safetensors refuses shared storage


def from_metrics(
    metrics: Mapping[str, Any] | None, names: Mapping[str, str], dtype: torch.dtype
) -> dict[str, Tensor]:
    """``{dump key: scalar}`` for each metric of ``names`` (``{metric name: dump key}``) present."""
    out: dict[str, Tensor] = {}
    for metric, key in names.items():
        if metrics is not None and metric in metrics:
            if key in out:
                raise ValueError(f"metrics: two names give {key}; keep one of them ({metric!r})")
            out[key] = scalar(metric, metrics[metric], dtype)
    return out


def grad_of(t: Tensor | None) -> Tensor | None:
    """The gradient autograd accumulated on ``t`` (a leaf, or a tensor that called ``retain_grad``)."""
    return None if t is None or t.grad is None else t.grad.detach()


def update_inputs(
    logprobs: Tensor | None,
    values: Tensor | None,
    entropy: Tensor | None,
    grad_logprobs: Tensor | None,
    grad_values: Tensor | None,
) -> dict[str, Tensor]:
    """The update-step inputs and their gradients (explicit ones win over ``.grad``), detached."""
    out: dict[str, Tensor] = {}
    for key, t in (("logprobs", logprobs), ("values", values), ("entropy", entropy)):
        if t is not None:
            out[key] = t.detach()
    g_lp = grad_logprobs if grad_logprobs is not None else grad_of(logprobs)
    g_v = grad_values if grad_values is not None else grad_of(values)
    if g_lp is not None:
        out["grad_logprobs"] = g_lp.detach()
    if g_v is not None:
        out["grad_values"] = g_v.detach()
    return out


def float_dtype(*tensors: Tensor | None) -> torch.dtype:
    """The dtype of the first floating tensor given (float32 if none): scalars are stored in it."""
    for t in tensors:
        if t is not None and t.is_floating_point():
            return t.dtype
    return torch.float32


def row_origin(micro_batch: Tensor | None, rank: Tensor | None) -> dict[str, Tensor]:
    """Dump v2 ``micro_batch`` / ``rank`` [B] (integers): where each row of the step was processed."""
    out: dict[str, Tensor] = {}
    for key, t in (("micro_batch", micro_batch), ("rank", rank)):
        if t is not None:
            if t.is_floating_point() or t.dim() != 1:
                raise ValueError(
                    f"{key}: expected a [B] integer tensor, got {t.dtype} of shape {tuple(t.shape)}"
                )
            out[key] = t.detach()
    return out
