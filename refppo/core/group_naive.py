"""Naive twins of :mod:`refppo.core.group`: one Python float at a time, as the papers write them.

Each response is compared with the others of its prompt by plain loops (:func:`group_advantages_naive`);
REINFORCE++'s returns are summed term by term (:func:`discounted_returns_naive`). Re-exported by
:mod:`refppo.core.group`.
"""

from __future__ import annotations

import math
from typing import Literal

from torch import Tensor

from refppo.conventions import AdvantageEstimator, GaeHoles, parse
from refppo.core import _pyfloat as pf
from refppo.core._group_checks import _check_options, _checked_group_inputs, _checked_returns_inputs
from refppo.core.checks import check_nonneg
from refppo.errors import HyperparameterError, MaskError, SingletonGroupError
from refppo.group_conventions import GroupStdLevel
from refppo.types import ResponseMask, SeqFloat, TokenFloat

Singleton = Literal["error", "score", "zero"]
WhitenEps = Literal["add", "clamp"]


def _whiten_naive(
    rows: list[list[float]], ms: list[list[bool]], unbiased: bool, eps: float, form: str
) -> list[list[float]]:
    vals = [v for row, mr in zip(rows, ms, strict=True) for v, ok in zip(row, mr, strict=True) if ok]
    n = len(vals)
    if unbiased and n < 2:
        raise MaskError(f"mask: an unbiased variance needs at least 2 valid tokens, got {n}")
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / (n - 1 if unbiased else n)
    scale = 1.0 / math.sqrt(var + eps if form == "add" else max(var, eps))
    return [
        [(v - mean) * scale if ok else 0.0 for v, ok in zip(row, mr, strict=True)]
        for row, mr in zip(rows, ms, strict=True)
    ]


def _std_naive(s: list[float], gs: list[int], i: int, level: GroupStdLevel, unbiased: bool) -> float:
    """σ of row ``i`` at ``level``: its group's scores around their mean (``group``), every score
    around the batch mean (``batch``), or every score minus its own group's mean, around 0
    (``batch-centred``)."""

    def group_mean(k: int) -> float:
        group = [x for x, g in zip(s, gs, strict=True) if g == gs[k]]
        return sum(group) / len(group)

    if level is GroupStdLevel.GROUP:
        devs = [x - group_mean(i) for x, g in zip(s, gs, strict=True) if g == gs[i]]
    elif level is GroupStdLevel.BATCH:
        devs = [x - sum(s) / len(s) for x in s]
    else:
        devs = [s[j] - group_mean(j) for j in range(len(s))]
    n = len(devs)
    return math.sqrt(sum(d * d for d in devs) / (max(n - 1, 1) if unbiased else n))


def _scalar_naive(
    s: list[float],
    gs: list[int],
    lens: list[int],
    i: int,
    est: AdvantageEstimator,
    scale: bool,
    unbiased: bool,
    eps: float,
    singleton: str,
    level: GroupStdLevel = GroupStdLevel.GROUP,
) -> float:
    """``a_i`` of one response against the others of its prompt (module docstring's table)."""
    if est is AdvantageEstimator.FLASH_REINFORCE:
        return s[i] - sum(s) / len(s)  # the batch mean: every row, no group
    alpha = len(s) / max(sum(1 for x in s if x != 0.0), 1)  # gpg: B over the non-zero scores
    members = [j for j in range(len(s)) if gs[j] == gs[i]]
    group = [s[j] for j in members]
    n = len(group)
    if n == 1:
        if singleton == "error":
            # the core's error: every lone prompt (at most 8), in row order
            ids = [g for g in gs if gs.count(g) == 1][:8]
            raise SingletonGroupError(
                ids, f"group_index: groups {ids} have one response (pass singleton='score' or 'zero')"
            )
        if singleton == "zero":
            return 0.0
        if est is AdvantageEstimator.GRPO_PASSK:
            raise HyperparameterError(
                "singleton: grpo-passk has no second-best score in a group of one;"
                " use 'error' (verl) or 'zero'"
            )
        if est is AdvantageEstimator.GPG:
            return alpha * s[i]
        return s[i] / (1.0 + eps) if (est is AdvantageEstimator.GRPO and scale) else s[i]
    mean = sum(group) / n
    std = _std_naive(s, gs, i, level, unbiased)
    if est is AdvantageEstimator.RLOO:
        return s[i] - sum(s[j] for j in members if j != i) / (n - 1)  # the mean of the OTHER responses
    if est is AdvantageEstimator.OPO:  # the group's mean score, each response weighted by its length
        return s[i] - sum(lens[j] * s[j] for j in members) / sum(lens[j] for j in members)
    if est is AdvantageEstimator.GPG:
        return alpha * (s[i] - mean)
    if est is AdvantageEstimator.GRPO_PASSK:  # only the unique best response; its margin over the 2nd
        best = max(group)
        if s[i] != best or group.count(best) > 1:
            return 0.0
        margin = best - max(x for j, x in zip(members, group, strict=True) if j != i)
        return margin / (std + eps) if scale else margin
    if est is AdvantageEstimator.GRPO and scale:
        return (s[i] - mean) / (std + eps)
    return s[i] - mean


