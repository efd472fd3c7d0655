"""Generalized Advantage Estimation (Schulman et al. 2016) over right-padded responses, with holes.

For one row, let ``t_0 < t_1 < … < t_{L−1}`` be its valid positions (mask 1). Along them::

    δ_i = r_{t_i} + γ·V_{t_{i+1}} − V_{t_i}          (V_{t_L} := b: 0, the episode ends, or the
                                                      bootstrap value of a truncated row)
    Â_{t_i} = Σ_{l=0}^{L−1−i} (γλ)^l · δ_{i+l}        (the definition; the naive twin computes this)
            = δ_i + γλ·Â_{t_{i+1}}                    (the recursion)
    R_{t_i} = Â_{t_i} + V_{t_i}                       (returns: the value targets)

Padded positions are skipped, never read: their rewards and values may hold junk and the outputs
there are 0. For right-padding this equals the plain recursion with ``r, V`` zeroed on padding
(OpenRLHF ``experience_maker.get_advantages_and_returns``); with interior mask holes (multi-turn
observation tokens) the holes are transparent as in verl ``core_algos.compute_gae_advantage_return``
(PR #2337). To credit a score placed one slot after the last valid token (TRL's convention) pass a
mask that includes that slot.

Interior holes (``holes``, :class:`~refppo.conventions.GaeHoles`): the above is ``skip``. ``zero``
and ``through`` run the plain recursion over every position of the row's *envelope* ``e`` (the
positions up to its last valid one, :func:`envelope`), reading on the holes 0 (``zero``: r and V
zeroed, OpenRLHF) or the given ``r, V`` (``through``: SkyRL); their outputs are non-zero on the
holes (what the recursion left there) and 0 beyond the envelope. With no holes ``e = m`` and all
three are the same computation.

Truncated rows (``last_values`` ``b`` ``[B]``, :class:`~refppo.conventions.GaeBootstrap`): the
value after a row's last valid token, ``V_{t_L} = b``, enters its last TD residual, so
``δ_{L−1} = r_{t_{L−1}} + γ·b − V_{t_{L−1}}`` and every ``Â_{t_i}`` gains ``(γλ)^{L−1−i}·γ·b``.
The caller passes ``b = 0`` on rows that ended (EOS) and the critic's ``V(s_L)`` on rows cut at the
generation limit (AReaL 1.0.4 ``areal/trainer/ppo/actor.py::PPOActor._compute_advantages``:
``nextvalues = values[:, max_seqlen − 1] * seq_no_eos_mask``). None: ``b = 0`` on every row.
"""

from __future__ import annotations

import torch
from torch import Tensor

from refppo.conventions import GaeHoles, parse
from refppo.core import _pyfloat as pf
from refppo.core.checks import check_b, check_bt, check_mask, check_same_dtype, check_unit_interval
from refppo.types import ResponseMask, SeqFloat, TokenFloat


def _discounted_reverse_cumsum(x: Tensor, g: float) -> Tensor:
    """``y_t = Σ_{k≥t} g^{k−t}·x_k`` along dim 1 of ``x`` ``[B, T]``, in ``⌈log₂ T⌉`` steps.

    A Hillis–Steele scan: after the steps with shifts ``s = 1, 2, 4, …`` each ``y_t`` holds the sum
    over ``k ∈ [t, t + 2s)``. Elementwise operations only (no BLAS reduction whose rounding could
    depend on a row's position in the batch), so every row's result is bitwise independent of the
    other rows. Stops early once ``g^s`` underflows (then no further term can contribute).
    """
    T = x.shape[1]
    tiny = torch.finfo(x.dtype).tiny
    y = x
    shift = 1
    while shift < T:
        factor = g**shift
        if factor < tiny:
            break
        y = y + factor * torch.nn.functional.pad(y[:, shift:], (0, shift))
        shift *= 2
    return y


def envelope(mask: Tensor) -> Tensor:
    """``e[b, t] = any(m[b, t:])``, bool ``[B, T]``: every position up to each row's last valid one.

    Equal to ``m`` for a right-padded mask; with interior holes it fills them (the right-padded
    ``response_mask`` of a multi-turn row whose ``loss_mask`` has the holes).
    """
    m = check_mask("mask", mask, require_nonempty_rows=False)
    return m.to(torch.uint8).flip(1).cummax(dim=1).values.flip(1).to(torch.bool)


def has_holes(mask: Tensor) -> bool:
    """Whether a row of the ``[B, T]`` mask has an interior hole (a valid token after a masked one).

    The mask is checked as :func:`envelope`'s (a bool mask passes through untouched; 0/1 integers
    or floats become bool, anything else is one ``MaskError``: ``~`` on a mask of 2s miscounted)."""
    m = check_mask("mask", mask, require_nonempty_rows=False)
    return bool((m[:, 1:] & ~m[:, :-1]).any())


