"""Input validation shared by every public core function.

Each check raises a :class:`refppo.errors.RefPPOError` subclass whose message names the tensor,
the expected shape/dtype and what was given, e.g.::

    ShapeError: values: expected shape [B, T] = [4, 7] (batch, resp), got [4, 6]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from refppo.errors import DtypeError, HyperparameterError, MaskError, ShapeError

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fmt(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def check_float(name: str, x: object) -> Tensor:
    """``x`` must be a floating-point tensor."""
    if not isinstance(x, Tensor):
        raise DtypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise DtypeError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    return x


def check_mask(name: str, mask: object, *, require_nonempty_rows: bool = True) -> Tensor:
    """Validate a ``[B, T]`` response mask (bool, or integers/floats that are all 0 or 1).

    Returns the canonical bool mask. With ``require_nonempty_rows`` every row must hold at least
    one valid token (a row with none has no defined mean, score position or loss).
    """
    if not isinstance(mask, Tensor):
        raise MaskError(f"{name}: expected a torch.Tensor, got {type(mask).__name__}")
    if mask.dim() != 2:
        raise ShapeError(f"{name}: expected 2 dims [B, T] (batch, resp), got shape {_fmt(mask.shape)}")
    if mask.dtype == torch.bool:
        out = mask
    else:
        if mask.is_floating_point() and not bool(torch.isfinite(mask).all()):
            raise MaskError(f"{name}: expected only 0/1 values, found non-finite entries")
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            idx = tuple(int(i) for i in bad.nonzero()[0])
            raise MaskError(
                f"{name}: expected only 0/1 values, found {float(mask[idx])} at position {list(idx)}"
            )
        out = mask != 0
    # The empty-row check reduces a uint8 view of the bool mask: same bytes, ~6x faster than a
    # bool reduction on CPU.
    if require_nonempty_rows and out.numel() > 0 and int(out.view(torch.uint8).amax(dim=1).amin()) == 0:
        empty = ~out.any(dim=1)
        rows = empty.nonzero().flatten().tolist()[:8]
        raise MaskError(f"{name}: rows {rows} have no valid token (every row needs at least one)")
    if out.shape[0] == 0:
        raise ShapeError(f"{name}: expected at least one sequence (B >= 1), got shape {_fmt(out.shape)}")
    if out.shape[1] == 0:
        raise ShapeError(
            f"{name}: expected at least one response position (T >= 1), got shape {_fmt(out.shape)}"
        )
    return out


def check_in_loss(name: str, in_loss: object, B: int, device: torch.device) -> Tensor:
    """``in_loss`` ``[B]``: bool, or integers/floats all 0 or 1 (1 = the row is in the loss)."""
    if not isinstance(in_loss, Tensor):
        raise DtypeError(f"{name}: expected a torch.Tensor [B], got {type(in_loss).__name__}")
    if in_loss.shape != (B,) or in_loss.device != device:
        raise ShapeError(f"{name}: expected shape [B] = [{B}] on {device}, got {list(in_loss.shape)}")
    if in_loss.dtype == torch.bool:
        return in_loss
    if in_loss.is_complex() or not bool(((in_loss == 0) | (in_loss == 1)).all()):
        raise MaskError(f"{name}: expected only 0/1 (or bool) per row")
    return in_loss != 0


def check_bt(name: str, x: object, like: Tensor, *, float_required: bool = True) -> Tensor:
    """``x`` must be a tensor with the same ``[B, T]`` shape as ``like`` (normally the mask)."""
    if float_required:
        t = check_float(name, x)
    else:
        if not isinstance(x, Tensor):
            raise DtypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        t = x
    if t.shape != like.shape:
        B, T = like.shape
        raise ShapeError(f"{name}: expected shape [B, T] = [{B}, {T}] (batch, resp), got {_fmt(t.shape)}")
    if t.device != like.device:
        raise ShapeError(f"{name}: expected device {like.device}, got {t.device}")
    return t


def check_b(name: str, x: object, B: int, device: torch.device) -> Tensor:
    """``x`` must be a float tensor of shape ``[B]``."""
    t = check_float(name, x)
    if t.shape != (B,):
        raise ShapeError(f"{name}: expected shape [B] = [{B}] (batch), got {_fmt(t.shape)}")
    if t.device != device:
        raise ShapeError(f"{name}: expected device {device}, got {t.device}")
    return t


def check_same_dtype(**tensors: Tensor) -> torch.dtype:
    """All float tensors of one call share one dtype (no silent up/down-casting)."""
    dtypes = {n: t.dtype for n, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{n}={d}" for n, d in dtypes.items())
        raise DtypeError(f"expected one floating dtype for all inputs, got {listing}")
    return next(iter(dtypes.values()))


def check_unit_interval(name: str, value: float) -> float:
    """``0 <= value <= 1`` (gamma, lambda)."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and 0.0 <= value <= 1.0):
        raise HyperparameterError(f"{name}: expected a number in [0, 1], got {value!r}")
    return float(value)


