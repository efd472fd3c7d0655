"""Generalized Advantage Estimation (Schulman et al. 2016) over right-padded responses.

For one row, let ``t_0 < t_1 < … < t_{L−1}`` be its valid positions (mask 1). Along them::

    δ_i = r_{t_i} + γ·V_{t_{i+1}} − V_{t_i}          (V_{t_L} := 0: the episode ends)
    Â_{t_i} = Σ_{l=0}^{L−1−i} (γλ)^l · δ_{i+l}        (the definition; the naive twin computes this)
            = δ_i + γλ·Â_{t_{i+1}}                    (the recursion; the vectorized path uses this)
    R_{t_i} = Â_{t_i} + V_{t_i}                       (returns: the value targets)

Padded positions are skipped, never read: their rewards and values may hold junk and the outputs
there are 0. For right-padding this equals the plain recursion with ``r, V`` zeroed on padding
(OpenRLHF ``experience_maker.get_advantages_and_returns``); with interior mask holes (multi-turn
observation tokens) the holes are transparent as in verl ``core_algos.compute_gae_advantage_return``
(PR #2337). To credit a score placed one slot after the last valid token (TRL's convention) pass a
mask that includes that slot.
"""

from __future__ import annotations

import torch

from refppo.core import _pyfloat as pf
from refppo.types import ResponseMask, TokenFloat
from refppo.validate import check_bt, check_mask, check_same_dtype, check_unit_interval


def gae(
    rewards: TokenFloat, values: TokenFloat, mask: ResponseMask, *, gamma: float, lam: float
) -> tuple[TokenFloat, TokenFloat]:
    """Advantages and returns ``([B, T], [B, T])``, both 0 at padded positions.

    Vectorized over the batch; one backward sweep over ``T`` carrying (next value, next advantage)
    across masked positions.
    """
    m = check_mask("mask", mask)
    rewards = check_bt("rewards", rewards, m)
    values = check_bt("values", values, m)
    check_same_dtype(rewards=rewards, values=values)
    gamma = check_unit_interval("gamma", gamma)
    lam = check_unit_interval("lam", lam)
    B, T = m.shape
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    r = torch.where(m, rewards, zero)
    v = torch.where(m, values, zero)
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    next_adv = torch.zeros(B, dtype=values.dtype, device=values.device)
    adv_cols = []
    for t in range(T - 1, -1, -1):
        valid = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + (gamma * lam) * next_adv
        next_value = torch.where(valid, v[:, t], next_value)
        next_adv = torch.where(valid, a, next_adv)
        adv_cols.append(torch.where(valid, a, zero))
    advantages = torch.stack(adv_cols[::-1], dim=1)
    returns = torch.where(m, advantages + v, zero)
    return advantages, returns


def gae_naive(
    rewards: TokenFloat, values: TokenFloat, mask: ResponseMask, *, gamma: float, lam: float
) -> tuple[TokenFloat, TokenFloat]:
    """Naive twin of :func:`gae`: the discounted sum of TD residuals, term by term."""
    rs, vs, ms = pf.rows(rewards), pf.rows(values), pf.mask_rows(mask)
    adv_out, ret_out = [], []
    for r_row, v_row, m_row in zip(rs, vs, ms, strict=True):
        T = len(m_row)
        valid = [t for t in range(T) if m_row[t]]
        L = len(valid)
        deltas = []
        for i in range(L):
            v_next = v_row[valid[i + 1]] if i + 1 < L else 0.0
            deltas.append(r_row[valid[i]] + gamma * v_next - v_row[valid[i]])
        adv_row, ret_row = [0.0] * T, [0.0] * T
        for i in range(L):
            a = 0.0
            for l_ in range(L - i):
                a += (gamma * lam) ** l_ * deltas[i + l_]
            adv_row[valid[i]] = a
            ret_row[valid[i]] = a + v_row[valid[i]]
        adv_out.append(adv_row)
        ret_out.append(ret_row)
    return pf.tensor_like(adv_out, values), pf.tensor_like(ret_out, values)
