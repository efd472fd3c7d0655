"""Tests for the core survivors of ``tools/mutate.py`` on the stage-table layout (issue #20).

Each test pins one documented behaviour that a surviving mutant changed; the expected values are
worked out by hand in the comments (or come from the naive twin), never from the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from refppo.core.by_rows import (
    entropy_bonus_by_rows,
    kl_loss_by_rows,
    policy_token_loss_by_rows,
    value_token_loss_by_rows,
)
from refppo.core.gspo import gspo_policy_loss_naive, gspo_ratio
from refppo.core.objective import entropy_bonus, kl_loss
from refppo.core.policy import policy_ratio
from refppo.errors import DtypeError

F64 = torch.float64

# Two rows, T = 3, the first with one padded slot: d = l − l^old = [0.4, 0.6, ·] (S_0 = 0.5) and
# [−1.0, −0.5, −1.5] (S_1 = −1.0). l^old = −1 everywhere; the padded logp is garbage (never read).
_OLD = torch.full((2, 3), -1.0, dtype=F64)
_MASK = torch.tensor([[True, True, False], [True, True, True]])
_LOGP = _OLD + torch.tensor([[0.4, 0.6, 7.0], [-1.0, -0.5, -1.5]], dtype=F64)


@pytest.mark.parametrize("kappa", [None, 0.3, 2.0])
def test_gspo_ratio_is_the_clamped_sequence_ratio_on_valid_tokens(kappa: float | None) -> None:
    """``gspo_ratio`` = ``exp(min(S_b, κ))`` on every valid token of row b, 0 on padding, detached.

    By hand: row 0 ``exp(0.5)`` (``exp(0.3)`` under κ = 0.3, which caps it), row 1 ``exp(−1)`` (κ is an
    upper bound only). Survivors: the ``log_ratio_max is not None`` test negated (κ ignored, or None
    refused by ``check_positive``) and ``[1]`` → ``[0]`` (returned ``d``), since no core test called it."""
    s0 = math.exp(min(0.5, kappa) if kappa is not None else 0.5)
    want = torch.tensor([[s0, s0, 0.0], [math.exp(-1.0)] * 3], dtype=F64)
    x = _LOGP.clone().requires_grad_(True)
    got = gspo_ratio(x, _OLD, _MASK, log_ratio_max=kappa)
    torch.testing.assert_close(got, want, rtol=1e-15, atol=0.0)
    assert not got.requires_grad
    naive = gspo_policy_loss_naive(_LOGP, _OLD, torch.ones_like(_OLD), _MASK, log_ratio_max=kappa)
    torch.testing.assert_close(got, torch.tensor(naive.ratio, dtype=F64), rtol=1e-15, atol=0.0)


def test_policy_ratio_refuses_mixed_float_dtypes() -> None:
    """``policy_ratio`` checks its own inputs (no silent up-casting): a float32 ``logp`` with a float64
    ``logp_old`` is refused naming both. Survivors: either argument dropped from ``check_same_dtype``
    (then ``logp − logp_old`` promoted silently)."""
    m = torch.ones(1, 2, dtype=torch.bool)
    lp32, lp64 = torch.zeros(1, 2, dtype=torch.float32), torch.zeros(1, 2, dtype=F64)
    with pytest.raises(DtypeError, match=r"logp=torch\.float32, logp_old=torch\.float64"):
        policy_ratio(lp32, lp64, m)
    with pytest.raises(DtypeError, match=r"logp=torch\.float64, logp_old=torch\.float32"):
        policy_ratio(lp64, lp32, m)


def test_policy_token_loss_by_rows_defaults_are_the_clipped_surrogate_at_0_2() -> None:
    """``policy_token_loss_by_rows``'s defaults: the token-level clipped surrogate (not GSPO), ``ε = 0.2``
    both sides, the ratio kept. ``d = [0.25, −0.3]``, ``A = [1, −1]``: ``ρ = [e^0.25 ≈ 1.284, e^−0.3 ≈
    0.741]``, ``ℓ = max(−Aρ, −A·clip(ρ, 0.8, 1.2)) = [−1.2, 0.8]`` (both clipped: clipfrac 1).

    Survivors: ``gspo=False`` → True (one sequence ratio e^−0.025 on both tokens), ``clip_low`` 0.2 →
    0 / 1.2 / −0.2 (refused) and ``keep_ratio=True`` → False (an empty ratio)."""
    mask = torch.ones(1, 2, dtype=torch.bool)
    old = torch.tensor([[-1.0, -2.0]], dtype=F64)
    logp = old + torch.tensor([[0.25, -0.3]], dtype=F64)
    out = policy_token_loss_by_rows(1, logp, old, torch.tensor([[1.0, -1.0]], dtype=F64), mask)
    torch.testing.assert_close(out.per_token, torch.tensor([[-1.2, 0.8]], dtype=F64), rtol=1e-15, atol=1e-15)
    want_ratio = torch.tensor([[math.exp(0.25), math.exp(-0.3)]], dtype=F64)
    torch.testing.assert_close(out.ratio, want_ratio, rtol=1e-15, atol=0.0)
    assert float(out.clipfrac) == 1.0
    # keep_ratio=False: the ratio is not kept (an empty tensor), the rest unchanged. Survivor:
    # ``new_empty(0)`` → ``new_empty(1)``.
    lean = policy_token_loss_by_rows(
        1, logp, old, torch.tensor([[1.0, -1.0]], dtype=F64), mask, keep_ratio=False
    )
    assert lean.ratio.numel() == 0
    assert torch.equal(lean.per_token, out.per_token)


def test_value_token_loss_by_rows_default_clip_is_0_2_around_old() -> None:
    """``value_token_loss_by_rows``'s default ``clip = 0.2`` (around the old value). ``V^old = 0``,
    ``V = [0.5, −0.1]``, ``R = [1, −0.05]``: ``V^clip = [0.2, −0.1]``, ``ℓ = ½·max((V−R)², (V^clip−R)²)
    = [½·0.64, ½·0.0025] = [0.32, 0.00125]``; the first token clipped (vf_clipfrac ½).

    Survivors: the default 0.2 → 0 (``ℓ_0 = ½``), 1.2 (``ℓ_0 = 0.125``) or −0.2 (refused)."""
    mask = torch.ones(1, 2, dtype=torch.bool)
    v = torch.tensor([[0.5, -0.1]], dtype=F64)
    out = value_token_loss_by_rows(1, v, torch.zeros_like(v), torch.tensor([[1.0, -0.05]], dtype=F64), mask)
    torch.testing.assert_close(
        out.per_token, torch.tensor([[0.32, 0.00125]], dtype=F64), rtol=1e-14, atol=0.0
    )
    assert float(out.clipfrac) == 0.5


def test_entropy_and_kl_by_rows_equal_the_core_on_column_major_inputs() -> None:
    """``entropy_bonus_by_rows`` and ``kl_loss_by_rows`` equal :func:`entropy_bonus` and :func:`kl_loss`
    bit for bit on inputs stored column-major (``x.t().contiguous().t()``): their row-block buffer is
    allocated row-major like the whole-batch result, so the aggregation sums in the same order (as
    ``tests/pipeline/test_update_by_rows.py`` checks for the policy and value losses).

    Survivors: ``memory_format=torch.contiguous_format`` dropped from either buffer (it then copies the
    input's column-major layout and a float32 token-sum rounds differently)."""
    g = torch.Generator().manual_seed(3)
    B, T = 64, 333
    mask = torch.arange(T).expand(B, T) < torch.randint(1, T + 1, (B, 1), generator=g)

    def col_major(x: torch.Tensor) -> torch.Tensor:
        return x.t().contiguous().t()

    ref = col_major(-torch.rand(B, T, generator=g, dtype=torch.float32) * 3)
    lp = col_major(ref + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float32))
    ent = col_major(torch.rand(B, T, generator=g, dtype=torch.float32) * 5)
    assert not lp.is_contiguous() and not ent.is_contiguous()
    for agg in ("token-mean", "seq-mean-token-sum", "token-sum"):
        assert torch.equal(entropy_bonus_by_rows(7, ent, mask, agg), entropy_bonus(ent, mask, agg)), agg
        got = kl_loss_by_rows(7, lp, ref, mask, "k3", agg)
        assert torch.equal(got, kl_loss(lp, ref, mask, "k3", agg)), agg
