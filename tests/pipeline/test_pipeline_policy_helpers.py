"""The policy stage's helpers that the stage table added this batch, against their definitions
written out here (``tools/mutate.py --module update`` survivors of ``cispo_token_loss`` and
``clip_ratio``; the latter is what ``--detect`` reads the clip regions of the gradient with).

CISPO (``refppo/core/cispo.py``): ``ℓ_t = −clamp(ρ_t, 1 − ε_low, 1 + ε_high)·A_t·l_t`` with the
coefficient detached and ``ρ_t = exp(clamp(l_t − l^old_t, ±κ))``. GSPO's sequence ratio:
``s_b = exp(min(mean_t (l − l^old), κ))`` on every valid token of row b.
"""

from __future__ import annotations

import torch

from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.update import cispo_token_loss, clip_ratio

F64 = torch.float64
# one row of four tokens, the last padded; log-ratios −0.5, 0.05, 0.9 (the first and last clip)
L_OLD = torch.tensor([[-1.0, -2.0, -1.5, -3.0]], dtype=F64)
D = torch.tensor([[-0.5, 0.05, 0.9, 0.0]], dtype=F64)
ADV = torch.tensor([[1.0, -2.0, 0.5, 0.0]], dtype=F64)
MASK = torch.tensor([[True, True, True, False]])


def _cispo_by_definition(d: torch.Tensor, lo: float, hi: float, kappa: float | None) -> torch.Tensor:
    dc = d.clamp(-kappa, kappa) if kappa is not None else d
    coef = torch.exp(dc).clamp(1.0 - lo, 1.0 + hi)
    return torch.where(MASK, -coef * ADV * (L_OLD + d), torch.zeros((), dtype=F64))


def test_cispo_token_loss_reads_both_clip_ranges_and_the_log_ratio_clamp() -> None:
    """ε_low = 0.1, ε_high = 0.3, κ = 0.6 all bind on this row (ρ = e^−0.5 = 0.61 < 0.9; e^0.6 =
    1.82 > 1.3), so dropping any of them moves ``ℓ``."""
    hp = Hyperparams(cliprange=0.1, cliprange_high=0.3)
    conv = Convention.of(policy_loss="cispo", dual_clip=None, log_ratio_clamp=0.6)
    out = cispo_token_loss(L_OLD + D, L_OLD, ADV, MASK, hp=hp, conv=conv)
    want = _cispo_by_definition(D, 0.1, 0.3, 0.6)
    torch.testing.assert_close(out.per_token, want, rtol=0, atol=1e-15)
    # the values differ from the defaults' (ε 0.2/0.2, no κ) at the clipped tokens: the test can tell
    assert not torch.allclose(_cispo_by_definition(D, 0.2, 0.2, None), want)
    # κ only moves the clipped coefficient through ρ's clamp: unclamped, the upper bound binds the same
    assert torch.equal(_cispo_by_definition(D, 0.1, 0.3, None), want)
    torch.testing.assert_close(out.ratio, torch.where(MASK, torch.exp(D.clamp(-0.6, 0.6)), 0.0 * D))


def test_cispo_token_loss_symmetric_range_when_cliprange_high_is_none() -> None:
    hp = Hyperparams(cliprange=0.05)
    conv = Convention.of(policy_loss="cispo", dual_clip=None)
    out = cispo_token_loss(L_OLD + D, L_OLD, ADV, MASK, hp=hp, conv=conv)
    torch.testing.assert_close(out.per_token, _cispo_by_definition(D, 0.05, 0.05, None), rtol=0, atol=1e-15)


def test_cispo_token_loss_builds_a_graph_by_default_and_none_with_grad_false() -> None:
    conv = Convention.of(policy_loss="cispo", dual_clip=None)
    lp = (L_OLD + D).clone().requires_grad_(True)
    with torch.enable_grad():
        assert cispo_token_loss(lp, L_OLD, ADV, MASK, hp=Hyperparams(), conv=conv).per_token.requires_grad
        off = cispo_token_loss(lp, L_OLD, ADV, MASK, hp=Hyperparams(), conv=conv, grad=False)
    assert not off.per_token.requires_grad


def test_clip_ratio_is_the_clamped_token_ratio_detached() -> None:
    conv = Convention.of(log_ratio_clamp=0.6)
    lp = (L_OLD + D).clone().requires_grad_(True)
    with torch.enable_grad():
        r = clip_ratio(lp, L_OLD, MASK, conv)
    assert not r.requires_grad
    want = torch.where(MASK, torch.exp(D.clamp(-0.6, 0.6)), torch.zeros((), dtype=F64))
    torch.testing.assert_close(r, want, rtol=0, atol=1e-15)


def test_clip_ratio_under_gspo_is_the_sequence_ratio_on_every_token() -> None:
    """mean(−0.5, 0.05, 0.9) = 0.15; κ = 0.1 caps it (GSPO's upper clamp of log s)."""
    conv = Convention.of(policy_loss="gspo", dual_clip=None, log_ratio_clamp=0.1)
    r = clip_ratio(L_OLD + D, L_OLD, MASK, conv)
    want = torch.tensor([[torch.e**0.1] * 3 + [0.0]], dtype=F64)
    torch.testing.assert_close(r, want, rtol=0, atol=1e-12)
    unclamped = clip_ratio(L_OLD + D, L_OLD, MASK, Convention.of(policy_loss="gspo", dual_clip=None))
    torch.testing.assert_close(unclamped, torch.tensor([[torch.e**0.15] * 3 + [0.0]], dtype=F64))