def _checked_gae_inputs(
    rewards: TokenFloat,
    values: TokenFloat,
    mask: ResponseMask,
    gamma: float,
    lam: float,
    holes: GaeHoles | str,
    last_values: Tensor | None = None,
) -> tuple[GaeHoles, Tensor, Tensor, Tensor, float, float]:
    """:func:`gae`'s inputs checked in one place (shared with :func:`gae_naive`, so a bad input gets
    the same error from both): ``(holes, rewards, values, mask, γ, λ)``; ``last_values`` ``[B]`` of
    the values' dtype, when given."""
    how = parse(GaeHoles, holes, what="gae_holes")
    m = check_mask("mask", mask)
    rewards = check_bt("rewards", rewards, m)
    values = check_bt("values", values, m)
    check_same_dtype(rewards=rewards, values=values)
    if last_values is not None:
        check_b("last_values", last_values, m.shape[0], m.device)
        check_same_dtype(values=values, last_values=last_values)
    return how, rewards, values, m, check_unit_interval("gamma", gamma), check_unit_interval("lam", lam)


def gae(
    rewards: TokenFloat,
    values: TokenFloat,
    mask: ResponseMask,
    *,
    gamma: float,
    lam: float,
    holes: GaeHoles | str = GaeHoles.SKIP,
    last_values: SeqFloat | None = None,
) -> tuple[TokenFloat, TokenFloat]:
    """Advantages and returns ``([B, T], [B, T])``, both 0 at padded positions; ``last_values``
    ``[B]``: ``V_{t_L}`` of each row (module docstring; None: 0).

    Vectorized over the batch and over ``T``: each row's valid tokens are first gathered to the
    front (a stable sort, so interior holes disappear and the row is a plain prefix), then
    ``δ_i = r_i + γ·V_{i+1} − V_i`` and ``Â_i = Σ_l (γλ)^l δ_{i+l}`` (the definition, as a
    log-depth scan, :func:`_discounted_reverse_cumsum`), then scattered back.
    ``holes`` = ``zero``/``through``: the same over the envelope (module docstring) after setting
    ``r, V`` on the holes to 0 (``zero``) or keeping them (``through``).
    """
    how, rewards, values, m, gamma, lam = _checked_gae_inputs(
        rewards, values, mask, gamma, lam, holes, last_values
    )
    if how is not GaeHoles.SKIP:
        e = envelope(m)
        if how is GaeHoles.ZERO:
            zero = torch.zeros((), dtype=values.dtype, device=values.device)
            rewards, values = torch.where(m, rewards, zero), torch.where(m, values, zero)
        m = e
    return _gae_skip(rewards, values, m, gamma, lam, last_values)


def _gae_skip(
    rewards: Tensor, values: Tensor, m: Tensor, gamma: float, lam: float, last_values: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """:func:`gae` with ``holes=skip`` on validated inputs (``m`` bool)."""
    T = m.shape[1]
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    r = torch.where(m, rewards, zero)
    v = torch.where(m, values, zero)
    holed = has_holes(m)  # a valid token right after a masked one
    if holed:
        # Valid positions first, in their original order (stable), masked positions after them.
        order = torch.argsort((~m).to(torch.uint8), dim=1, stable=True)
        r, v = r.gather(1, order), v.gather(1, order)
        mc = torch.arange(T, device=m.device).unsqueeze(0) < m.sum(dim=1, keepdim=True)
    else:
        mc = m
    # Compacted rows are prefixes with zeros after them, so V_{i+1} is the next column (0 at the end).
    v_next = torch.nn.functional.pad(v[:, 1:], (0, 1))
    if last_values is not None:  # V_{t_L} := b at each compacted row's last valid column
        last = (mc.sum(dim=1, keepdim=True) - 1).clamp(min=0)
        v_next = v_next.scatter(1, last, last_values.unsqueeze(1))
    delta = torch.where(mc, r + gamma * v_next - v, zero)
    adv = torch.where(mc, _discounted_reverse_cumsum(delta, gamma * lam), zero)
    if holed:
        adv = torch.zeros_like(adv).scatter(1, order, adv)
        v = torch.where(m, values, zero)
    returns = torch.where(m, adv + v, zero)
    return adv, returns


def gae_naive(
    rewards: TokenFloat,
    values: TokenFloat,
    mask: ResponseMask,
    *,
    gamma: float,
    lam: float,
    holes: GaeHoles | str = GaeHoles.SKIP,
    last_values: SeqFloat | None = None,
) -> tuple[TokenFloat, TokenFloat]:
    """Naive twin of :func:`gae`: the discounted sum of TD residuals, term by term (the last one
    reading ``last_values[b]``, 0 when None, as the value after the row).

    ``skip``: over the valid positions only. ``zero``/``through``: over every position up to the
    row's last valid one, reading ``0`` (``zero``) or the given ``r, V`` (``through``) on the holes.
    """
    how = _checked_gae_inputs(rewards, values, mask, gamma, lam, holes, last_values)[0]  # the core's checks
    rs, vs, ms = pf.rows(rewards), pf.rows(values), pf.mask_rows(mask)
    boots = pf.vec(last_values) if last_values is not None else [0.0] * len(ms)
    adv_out, ret_out = [], []
    for r_row, v_row, m_row, boot in zip(rs, vs, ms, boots, strict=True):
        T = len(m_row)
        last = max(t for t in range(T) if m_row[t])
        if how is GaeHoles.SKIP:
            valid = [t for t in range(T) if m_row[t]]
        else:
            valid = list(range(last + 1))
            if how is GaeHoles.ZERO:
                r_row = [x if m_row[t] else 0.0 for t, x in enumerate(r_row)]
                v_row = [x if m_row[t] else 0.0 for t, x in enumerate(v_row)]
        L = len(valid)
        deltas = []
        for i in range(L):
            v_next = v_row[valid[i + 1]] if i + 1 < L else boot
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
