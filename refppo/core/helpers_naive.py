"""Naive twins of the small public helpers of the core that had none (for ``refppo verify``).

Each is a step-by-step loop restatement over Python values, written from the docstring's
equation, independent of the vectorized code:

* :func:`score_positions_naive` (of :func:`refppo.core.rewards.score_positions`): the index
  ``p_b`` of the slot receiving row ``b``'s score: its last valid position (``last_valid``), one
  after it unless that is past the end (``after_last_valid``; also unless it is position 0:
  ``after_last_valid_unless_first``), or ``T − 1`` (``last_position``).
* :func:`envelope_naive` (of :func:`refppo.core.gae.envelope`): ``e[b, t] = any(m[b, t:])``.
* :func:`has_holes_naive` (of :func:`refppo.core.gae.has_holes`): whether some row has a valid
  token after a masked one.
* :func:`group_scalar_advantages_naive` (of :func:`refppo.core.group.group_scalar_advantages`):
  ``a_i`` of each row against the others of its prompt, by the loops of
  :mod:`refppo.core.group_naive` (the table of :mod:`refppo.core.group`'s docstring).
"""

from __future__ import annotations

from torch import Tensor

from refppo.conventions import AdvantageEstimator, ScorePosition, parse
from refppo.core import _pyfloat as pf
from refppo.core._group_checks import _check_scalar_inputs, _checked_group_index
from refppo.core.checks import check_mask
from refppo.core.group_naive import Singleton, _scalar_naive
from refppo.group_conventions import GroupStdLevel


def score_positions_naive(
    mask: Tensor, score_at: ScorePosition | str = ScorePosition.LAST_VALID
) -> list[int]:
    """``p_b`` for each row: scan the row for its last valid position, then apply ``score_at``."""
    check_mask("mask", mask)  # a row without a valid token is an error, as in the core
    where = parse(ScorePosition, score_at, what="score_at")
    out = []
    for row in pf.mask_rows(mask):
        T = len(row)
        last = -1
        for t in range(T):
            if row[t]:
                last = t
        if where == ScorePosition.LAST_VALID:
            out.append(last)
        elif where == ScorePosition.AFTER_LAST_VALID:
            out.append(last + 1 if last + 1 < T else T - 1)
        elif where == ScorePosition.AFTER_LAST_VALID_UNLESS_FIRST:  # a one-token row keeps slot 0
            out.append(last + 1 if 0 < last < T - 1 else last)
        else:
            out.append(T - 1)
    return out


def envelope_naive(mask: Tensor) -> list[list[bool]]:
    """``e[b][t]``: is any of ``m[b][t], m[b][t+1], …`` valid (every position up to the last valid one)."""
    check_mask("mask", mask, require_nonempty_rows=False)  # as the core's envelope
    out = []
    for row in pf.mask_rows(mask):
        out.append([any(row[k] for k in range(t, len(row))) for t in range(len(row))])
    return out


def has_holes_naive(mask: Tensor) -> bool:
    """Whether a row has a valid token right after a masked one (an interior hole)."""
    check_mask("mask", mask, require_nonempty_rows=False)  # as the core's has_holes
    for row in pf.mask_rows(mask):
        for t in range(1, len(row)):
            if row[t] and not row[t - 1]:
                return True
    return False


def group_scalar_advantages_naive(
    scores: Tensor,
    group_index: Tensor | None,
    *,
    estimator: AdvantageEstimator | str = AdvantageEstimator.GRPO,
    scale_by_std: bool = True,
    unbiased_std: bool = True,
    eps: float = 1e-6,
    singleton: Singleton = "error",
    lengths: Tensor | None = None,
    std_level: GroupStdLevel | str = GroupStdLevel.GROUP,
) -> list[float]:
    """``a_i`` for each row ``i``, one at a time.

    ``reinforce++-baseline`` gives the centred score ``s_i − μ_G`` (its whitening is token-level).
    """
    est = parse(AdvantageEstimator, estimator, what="estimator")
    level = parse(GroupStdLevel, std_level, what="std_level")
    # the core's own input checks (NaN/inf, negative or fractional lengths refused as there)
    _checked_group_index(est, group_index, _check_scalar_inputs(est, scores, eps, singleton, lengths))
    s = pf.vec(scores)
    gs = [int(v) for v in group_index.tolist()] if group_index is not None else [0] * len(s)
    lens = [int(v) for v in pf.vec(lengths)] if lengths is not None else [1] * len(s)
    return [
        _scalar_naive(s, gs, lens, i, est, scale_by_std, unbiased_std, eps, singleton, level)
        for i in range(len(s))
    ]


__all__ = [
    "envelope_naive",
    "group_scalar_advantages_naive",
    "has_holes_naive",
    "score_positions_naive",
]