def group_advantages_naive(
    scores: SeqFloat,
    group_index: Tensor | None,
    mask: ResponseMask,
    *,
    estimator: AdvantageEstimator | str = AdvantageEstimator.GRPO,
    scale_by_std: bool = True,
    unbiased_std: bool = True,
    eps: float = 1e-6,
    singleton: Singleton = "error",
    token_penalty: TokenFloat | None = None,
    whiten_unbiased: bool = True,
    whiten_eps: float = 1e-8,
    whiten_eps_form: WhitenEps = "add",
    std_level: GroupStdLevel | str = GroupStdLevel.GROUP,
) -> TokenFloat:
    """Naive twin of :func:`group_advantages`: each response against the others of its prompt."""
    _checked_group_inputs(  # the core's own input checks (the arithmetic below is separate)
        scores, group_index, mask, estimator=estimator, std_level=std_level, eps=eps, singleton=singleton,
        token_penalty=token_penalty, whiten_eps=whiten_eps, whiten_eps_form=whiten_eps_form,
    )  # fmt: skip
    est = parse(AdvantageEstimator, estimator)
    level = parse(GroupStdLevel, std_level, what="std_level")
    s, ms = pf.vec(scores), pf.mask_rows(mask)
    gs = [int(v) for v in group_index.tolist()] if group_index is not None else [0] * len(s)
    lens = [sum(row) for row in ms]
    pen = pf.rows(token_penalty) if token_penalty is not None else None
    out: list[list[float]] = []
    for i in range(len(s)):
        a = _scalar_naive(s, gs, lens, i, est, scale_by_std, unbiased_std, eps, singleton, level)
        row = []
        T = len(ms[i])
        for t in range(T):
            if not ms[i][t]:
                row.append(0.0)
                continue
            to_go = sum(pen[i][k] for k in range(t, T) if ms[i][k]) if pen is not None else 0.0
            row.append(a + to_go)
        out.append(row)
    if est is AdvantageEstimator.REINFORCE_PP_BASELINE:
        out = _whiten_naive(out, ms, whiten_unbiased, whiten_eps, whiten_eps_form)
    return pf.tensor_like(out, scores)


def reinforce_pp_advantages_naive(
    rewards: TokenFloat,
    mask: ResponseMask,
    *,
    gamma: float = 1.0,
    whiten_unbiased: bool = True,
    whiten_eps: float = 1e-8,
    whiten_eps_form: WhitenEps = "add",
    holes: GaeHoles | str = GaeHoles.SKIP,
) -> TokenFloat:
    """Naive twin of :func:`reinforce_pp_advantages`: :func:`discounted_returns_naive`, whitened."""
    _check_options("error", whiten_eps_form)  # the core's checks, in its order
    check_nonneg("whiten_eps", whiten_eps)
    returns = pf.rows(discounted_returns_naive(rewards, mask, gamma=gamma, holes=holes))
    ms = pf.mask_rows(mask)
    return pf.tensor_like(_whiten_naive(returns, ms, whiten_unbiased, whiten_eps, whiten_eps_form), rewards)


def discounted_returns_naive(
    rewards: TokenFloat, mask: ResponseMask, *, gamma: float = 1.0, holes: GaeHoles | str = GaeHoles.SKIP
) -> TokenFloat:
    """Naive twin of :func:`discounted_returns`: each ``R_t`` summed as its docstring's equation."""
    _checked_returns_inputs(rewards, mask, gamma, holes)  # the core's input checks
    how = GaeHoles(holes)
    rs, ms = pf.rows(rewards), pf.mask_rows(mask)
    out = []
    for r_row, m_row in zip(rs, ms, strict=True):
        valid = [t for t in range(len(m_row)) if m_row[t]]
        row = [0.0] * len(m_row)
        if how is GaeHoles.SKIP:
            for i, t in enumerate(valid):  # R_t = Σ_l γ^l r at the l-th valid position after t
                row[t] = sum(gamma**l_ * r_row[valid[i + l_]] for l_ in range(len(valid) - i))
        elif valid:
            last = valid[-1]
            for t in range(last + 1):  # every position up to the last valid one is a time step
                row[t] = sum(
                    gamma ** (k - t) * (r_row[k] if (m_row[k] or how is GaeHoles.THROUGH) else 0.0)
                    for k in range(t, last + 1)
                )
        out.append(row)
    return pf.tensor_like(out, rewards)
