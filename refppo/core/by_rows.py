"""The update stage's losses evaluated by blocks of rows, for callers without an autograd graph.

Each loss of steps 6–8 (:mod:`refppo.core.policy`, :mod:`refppo.core.gspo`,
:mod:`refppo.core.value`, :mod:`refppo.core.objective`) is a per-token term ``ℓ`` ``[B, T]``
followed by one aggregation ``agg(ℓ)`` (:func:`refppo.core.aggregate.aggregate_masked`). The
per-token terms read each row alone (elementwise ops, and GSPO's ``S_b`` reduces its own row), so
the same term functions called on a block of rows ``ℓ[i:j] = terms(x[i:j])`` give exactly the
whole batch's values there. Here they are written into ONE preallocated ``[B, T]`` buffer per
loss, and the buffer is aggregated once, over the whole tensor, by the same call as the
whole-batch function: the same values summed in the same order, so every scalar is bit for bit
the whole-batch one. Counts (clip fractions) are exact integers summed over the blocks.

Memory: the whole-batch call allocates about eight ``[B, T]`` temporaries (``d``, ``ρ``, ``−A``,
the two branches, the clamp, ``ℓ``, …); here one ``[B, T]`` buffer per output (``ℓ``, and ``ρ``
for the policy) plus the temporaries of one block. ``approx_kl = −Σd/n`` and
``approx_kl_k2 = ½·Σd²/n`` are the sums over the whole ``d``, which is written into the ``ℓ``
buffer first (then squared in place), before ``ℓ`` overwrites it.

No autograd: the buffers are written in place, so these functions refuse inputs that require a
gradient (the trainer's differentiated path keeps the whole-batch functions).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple, cast

import torch
from torch import Tensor

from refppo.conventions import KLEstimator, LossAgg, ValueClipForm, ValueLoss, parse
from refppo.core.aggregate import aggregate_masked
from refppo.core.checks import check_bt, check_mask, count_true
from refppo.core.gspo import _checked_gspo_inputs, gspo_terms
from refppo.core.kl import LogRatioClamp, token_kl
from refppo.core.policy import (
    PolicyLossOutput,
    PolicyTerms,
    _checked_policy_inputs,
    log_ratio_terms,
    policy_terms,
)
from refppo.core.value import ValueLossOutput, _checked_value_inputs, value_terms
from refppo.errors import HyperparameterError


def row_blocks(B: int, rows: int) -> Iterator[slice]:
    """Slices ``[i, i + rows)`` covering ``0 … B−1`` (the last one shorter)."""
    if rows < 1:
        raise HyperparameterError(f"rows: expected a block of at least one row, got {rows!r}")
    for i in range(0, B, rows):
        yield slice(i, min(i + rows, B))


def _no_grad(**tensors: Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{name}: requires a gradient; the row-block losses have no autograd graph")


def policy_loss_by_rows(
    rows: int,
    /,
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    gspo: bool = False,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    agg: LossAgg | str = LossAgg.TOKEN_MEAN,
    log_ratio_clamp: float | None = None,
    token_count: float | None = None,
    seq_count: float | None = None,
    horizon: float | None = None,
) -> PolicyLossOutput:
    """:func:`refppo.core.policy.clipped_policy_loss` (``gspo``:
    :func:`refppo.core.gspo.gspo_policy_loss`, ``log_ratio_clamp`` its κ, named ``log_ratio_max`` in
    its errors) by blocks of ``rows`` rows (the first argument): the same outputs bit for bit, and the
    same error for bad input (the same check function, ``_checked_policy_inputs`` /
    ``_checked_gspo_inputs``)."""
    out = _policy_loss_by_rows(
        rows, logp, logp_old, advantages, mask, gspo=gspo, clip_low=clip_low, clip_high=clip_high,
        dual_clip=dual_clip, agg=agg, log_ratio_clamp=log_ratio_clamp, token_count=token_count,
        seq_count=seq_count, horizon=horizon, keep_ratio=True,
    )  # fmt: skip
    ratio = cast(Tensor, out.ratio)  # kept: keep_ratio=True
    return PolicyLossOutput(
        out.loss, out.per_token, ratio, out.clipfrac, out.clipfrac_lower, out.approx_kl, out.approx_kl_k2
    )


class _BlockPolicyLoss(NamedTuple):
    """:class:`refppo.core.policy.PolicyLossOutput` with ``ratio`` optional (None: not kept)."""

    loss: Tensor
    per_token: Tensor
    ratio: Tensor | None
    clipfrac: Tensor
    clipfrac_lower: Tensor
    approx_kl: Tensor
    approx_kl_k2: Tensor


def _policy_loss_by_rows(
    rows: int,
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    gspo: bool,
    clip_low: float,
    clip_high: float | None,
    dual_clip: float | None,
    agg: LossAgg | str,
    log_ratio_clamp: float | None,
    token_count: float | None,
    seq_count: float | None,
    horizon: float | None,
    keep_ratio: bool,
) -> _BlockPolicyLoss:
    """:func:`policy_loss_by_rows`; ``keep_ratio`` False: the ratio ``ρ`` is not kept (``ratio``
    None), so one ``[B, T]`` buffer (``ℓ``) instead of two, for callers that read only the loss,
    ``per_token``, the clip fractions and approx_kl (the ``--detect`` search's policy stage)."""
    if gspo and dual_clip is not None:
        raise HyperparameterError("dual_clip: GSPO has no dual clip")
    # the whole-batch function's own checks (one function each: the same errors, in the same order)
    checked = (
        _checked_gspo_inputs(
            logp, logp_old, advantages, mask, clip_low=clip_low, clip_high=clip_high, agg=agg,
            log_ratio_max=log_ratio_clamp,
        )
        if gspo
        else _checked_policy_inputs(
            logp, logp_old, advantages, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
            agg=agg, log_ratio_clamp=log_ratio_clamp,
        )
    )  # fmt: skip
    logp, logp_old, advantages, m, eps_lo, eps_hi, agg_mode, k = checked
    _no_grad(logp=logp, logp_old=logp_old, advantages=advantages)

    def terms(r: slice) -> PolicyTerms:
        if gspo:
            return gspo_terms(
                logp[r], logp_old[r], advantages[r], m[r], eps_lo=eps_lo, eps_hi=eps_hi, log_ratio_max=k
            )
        return policy_terms(
            logp[r], logp_old[r], advantages[r], m[r], eps_lo=eps_lo, eps_hi=eps_hi, dual_clip=dual_clip,
            log_ratio_clamp=k,
        )  # fmt: skip

    return _block_policy_loss(
        rows, terms, logp, logp_old, m, agg_mode, dual_clip=dual_clip, token_count=token_count,
        seq_count=seq_count, horizon=horizon, keep_ratio=keep_ratio,
    )  # fmt: skip


def _block_policy_loss(
    rows: int,
    terms: Callable[[slice], PolicyTerms],
    logp: Tensor,
    logp_old: Tensor,
    m: Tensor,
    agg_mode: LossAgg,
    *,
    dual_clip: float | None,
    token_count: float | None,
    seq_count: float | None,
    horizon: float | None,
    keep_ratio: bool,
) -> _BlockPolicyLoss:
    """The outputs of :func:`_policy_loss_by_rows` from its checked inputs and ``terms`` (the
    per-token terms of one row block): ``d`` first into the ``ℓ`` buffer (its sums are
    ``approx_kl`` and ``approx_kl_k2``), then ``ℓ`` (and ``ρ``) block by block, the clip counts
    summed, and ``ℓ`` aggregated once over the whole buffer."""
    B = m.shape[0]
    with torch.no_grad():
        n = float(count_true(m))  # = m.sum(), without its int64 [B, T] copy of the mask
        per_token = torch.empty_like(logp, memory_format=torch.contiguous_format)
        for r in row_blocks(B, rows):  # d first: its sums are approx_kl's
            per_token[r] = log_ratio_terms(logp[r], logp_old[r], m[r], None)[0]
        approx_kl = -per_token.sum() / n
        approx_kl_k2 = 0.5 * per_token.mul_(per_token).sum() / n
        ratio = torch.empty_like(logp, memory_format=torch.contiguous_format) if keep_ratio else None
        n_clip = n_lower = 0
        for r in row_blocks(B, rows):
            t = terms(r)
            per_token[r] = t.per_token
            if ratio is not None:
                ratio[r] = t.ratio
            n_clip += int((t.loss2 > t.loss1).sum())
            n_lower += int(t.lower_active.sum()) if t.lower_active is not None else 0
            del t
        loss = aggregate_masked(
            per_token, m, agg_mode, token_count=token_count, seq_count=seq_count, horizon=horizon
        )
        clipfrac = _count(n_clip, logp) / n
        clipfrac_lower = _count(n_lower, logp) / n if dual_clip is not None else torch.zeros_like(loss)
    return _BlockPolicyLoss(loss, per_token, ratio, clipfrac, clipfrac_lower, approx_kl, approx_kl_k2)


def _count(n: int, like: Tensor) -> Tensor:
    """``n`` as the whole-batch code has it: an int64 count cast to ``like``'s dtype."""
    return torch.tensor(n, dtype=torch.int64, device=like.device).to(like.dtype)


def value_loss_by_rows(
    rows: int,
    /,
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
) -> ValueLossOutput:
    """:func:`refppo.core.value.value_loss` by blocks of ``rows`` rows: the same outputs bit for bit."""
    values, values_old, returns, m, eps_v, form, agg_mode = _checked_value_inputs(
        values, values_old, returns, mask, clip=clip, kind=kind, agg=agg, clip_form=clip_form
    )
    _no_grad(values=values, values_old=values_old, returns=returns)
    with torch.no_grad():
        per_token = torch.empty_like(values, memory_format=torch.contiguous_format)
        n_clip = 0
        for r in row_blocks(m.shape[0], rows):
            block, clipped = value_terms(values[r], values_old[r], returns[r], m[r], eps_v=eps_v, form=form)
            per_token[r] = block
            n_clip += int(clipped.sum()) if clipped is not None else 0
            del block, clipped
        if eps_v is None:
            clipfrac = torch.zeros((), dtype=values.dtype, device=values.device)
        else:
            clipfrac = _count(n_clip, values) / count_true(m).to(values.dtype)
        loss = aggregate_masked(
            per_token, m, agg_mode, token_count=token_count, seq_count=seq_count, horizon=horizon
        )
    return ValueLossOutput(loss, per_token, clipfrac)


def entropy_bonus_by_rows(
    rows: int, /, entropy: Tensor, mask: Tensor, agg: LossAgg | str = LossAgg.TOKEN_MEAN, **norm: float
) -> Tensor:
    """:func:`refppo.core.objective.entropy_bonus` by blocks of ``rows`` rows (bit for bit)."""
    agg_mode = parse(LossAgg, agg, what="loss_agg")
    m = check_mask("mask", mask)
    entropy = check_bt("loss_mat", entropy, m)
    _no_grad(entropy=entropy)
    zero = torch.zeros((), dtype=entropy.dtype, device=entropy.device)
    with torch.no_grad():
        lm = torch.empty_like(entropy, memory_format=torch.contiguous_format)
        for r in row_blocks(m.shape[0], rows):
            lm[r] = torch.where(m[r], entropy[r], zero)
        return aggregate_masked(lm, m, agg_mode, **norm)


def kl_loss_by_rows(
    rows: int,
    /,
    logp: Tensor,
    logp_ref: Tensor,
    mask: Tensor,
    estimator: KLEstimator | str = KLEstimator.K3,
    agg: LossAgg | str = LossAgg.TOKEN_MEAN,
    *,
    log_ratio_clamp: LogRatioClamp | None = None,
    value_clamp: float | None = None,
    **norm: float,
) -> Tensor:
    """:func:`refppo.core.objective.kl_loss` by blocks of ``rows`` rows (bit for bit)."""
    agg_mode = parse(LossAgg, agg, what="loss_agg")
    m = check_mask("mask", mask)
    logp = check_bt("logp", logp, m)
    logp_ref = check_bt("logp_ref", logp_ref, m)
    _no_grad(logp=logp, logp_ref=logp_ref)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    with torch.no_grad():
        lm = torch.empty_like(logp, memory_format=torch.contiguous_format)
        for r in row_blocks(m.shape[0], rows):
            kl = token_kl(
                logp[r],
                logp_ref[r],
                m[r],
                estimator,
                log_ratio_clamp=log_ratio_clamp,
                value_clamp=value_clamp,
            )
            lm[r] = torch.where(m[r], kl, zero)
        return aggregate_masked(lm, m, agg_mode, **norm)
