"""Loss aggregation: a ``[B, T]`` per-token loss matrix ``L`` with mask ``m`` becomes a scalar.

======================== ======================================= ===========================
mode                     value                                   default normalisers
======================== ======================================= ===========================
token-mean               ``Σ_bt m L / N_tok``                    ``N_tok = Σ_bt m``
seq-mean-token-mean      ``Σ_b (Σ_t m L / Σ_t m) / N_seq``        ``N_seq = B``
seq-mean-token-sum       ``Σ_bt m L / N_seq``                    ``N_seq = B``
seq-mean-token-sum-norm  ``Σ_b (Σ_t m L / H) / N_seq``          ``H = T`` (a constant horizon),
                                                                 ``N_seq = B``
token-sum                ``Σ_bt m L``                            none (verl ``token-sum``)
prompt-mean              ``Σ_b (Σ_t m L) / (P·N_p(b))``          ``N_p = Σ_{b∈p,t} m``, ``P`` =
                                                                 the distinct prompts (``Prompts``)
======================== ======================================= ===========================

Names and formulas as verl 0.9.1 ``verl/trainer/ppo/core_algos.py::agg_loss``. The
``seq-mean-token-sum-norm`` mode (Dr. GRPO) is a *mean over sequences* of each row's token sum over
the constant ``H``, as verl 0.9.1 ``agg_loss`` (``masked_sum(seq_losses) / global_batch_size``, then
``/ loss_scale_factor``) and SkyRL-train 0.3.1 ``skyrl_train/utils/ppo_utils.py::reduce_loss``
(``seq_mean_token_sum_norm``: row sum / ``max_seq_len``, then ``mean`` over rows). Older verl
releases divided the whole-batch sum by ``loss_mask.shape[-1]`` without the mean over sequences
(verl issue #3741); no peer release checked here still does. ``token_count`` and
``seq_count`` let a caller that splits one optimizer step into micro-batches (and/or ranks) pass
the *global* normalisers so that the sum of the micro-batch losses is exactly the loss of the
whole batch — the bug class of verl issue #5625 (a mean of micro-batch means is not a token mean).

The prompt-level mean (SkyRL 0.4.0 ``loss_reduction="prompt_mean"``, ``prompt-mean``) reads the
prompt of each row as well (:class:`Prompts`): each row's token sum over ``P·N_p`` of its prompt ``p``.
Split over micro-batches or ranks, ``Prompts.tokens`` carries the step's ``N_p`` by prompt id (and so
``P``): each piece's loss is then its rows' share, and the pieces sum to the whole step's loss even
when a prompt's rows lie in several pieces (SkyRL scales each advantage by ``1/(P·N_p)`` once per
mini-batch, then sums). Without :class:`Prompts` the mode is refused (one line naming ``loss_agg``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from refppo.conventions import LossAgg, parse
from refppo.core import _pyfloat as pf
from refppo.core._group_checks import _check_group_index
from refppo.core.checks import check_bt, check_mask, check_positive, count_true
from refppo.errors import ConventionError
from refppo.types import ResponseMask, Scalar, TokenFloat


@dataclass(frozen=True, eq=False)
class Prompts:
    """The prompt of each row, read by ``prompt-mean`` only.

    ``groups`` ``[B]`` integer prompt ids (``group_index``; a prompt's rows need not be adjacent);
    ``tokens``: the whole step's valid-token count ``N_p`` of every prompt id, ``((id, N_p), ...)``
    (``P`` = its length), when the step is split into micro-batches or ranks; None: the batch's own.
    """

    groups: Tensor
    tokens: tuple[tuple[int, float], ...] | None = None


def _prompt_divisors(m: Tensor, prompts: Prompts) -> Tensor:
    """``P·N_p(b)`` of each row ``[B]`` (``m`` a validated mask; the module docstring)."""
    g = _check_group_index(prompts.groups, int(m.shape[0]), m.device)
    if prompts.tokens is None:
        _, inv = torch.unique(g, return_inverse=True)
        n_groups = int(inv.max()) + 1
        zeros = torch.zeros(n_groups, dtype=torch.float64, device=m.device)
        counts = zeros.index_add(0, inv, count_true(m, 1).to(torch.float64))
        return counts[inv] * float(n_groups)
    table = dict(prompts.tokens)
    missing = sorted({int(x) for x in g.tolist()} - set(table))
    if missing:
        raise ConventionError(f"group_index: prompt ids {missing[:8]} are not in the step's prompt table")
    n = [check_positive("prompt tokens", float(table[int(x)])) for x in g.tolist()]
    return torch.tensor(n, dtype=torch.float64, device=m.device) * float(len(table))


def aggregate_loss(
    loss_mat: TokenFloat,
    mask: ResponseMask,
    mode: LossAgg | str = LossAgg.TOKEN_MEAN,
    *,
    token_count: float | None = None,
    seq_count: float | None = None,
    horizon: float | None = None,
) -> Scalar:
    """Aggregate ``loss_mat`` ``[B, T]`` over its valid tokens by ``mode`` (0-dim result);
    ``prompt-mean`` is refused here (it reads the prompts: :func:`prompt_mean_masked`)."""
    agg = parse(LossAgg, mode, what="loss_agg")
    m = check_mask("mask", mask)
    loss_mat = check_bt("loss_mat", loss_mat, m)
    zero = torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device)
    lm: Tensor = torch.where(m, loss_mat, zero)
    return aggregate_masked(lm, m, agg, token_count=token_count, seq_count=seq_count, horizon=horizon)


def aggregate_masked(
    lm: Tensor,
    m: Tensor,
    agg: LossAgg,
    *,
    token_count: float | None = None,
    seq_count: float | None = None,
    horizon: float | None = None,
) -> Scalar:
    """:func:`aggregate_loss` for callers inside the core that already validated their inputs.

    ``lm`` must already be 0 at padded positions and ``m`` a validated bool mask without empty
    rows; only the normalisers are checked here. (Saves re-validating the mask per loss term.)
    """
    B, T = m.shape
    tc, sc, hc = _checked_norms(agg, token_count, seq_count, horizon)
    if agg is LossAgg.TOKEN_MEAN:
        n_tok = float(count_true(m)) if tc is None else tc
        return lm.sum() / n_tok
    if agg is LossAgg.TOKEN_SUM:
        return lm.sum()
    n_seq = sc if sc is not None else float(B)
    if agg is LossAgg.SEQ_MEAN_TOKEN_MEAN:
        per_seq = lm.sum(dim=1) / count_true(m, 1).to(lm.dtype)
        return per_seq.sum() / n_seq
    if agg is LossAgg.SEQ_MEAN_TOKEN_SUM:
        return lm.sum() / n_seq
    h = hc if hc is not None else float(T)
    return lm.sum() / n_seq / h


def _checked_norms(
    agg: LossAgg,
    token_count: float | None,
    seq_count: float | None,
    horizon: float | None,
) -> tuple[float | None, float | None, float | None]:
    """The global normalisers ``agg`` reads, each checked finite and > 0 (None where not given or
    not read): ``token_count`` (token-mean), ``seq_count`` (the seq-* modes), ``horizon``
    (seq-mean-token-sum-norm); ``prompt-mean`` is refused (it reads the prompts of the rows:
    :func:`prompt_mean_masked`, :func:`prompt_mean_naive`). Shared by
    :func:`aggregate_masked` and the naive twins, so a bad normaliser gets the same error from each."""
    if agg is LossAgg.PROMPT_MEAN:
        raise ConventionError(
            "loss_agg=prompt-mean needs the prompt of each row (group_index [B]), not given to this term"
        )
    tc = sc = h = None
    if agg is LossAgg.TOKEN_MEAN and token_count is not None:
        tc = check_positive("token_count", token_count)
    if agg not in (LossAgg.TOKEN_MEAN, LossAgg.TOKEN_SUM, LossAgg.PROMPT_MEAN) and seq_count is not None:
        sc = check_positive("seq_count", seq_count)
    if agg is LossAgg.SEQ_MEAN_TOKEN_SUM_NORM and horizon is not None:
        h = check_positive("horizon", horizon)
    return tc, sc, h


def aggregate_loss_naive(
    loss_mat: TokenFloat,
    mask: ResponseMask,
    mode: LossAgg | str = LossAgg.TOKEN_MEAN,
    *,
    token_count: float | None = None,
    seq_count: float | None = None,
    horizon: float | None = None,
) -> Scalar:
    """Naive twin of :func:`aggregate_loss`."""
    agg = parse(LossAgg, mode, what="loss_agg")  # the core's checks (the sums below are separate)
    check_bt("loss_mat", loss_mat, check_mask("mask", mask))
    _checked_norms(agg, token_count, seq_count, horizon)
    ls, ms = pf.rows(loss_mat), pf.mask_rows(mask)
    seq_sums, seq_lens = [], []
    for lrow, mrow in zip(ls, ms, strict=True):
        s, n = 0.0, 0
        for value, ok in zip(lrow, mrow, strict=True):
            if ok:
                s += value
                n += 1
        seq_sums.append(s)
        seq_lens.append(n)
    B, T = len(ms), len(ms[0])
    if agg == LossAgg.TOKEN_SUM:
        result = sum(seq_sums)
    elif agg == LossAgg.TOKEN_MEAN:
        result = sum(seq_sums) / (token_count if token_count is not None else sum(seq_lens))
    elif agg == LossAgg.SEQ_MEAN_TOKEN_MEAN:
        result = sum(s / n for s, n in zip(seq_sums, seq_lens, strict=True)) / (
            seq_count if seq_count is not None else B
        )
    elif agg == LossAgg.SEQ_MEAN_TOKEN_SUM:
        result = sum(seq_sums) / (seq_count if seq_count is not None else B)
    else:  # seq-mean-token-sum-norm: the mean over sequences of (row sum / H)
        h = horizon if horizon is not None else T
        result = sum(s / h for s in seq_sums) / (seq_count if seq_count is not None else B)
    return pf.tensor_like(result, loss_mat)


def agg_weights_naive(
    mask: Tensor,
    agg: LossAgg | str = LossAgg.TOKEN_MEAN,
    *,
    token_count: float | None = None,
    seq_count: float | None = None,
    horizon: float | None = None,
) -> list[list[float]]:
    """``w(b,t) = ∂agg(L)/∂L[b,t]`` (module docstring); 0 at padded positions."""
    mode = parse(LossAgg, agg, what="loss_agg")  # aggregate_loss's checks, in its order
    check_mask("mask", mask)
    _checked_norms(mode, token_count, seq_count, horizon)
    ms = pf.mask_rows(mask)
    B, T = len(ms), len(ms[0])
    n_tok = token_count if token_count is not None else float(sum(sum(r) for r in ms))
    n_seq = seq_count if seq_count is not None else float(B)
    h = horizon if horizon is not None else float(T)
    out: list[list[float]] = []
    for row in ms:
        length = sum(row)
        if mode == LossAgg.TOKEN_MEAN:
            w = 1.0 / n_tok
        elif mode == LossAgg.TOKEN_SUM:
            w = 1.0
        elif mode == LossAgg.SEQ_MEAN_TOKEN_MEAN:
            w = 1.0 / (length * n_seq)
        elif mode == LossAgg.SEQ_MEAN_TOKEN_SUM:
            w = 1.0 / n_seq
        else:  # seq-mean-token-sum-norm
            w = 1.0 / (h * n_seq)
        out.append([w if ok else 0.0 for ok in row])
    return out


def prompt_mean_masked(lm: Tensor, m: Tensor, prompts: Prompts) -> Scalar:
    """``prompt-mean`` of ``lm`` ``[B, T]`` (0 on padding; ``m`` a validated mask): ``Σ_b (Σ_t lm) /
    (P·N_p(b))`` (:func:`_prompt_divisors`; the module docstring for a split step)."""
    return (lm.sum(dim=1) / _prompt_divisors(m, prompts).to(lm.dtype)).sum()


def prompt_mean_naive(loss_mat: TokenFloat, mask: ResponseMask, prompts: Prompts) -> Scalar:
    """Naive twin of :func:`prompt_mean_masked` (any ``loss_mat``: padding is skipped), token by token
    on :func:`prompt_weights_naive`."""
    check_bt("loss_mat", loss_mat, check_mask("mask", mask))
    w = prompt_weights_naive(mask, prompts)
    total = 0.0
    for lrow, wrow in zip(pf.rows(loss_mat), w, strict=True):
        for value, wt in zip(lrow, wrow, strict=True):
            if wt:
                total += value * wt
    return pf.tensor_like(total, loss_mat)


def prompt_weights_naive(mask: Tensor, prompts: Prompts) -> list[list[float]]:
    """``1/(P·N_p(b))`` at each valid token of row ``b``, 0 on padding: ``N_p`` counted row by row
    (or read from ``prompts.tokens``), ``P`` the distinct ids (or the table's length)."""
    check_mask("mask", mask)
    _check_group_index(prompts.groups, int(mask.shape[0]), mask.device)
    ids = [int(x) for x in prompts.groups.tolist()]
    ms = pf.mask_rows(mask)
    if prompts.tokens is None:
        lens: dict[int, float] = {}
        for row, g in zip(ms, ids, strict=True):
            lens[g] = lens.get(g, 0.0) + sum(row)
    else:
        lens = {int(k): float(v) for k, v in prompts.tokens}
        missing = sorted(set(ids) - set(lens))
        if missing:
            raise ConventionError(f"group_index: prompt ids {missing[:8]} are not in the step's prompt table")
        for g in ids:
            check_positive("prompt tokens", lens[g])
    p = float(len(lens))
    return [[1.0 / (p * lens[g]) if ok else 0.0 for ok in row] for row, g in zip(ms, ids, strict=True)]


def prompt_mean_loss(
    loss_mat: TokenFloat, mask: ResponseMask, groups: Tensor, *, prompt_count: float | None = None
) -> Scalar:
    """The prompt-level mean: the token mean within each prompt's rows, then the mean over prompts.

    ``(1/P) Σ_p S_p / N_p`` with ``S_p = Σ_{b∈p,t} m L``, ``N_p = Σ_{b∈p,t} m`` (``loss_mat``, ``mask``
    ``[B, T]``; ``groups`` ``[B]`` integer prompt ids, rows of a prompt need not be adjacent); ``P`` =
    ``prompt_count`` (the global count when a step is split, each prompt's rows kept in one piece)
    or the distinct ids. ``∂/∂L[b,t] = m/(P·N_p)``. SkyRL 0.4.0
    ``skyrl/backends/skyrl_train/utils/ppo_utils.py::apply_loss_reduction_to_advantages_minibatch``
    (``prompt_mean``: advantages scaled by ``1/(P·N_p)``, then summed).
    """
    m = check_mask("mask", mask)
    loss_mat = check_bt("loss_mat", loss_mat, m)
    g = _check_group_index(groups, int(m.shape[0]), m.device)
    pc = None if prompt_count is None else check_positive("prompt_count", prompt_count)
    zero = torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device)
    lm = torch.where(m, loss_mat, zero)
    _, inv = torch.unique(g, return_inverse=True)
    n_groups = int(inv.max()) + 1
    zeros = torch.zeros(n_groups, dtype=lm.dtype, device=lm.device)
    sums = zeros.index_add(0, inv, lm.sum(dim=1))
    counts = zeros.index_add(0, inv, count_true(m, 1).to(lm.dtype))
    return (sums / counts).sum() / (float(n_groups) if pc is None else pc)


def _prompt_lengths(
    mask: Tensor, groups: Tensor, prompt_count: float | None
) -> tuple[list[int], dict[int, int], float]:
    """:func:`prompt_mean_loss`'s checks, then the prompt of each row, ``N_p`` by prompt and ``P``."""
    check_mask("mask", mask)
    _check_group_index(groups, int(mask.shape[0]), mask.device)
    pc = None if prompt_count is None else check_positive("prompt_count", prompt_count)
    ids = [int(x) for x in groups.tolist()]
    lens: dict[int, int] = {}
    for row, g in zip(pf.mask_rows(mask), ids, strict=True):
        lens[g] = lens.get(g, 0) + sum(row)
    return ids, lens, float(len(lens)) if pc is None else pc


def prompt_mean_loss_naive(
    loss_mat: TokenFloat, mask: ResponseMask, groups: Tensor, *, prompt_count: float | None = None
) -> Scalar:
    """Naive twin of :func:`prompt_mean_loss`: prompt by prompt, in order of first appearance."""
    check_bt("loss_mat", loss_mat, check_mask("mask", mask))
    ids, lens, p = _prompt_lengths(mask, groups, prompt_count)
    sums: dict[int, float] = {}
    for lrow, mrow, g in zip(pf.rows(loss_mat), pf.mask_rows(mask), ids, strict=True):
        for value, ok in zip(lrow, mrow, strict=True):
            if ok:
                sums[g] = sums.get(g, 0.0) + value
    total = 0.0
    for g, s in sums.items():
        total += s / lens[g]
    return pf.tensor_like(total / p, loss_mat)


def prompt_mean_weights_naive(
    mask: Tensor, groups: Tensor, *, prompt_count: float | None = None
) -> list[list[float]]:
    """``∂prompt_mean_loss/∂L[b,t] = 1/(P·N_p)`` on the valid tokens of prompt ``p``'s rows, else 0."""
    ids, lens, p = _prompt_lengths(mask, groups, prompt_count)
    return [
        [1.0 / (p * lens[g]) if ok else 0.0 for ok in row]
        for row, g in zip(pf.mask_rows(mask), ids, strict=True)
    ]
