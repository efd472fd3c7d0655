"""Token-level rewards: the score on one token, the KL penalty on every valid token.

For a row with valid length ``L`` (mask ``m``), score ``s``, per-token KL ``k_t`` and coefficient β::

    r_t = s·[t == p(L)] − β·k_t·m_t        (m_t: ``kl_mask`` when given: DeepSpeed-Chat's KL at
                                            the score slot too, :class:`~refppo.conventions.ScoreSlotKL`)

where ``p(L)`` is the score position of :class:`~refppo.conventions.ScorePosition`::

    position      0   1   2  ...  L-1   L   ...  T-1
    mask          1   1   1  ...   1    0   ...   0
    last_valid                     s                    r = [-βk_0, ..., -βk_{L-2}, s-βk_{L-1}, 0...]
    after_last_valid                    s               (TRL, DeepSpeed-Chat; L-1 when L == T)
    last_position                                  s    (lm-human-preferences)
    after_last_valid_unless_first       s               (torchtune; L-1 when L == T or L-1 == 0)

The KL passed in is the rollout-time one (old policy vs reference; InstructGPT eq. 2; verl
``ray_trainer.apply_kl_penalty``; OpenRLHF ``models/utils.py::compute_reward``). With KL placed in
the loss instead (:class:`~refppo.conventions.KLPlacement` ``loss``) pass ``kl=None``: the reward is
the score alone. Hence per row ``Σ_t r_t = s − β·Σ_t m_t k_t``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from refppo.conventions import ScorePosition, parse
from refppo.core import _pyfloat as pf
from refppo.core.checks import check_b, check_bt, check_mask, check_nonneg, check_same_dtype
from refppo.errors import ShapeError
from refppo.types import ResponseMask, SeqFloat, TokenFloat


def score_positions(mask: ResponseMask, score_at: ScorePosition | str = ScorePosition.LAST_VALID) -> Tensor:
    """Index ``[B]`` (int64) of the position that receives each row's score (see module docstring).

    ``last_valid`` is the last position where the mask is 1 (also with interior holes).
    """
    where = parse(ScorePosition, score_at, what="score_at")
    m = check_mask("mask", mask)
    return _score_positions(m, where)


def _score_positions(m: Tensor, where: ScorePosition) -> Tensor:
    """:func:`score_positions` on an already validated bool mask."""
    B, T = m.shape
    # the first 1 of the reversed row is the last valid position (argmax returns the first maximum);
    # a uint8 view of the bool mask: no [B, T] int64 buffer. A row without a valid token gives -1.
    flipped = m.flip(1).view(torch.uint8)
    last_valid = torch.where(flipped.amax(dim=1) > 0, (T - 1) - flipped.argmax(dim=1), -1)
    if where is ScorePosition.LAST_VALID:
        return last_valid
    if where is ScorePosition.AFTER_LAST_VALID:
        return torch.clamp(last_valid + 1, max=T - 1)
    if where is ScorePosition.AFTER_LAST_VALID_UNLESS_FIRST:  # ℓ + 1 if 0 < ℓ < T − 1 else ℓ
        return torch.where((last_valid > 0) & (last_valid < T - 1), last_valid + 1, last_valid)
    return torch.full((B,), T - 1, dtype=torch.long, device=m.device)


def _checked_reward_inputs(
    scores: SeqFloat,
    kl: TokenFloat | None,
    mask: ResponseMask,
    beta: float,
    score_at: ScorePosition | str,
    kl_mask: ResponseMask | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, ScorePosition]:
    """:func:`token_rewards`' inputs checked in one place (shared with :func:`token_rewards_naive`,
    so a bad input gets the same error from both): ``(mask, scores, kl, score_at)``; ``kl_mask``, when
    given, a ``[B, T]`` mask of the mask's shape."""
    m = check_mask("mask", mask)
    if kl_mask is not None:
        km = check_mask("kl_mask", kl_mask)
        if km.shape != m.shape:
            raise ShapeError(f"kl_mask: expected shape {list(m.shape)} (the mask's), got {list(km.shape)}")
    B, _ = m.shape
    scores = check_b("scores", scores, B, m.device)
    check_nonneg("beta", beta)
    where = parse(ScorePosition, score_at, what="score_at")
    if kl is not None:
        kl = check_bt("kl", kl, m)
        check_same_dtype(scores=scores, kl=kl)
    return m, scores, kl, where


def token_rewards(
    scores: SeqFloat,
    kl: TokenFloat | None,
    mask: ResponseMask,
    beta: float,
    *,
    score_at: ScorePosition | str = ScorePosition.LAST_VALID,
    kl_mask: ResponseMask | None = None,
) -> TokenFloat:
    """``r[b, t] = s_b·[t == p_b] − β·kl[b, t]·m'[b, t]``, ``[B, T]``, ``m'`` = ``kl_mask`` (None:
    ``mask``; the score position is always ``mask``'s).

    Only the score slot may be non-zero outside the mask (``after_last_valid``/``last_position``).
    """
    m, scores, kl, where = _checked_reward_inputs(scores, kl, mask, beta, score_at, kl_mask)
    pos = _score_positions(m, where)
    zero = torch.zeros((), dtype=scores.dtype, device=scores.device)
    if kl is None:
        r = torch.zeros(m.shape, dtype=scores.dtype, device=m.device)
    else:
        km = m if kl_mask is None else check_mask("kl_mask", kl_mask)
        r = torch.where(km, -beta * kl, zero)
    # r[b, p_b] += s_b (one score slot per row).
    return r.scatter_add(1, pos.unsqueeze(1), scores.unsqueeze(1))


def token_rewards_naive(
    scores: SeqFloat,
    kl: TokenFloat | None,
    mask: ResponseMask,
    beta: float,
    *,
    score_at: ScorePosition | str = ScorePosition.LAST_VALID,
    kl_mask: ResponseMask | None = None,
) -> TokenFloat:
    """Naive twin of :func:`token_rewards`: build each row as ``[0, …, 0, s] − β·KL`` (the KL where
    ``kl_mask`` is 1, default the mask)."""
    where = _checked_reward_inputs(scores, kl, mask, beta, score_at, kl_mask)[3]  # the core's checks
    ms = pf.mask_rows(mask)
    kms = ms if kl_mask is None else pf.mask_rows(kl_mask)
    ss = pf.vec(scores)
    ks = pf.rows(kl) if kl is not None else [[0.0] * len(row) for row in ms]
    out = []
    for s, krow, mrow, kmrow in zip(ss, ks, ms, kms, strict=True):
        T = len(mrow)
        last = max(t for t in range(T) if mrow[t])
        if where == ScorePosition.LAST_VALID:
            p = last
        elif where == ScorePosition.AFTER_LAST_VALID:
            p = last + 1 if last + 1 < T else last
        elif where == ScorePosition.AFTER_LAST_VALID_UNLESS_FIRST:
            p = last if last == 0 or last + 1 == T else last + 1
        else:
            p = T - 1
        row = []
        for t in range(T):
            value = -beta * krow[t] if kmrow[t] else 0.0
            if t == p:
                value += s
            row.append(value)
        out.append(row)
    return pf.tensor_like(out, scores)
