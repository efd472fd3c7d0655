"""The critic's loss, clipped around the rollout-time values.

Symbols: ``V_t`` current critic output (differentiable), ``V^old_t`` the critic's output cached at
rollout (there is no "old critic" network: these cached values are all PPO keeps), ``R_t`` returns
(value targets, constants), ``ε_v`` the value clip range::

    V^clip_t = clip(V_t, V^old_t − ε_v, V^old_t + ε_v)         (form ``around_old``, default)
    V^clip_t = V^old_t + clip(V_t − V^old_t, −ε_v, ε_v)         (form ``delta``)
    ℓ^v_t    = ½·max((V_t − R_t)², (V^clip_t − R_t)²)      (clipped)
    ℓ^v_t    = ½·(V_t − R_t)²                               (unclipped)
    vf_loss  = agg(ℓ^v)

As verl ``core_algos.compute_value_loss``, OpenRLHF ``models/loss.py::ValueLoss``, TRL and
DeepSpeed-Chat ``critic_loss_fn`` (all use the ½ and the max). ``vf_clipfrac`` =
mean over valid tokens of ``[(V^clip−R)² > (V−R)²]``. The two forms of ``V^clip`` are equal in
exact arithmetic, but in floating point ``delta`` can land one rounding step off ``V`` inside the
range and count the tie as clipped (see :class:`refppo.conventions.ValueClipForm`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from refppo.conventions import LossAgg, ValueClipForm, ValueLoss, parse
from refppo.core import _pyfloat as pf
from refppo.core.aggregate import aggregate_loss_naive, aggregate_masked
from refppo.core.checks import check_bt, check_mask, check_nonneg, check_same_dtype
from refppo.errors import HyperparameterError
from refppo.types import ResponseMask, Scalar, TokenFloat


@dataclass(frozen=True)
class ValueLossOutput:
    """What :func:`value_loss` returns; ``per_token`` is 0 at padded positions."""

    loss: Scalar
    per_token: TokenFloat
    clipfrac: Scalar


def _checked_value_inputs(
    values: Tensor,
    values_old: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float | None,
    kind: ValueLoss | str,
    agg: LossAgg | str,
    clip_form: ValueClipForm | str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, float | None, ValueClipForm, LossAgg]:
    """The value loss's inputs checked in one place (:func:`value_loss` and its row-block twin
    :func:`refppo.core.by_rows.value_loss_by_rows`): ``(values, values_old, returns, mask, ε_v,
    clip form, loss_agg)``, or one clear error naming the bad input."""
    k = parse(ValueLoss, kind, what="value_loss")
    form = parse(ValueClipForm, clip_form, what="value_clip_form")
    agg_mode = parse(LossAgg, agg, what="loss_agg")
    m = check_mask("mask", mask)
    values = check_bt("values", values, m)
    values_old = check_bt("values_old", values_old, m)
    returns = check_bt("returns", returns, m)
    check_same_dtype(values=values, values_old=values_old, returns=returns)
    return values, values_old, returns, m, check_value_clip(k, clip), form, agg_mode


@dataclass(frozen=True)
class ValueTokenLoss:
    """The value loss before aggregation (:func:`value_token_loss`)."""

    per_token: TokenFloat
    """``ℓ^v_t``, 0 on padding (differentiable)."""
    clipfrac: Scalar


def value_token_loss(
    values: TokenFloat,
    values_old: TokenFloat,
    returns: TokenFloat,
    mask: ResponseMask,
    *,
    clip: float | None = 0.2,
    kind: ValueLoss | str = ValueLoss.CLIPPED,
    clip_form: ValueClipForm | str = ValueClipForm.AROUND_OLD,
) -> ValueTokenLoss:
    """The clipped (or unclipped) value loss per token and ``vf_clipfrac`` (module docstring), not
    aggregated: :func:`value_loss` is ``agg`` of its ``per_token``."""
    values, values_old, returns, m, eps_v, form, _ = _checked_value_inputs(
        values, values_old, returns, mask, clip=clip, kind=kind, agg=LossAgg.TOKEN_MEAN, clip_form=clip_form
    )
    return _token_loss(values, values_old, returns, m, eps_v, form)


def _token_loss(
    values: Tensor, values_old: Tensor, returns: Tensor, m: Tensor, eps_v: float | None, form: ValueClipForm
) -> ValueTokenLoss:
    per_token, clipped = value_terms(values, values_old, returns, m, eps_v=eps_v, form=form)
    if clipped is None:
        clipfrac = torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        with torch.no_grad():
            clipfrac = clipped.sum().to(values.dtype) / m.sum().to(values.dtype)
    return ValueTokenLoss(per_token, clipfrac)


def value_loss(
    values: TokenFloat,
    values_old: TokenFloat,
    returns: TokenFloat,
    mask: ResponseMask,
    *,
    clip: float | None = 0.2,
    kind: ValueLoss | str = ValueLoss.CLIPPED,
    agg: LossAgg | str = LossAgg.TOKEN_MEAN,
    token_count: float | None = None,
    seq_count: float | None = None,
    horizon: float | None = None,
    clip_form: ValueClipForm | str = ValueClipForm.AROUND_OLD,
) -> ValueLossOutput:
    """Clipped (or unclipped) value loss, aggregated by ``agg`` (module docstring)."""
    values, values_old, returns, m, eps_v, form, agg_mode = _checked_value_inputs(
        values, values_old, returns, mask, clip=clip, kind=kind, agg=agg, clip_form=clip_form
    )
    tok = _token_loss(values, values_old, returns, m, eps_v, form)
    loss = aggregate_masked(
        tok.per_token, m, agg_mode, token_count=token_count, seq_count=seq_count, horizon=horizon
    )
    return ValueLossOutput(loss, tok.per_token, tok.clipfrac)


def check_value_clip(kind: ValueLoss, clip: float | None) -> float | None:
    """The value clip range ``ε_v`` of a clipped value loss (checked), None for an unclipped one."""
    if kind is not ValueLoss.CLIPPED:
        return None
    if clip is None:
        raise HyperparameterError("clip: a clipped value loss needs a clip range, got None")
    return check_nonneg("clip", clip)


def clipped_value(v: Tensor, v_old: Tensor, eps_v: float, form: ValueClipForm) -> Tensor:
    """``V^clip`` of the module docstring, elementwise: ``clip(V, V^old ± ε_v)`` (``around_old``) or
    ``V^old + clip(V − V^old, ±ε_v)`` (``delta``)."""
    if form is ValueClipForm.AROUND_OLD:  # verl compute_value_loss: exactly V inside the range
        return torch.clamp(v, min=v_old - eps_v, max=v_old + eps_v)
    return v_old + torch.clamp(v - v_old, min=-eps_v, max=eps_v)  # OpenRLHF, SkyRL, AReaL: can land
    # one rounding step off V


def value_terms(
    values: Tensor,
    values_old: Tensor,
    returns: Tensor,
    m: Tensor,
    *,
    eps_v: float | None,
    form: ValueClipForm,
) -> tuple[Tensor, Tensor | None]:
    """``(ℓ^v, clipped)`` of validated inputs ``[b, T]`` (module docstring; elementwise, so a block
    of rows gives that block's terms): ``ℓ^v`` is 0 on padding; ``clipped`` marks the valid tokens
    where ``(V^clip − R)² > (V − R)²`` (None for an unclipped loss, ``eps_v`` None)."""
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v_old = torch.where(m, values_old, zero).detach()
    ret = torch.where(m, returns, zero).detach()
    v = torch.where(m, values, zero)
    err_unclipped = (v - ret) ** 2
    clipped: Tensor | None = None
    if eps_v is not None:
        v_clipped = clipped_value(v, v_old, eps_v, form)
        err_clipped = (v_clipped - ret) ** 2
        per_token = 0.5 * torch.maximum(err_unclipped, err_clipped)
        with torch.no_grad():
            clipped = (err_clipped > err_unclipped) & m
    else:
        per_token = 0.5 * err_unclipped
    return torch.where(m, per_token, zero), clipped


@dataclass(frozen=True)
class ValueLossNaive:
    """What :func:`value_loss_naive` returns."""

    loss: float
    per_token: list[list[float]]
    clipfrac: float


def value_loss_naive(
    values: Tensor,
    values_old: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float | None = 0.2,
    kind: ValueLoss | str = ValueLoss.CLIPPED,
    agg: LossAgg | str = LossAgg.TOKEN_MEAN,
    token_count: float | None = None,
    seq_count: float | None = None,
    horizon: float | None = None,
    clip_form: ValueClipForm | str = ValueClipForm.AROUND_OLD,
) -> ValueLossNaive:
    """Naive twin of :func:`value_loss` (Python floats: float64 arithmetic)."""
    _checked_value_inputs(  # the same refusals as the vectorized function (the math below is separate)
        values, values_old, returns, mask, clip=clip, kind=kind, agg=agg, clip_form=clip_form
    )
    clipped = ValueLoss(kind) == ValueLoss.CLIPPED
    delta = ValueClipForm(clip_form) == ValueClipForm.DELTA
    vs, vos, rs, ms = pf.rows(values), pf.rows(values_old), pf.rows(returns), pf.mask_rows(mask)
    per_token = []
    n_valid = n_clipped = 0
    for b in range(len(ms)):
        row = []
        for t in range(len(ms[b])):
            if not ms[b][t]:
                row.append(0.0)
                continue
            n_valid += 1
            v, v_old, ret = vs[b][t], vos[b][t], rs[b][t]
            e1 = (v - ret) ** 2
            if clipped:
                assert clip is not None
                if delta:
                    v_c = v_old + min(max(v - v_old, -clip), clip)
                else:
                    v_c = min(max(v, v_old - clip), v_old + clip)
                e2 = (v_c - ret) ** 2
                if e2 > e1:
                    n_clipped += 1
                row.append(0.5 * max(e1, e2))
            else:
                row.append(0.5 * e1)
        per_token.append(row)
    total = aggregate_loss_naive(
        torch.tensor(per_token, dtype=torch.float64, device=mask.device),
        mask,
        agg,
        token_count=token_count,
        seq_count=seq_count,
        horizon=horizon,
    ).item()
    return ValueLossNaive(total, per_token, n_clipped / n_valid)