def check_nonneg(name: str, value: float) -> float:
    """``value >= 0`` and finite (clip ranges, coefficients)."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0.0):
        raise HyperparameterError(f"{name}: expected a finite number >= 0, got {value!r}")
    return float(value)


def check_positive(name: str, value: float) -> float:
    """``value > 0`` and finite (temperature, epsilons)."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0.0):
        raise HyperparameterError(f"{name}: expected a finite number > 0, got {value!r}")
    return float(value)


def check_logits(name: str, logits: object, tokens: object) -> tuple[Tensor, Tensor]:
    """``logits`` ``[B, T, V]`` float and ``tokens`` ``[B, T]`` integer ids in ``[0, V)``."""
    lg = check_float(name, logits)
    if lg.dim() != 3:
        raise ShapeError(f"{name}: expected 3 dims [B, T, V] (batch, resp, vocab), got {_fmt(lg.shape)}")
    if not isinstance(tokens, Tensor):
        raise DtypeError(f"tokens: expected a torch.Tensor, got {type(tokens).__name__}")
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool or tokens.is_complex():
        raise DtypeError(f"tokens: expected an integer tensor of token ids, got dtype {tokens.dtype}")
    B, T, _ = lg.shape
    if tokens.shape != (B, T):
        raise ShapeError(
            f"tokens: expected shape [B, T] = [{B}, {T}] (batch, resp), got {_fmt(tokens.shape)}"
        )
    return lg, tokens


def count_true(mask: Tensor, dim: int | None = None) -> Tensor:
    """Number of True entries of a bool mask (int64), over everything or along ``dim``.

    Over everything ``torch.count_nonzero`` (~7x faster than a sum on CPU at 8 M entries); along a
    dim a sum of a uint8 view of the mask's bytes (as fast as ``count_nonzero`` there, and several
    times faster than a bool reduction, whose CPU kernels are not vectorized). Exact integers.

    Along the last axis of a ``[B, T]`` mask, in two steps: the bytes of each run of
    :data:`_COUNT_RUN` entries are summed in uint8 (at most 128, no overflow), then the ``[B, T/128]``
    partial counts in int64. A plain uint8 sum into int64 first casts the whole mask (an int64
    ``[B, T]`` copy: 64 MB at B=1024, T=8192); this allocates only the partial counts.
    """
    if dim is None:
        return torch.count_nonzero(mask)
    u = mask.view(torch.uint8)
    if u.dim() != 2 or dim not in (1, -1):
        return u.sum(dim=dim)
    t0 = u.shape[1] - u.shape[1] % _COUNT_RUN
    runs = u[:, :t0].view(u.shape[0], t0 // _COUNT_RUN, _COUNT_RUN)  # a view: one axis split
    out = runs.sum(-1, dtype=torch.uint8).sum(1)
    return out + u[:, t0:].sum(1) if t0 < u.shape[1] else out


_COUNT_RUN = 128
"""Entries per uint8 partial count of :func:`count_true` along ``T`` (≤ 255: no uint8 overflow)."""
