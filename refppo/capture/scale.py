"""Loss scaling under automatic mixed precision: the scale a :class:`StepRecorder` divides out.

A trainer using ``torch.amp.GradScaler`` (``torch.cuda.amp.GradScaler``) calls
``scaler.scale(loss).backward()``, so the gradient a tensor hook sees is ``S·∂loss/∂x`` with ``S`` the
scaler's current scale (``scaler.get_scale()``, constant between two ``scaler.update()`` calls, and
``update()`` runs after ``scaler.step(optimizer)``). The dump's gradients are ``∂J/∂x`` of the
objective the optimizer stepped on — what ``scaler.step`` applies after ``scaler.unscale_`` — so the
recorder divides each micro-batch's captured gradient by the ``S`` read when that micro-batch was
recorded (before its backward): ``grad_logprobs = s·g_scaled/S`` (``s`` the rank reduction). A
scale read at :meth:`~refppo.capture.recorder.StepRecorder.write` could already be the next step's
(after ``update()``), hence the read per :meth:`~refppo.capture.recorder.StepRecorder.record`.

A step whose scaled gradients hold inf or NaN is one the scaler skips (``scaler.step`` does not step
and ``update()`` lowers the scale): the recorder refuses to write it (:func:`nonfinite_problem`).
"""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from refppo.capture.inputs import CaptureError


@runtime_checkable
class _Scaler(Protocol):
    def get_scale(self) -> float: ...

    def is_enabled(self) -> bool: ...


LossScale = float | int | _Scaler | None
"""What ``StepRecorder(loss_scale=...)`` takes: a ``GradScaler`` (its scale read at each record),
a fixed positive scale, or None (no loss scaling)."""


def loss_scale_of(scale: Any) -> float:
    """The scale ``S`` in force now: ``scaler.get_scale()`` (1 when the scaler is disabled), a fixed
    positive number as given, 1 for None; anything else is refused in one line."""
    if scale is None:
        return 1.0
    if isinstance(scale, _Scaler):
        return float(scale.get_scale()) if scale.is_enabled() else 1.0
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise CaptureError(
            f"loss_scale: expected a torch.amp.GradScaler or a positive number, got {type(scale).__name__}"
        )
    if not math.isfinite(scale) or scale <= 0:
        raise CaptureError(f"loss_scale: expected a finite number > 0, got {scale!r}")
    return float(scale)


def nonfinite_problem(key: str, index: int, grad: Tensor, scale: float) -> str:
    """The line naming a step the scaler skips (a gradient with inf/NaN under a loss scale ≠ 1);
    '' otherwise (without loss scaling the gradients are written as captured)."""
    if scale == 1.0 or bool(grad.isfinite().all()):
        return ""
    return (
        f"write: the gradient of {key} in micro-batch {index} holds inf/NaN under loss scale {scale:g}: "
        "the GradScaler skips this step (scaler.step does not step); record another step"
    )


__all__ = ["LossScale", "loss_scale_of", "nonfinite_problem"]
