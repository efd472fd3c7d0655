"""Gradients at padded positions and through the constants of the losses.

- every KL estimator, with and without clamps: the gradient w.r.t. ``logp`` and ``logp_ref`` is
  exactly 0 (never NaN) at padded positions holding NaN/±inf, and on valid positions equals the
  closed form ``∂k/∂d`` (k1: 1, k2: d, k3: 1 − e^{−d}, abs: sign d; 0 where a clamp binds);
- with a ``log_ratio_clamp`` that excludes 0 (``d`` = 0 on padding would clamp to a non-zero KL)
  the KL is still exactly 0 on padding;
- ``returns`` and ``values_old`` carry no gradient into the value loss, ``advantages`` and
  ``logp_old`` none into the policy loss (they are constants of the step: spec/ppo.md).
"""

from __future__ import annotations

import math

import pytest
import torch

from refppo.core.kl import LogRatioClamp, token_kl
from refppo.core.policy import clipped_policy_loss
from refppo.core.value import value_loss

F64 = torch.float64
NAN, INF = math.nan, math.inf
MASK = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]])
# d = logp − ref on the valid positions: row 0 [0.5, −0.25, 2, −3], row 1 [0.05, 1]
LOGP = [[0.5, -0.25, 2.0, -3.0, NAN, INF], [0.05, 1.0, -INF, NAN, 1.0, INF]]
REF = [[0.0, 0.0, 0.0, 0.0, INF, NAN], [0.0, 0.0, NAN, -INF, NAN, 0.0]]


def _dk_dd(est: str, d: float) -> float:
    if est == "k1":
        return 1.0
    if est == "k2":
        return d
    if est == "k3":
        return 1.0 - math.exp(-d)
    return math.copysign(1.0, d)


def _expected_grad(est: str, lo: float | None, hi: float | None, vc: float | None) -> list[list[float]]:
    """``∂(Σ kl)/∂logp`` by the chain rule through the clamps (0 where a clamp binds, and on padding)."""
    out = []
    for row_p, row_r, row_m in zip(LOGP, REF, MASK.tolist(), strict=True):
        g_row = []
        for p, r, ok in zip(row_p, row_r, row_m, strict=True):
            if not ok:
                g_row.append(0.0)
                continue
            d = p - r
            if (lo is not None and d < lo) or (hi is not None and d > hi):
                g_row.append(0.0)
                continue
            k = {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) + d - 1, "abs": abs(d)}[est]
            g_row.append(0.0 if vc is not None and abs(k) > vc else _dk_dd(est, d))
        out.append(g_row)
    return out


@pytest.mark.parametrize("est", ["k1", "k2", "k3", "abs"])
@pytest.mark.parametrize(
    ("clamp", "value_clamp"),
    [(None, None), ((-1.0, 1.5), None), ((None, 1.5), 1.2), ((-2.0, None), 0.9), ((0.1, 5.0), None)],
)
def test_kl_gradients_are_exactly_zero_at_padding_and_the_closed_form_elsewhere(
    est: str, clamp: LogRatioClamp | None, value_clamp: float | None
) -> None:
    logp = torch.tensor(LOGP, dtype=F64, requires_grad=True)
    ref = torch.tensor(REF, dtype=F64, requires_grad=True)
    kl = token_kl(logp, ref, MASK, est, log_ratio_clamp=clamp, value_clamp=value_clamp)
    assert bool((kl[~MASK.bool()] == 0).all())  # also when the clamp excludes 0 (0.1, 5.0)
    kl.sum().backward()
    assert logp.grad is not None and ref.grad is not None
    lo, hi = clamp if clamp is not None else (None, None)
    want = torch.tensor(_expected_grad(est, lo, hi, value_clamp), dtype=F64)
    torch.testing.assert_close(logp.grad, want, rtol=1e-14, atol=0.0)
    torch.testing.assert_close(ref.grad, -want, rtol=1e-14, atol=0.0)
    assert bool(torch.isfinite(logp.grad).all()) and bool(torch.isfinite(ref.grad).all())


def test_kl_is_exactly_zero_on_padding_when_the_clamp_excludes_zero() -> None:
    # d = 0 is clamped to 0.5 by (0.5, 2): on valid positions d = 0 gives k1 = 0.5, k3 = e^{-0.5} − 0.5;
    # padded positions stay exactly 0 for every estimator.
    logp = torch.tensor([[0.0, 0.0, NAN]], dtype=F64)
    ref = torch.tensor([[0.0, 0.0, INF]], dtype=F64)
    m = torch.tensor([[1, 1, 0]])
    k1 = token_kl(logp, ref, m, "k1", log_ratio_clamp=(0.5, 2.0))
    assert k1[0].tolist() == [0.5, 0.5, 0.0]
    k3 = token_kl(logp, ref, m, "k3", log_ratio_clamp=(0.5, 2.0))
    assert k3[0, 0].item() == pytest.approx(math.exp(-0.5) - 0.5, abs=1e-15)
    for est in ("k2", "abs"):
        assert token_kl(logp, ref, m, est, log_ratio_clamp=(0.5, 2.0))[0, 2].item() == 0.0


@pytest.mark.parametrize("kind", ["clipped", "unclipped"])
def test_returns_and_old_values_carry_no_gradient_into_the_value_loss(kind: str) -> None:
    m = torch.tensor([[1, 1, 0]])
    values = torch.tensor([[0.3, -0.4, NAN]], dtype=F64, requires_grad=True)  # inside V_old ± 0.5
    old = torch.tensor([[0.0, 0.0, INF]], dtype=F64, requires_grad=True)
    ret = torch.tensor([[1.0, -2.0, NAN]], dtype=F64, requires_grad=True)
    value_loss(values, old, ret, m, clip=0.5, kind=kind).loss.backward()
    assert ret.grad is None and old.grad is None
    # V inside the clip range, so both kinds give ∂/∂V of ½(V − R)²/N (N = 2):
    # (V − R)/2 = [(0.3 − 1)/2, (−0.4 + 2)/2] = [−0.35, 0.8]; padding exactly 0.
    assert values.grad is not None
    assert values.grad[0].tolist() == pytest.approx([-0.35, 0.8, 0.0], abs=1e-15)
    assert values.grad[0, 2].item() == 0.0


def test_advantages_and_old_logprobs_carry_no_gradient_into_the_policy_loss() -> None:
    m = torch.tensor([[1, 1, 0]])
    logp = torch.tensor([[0.1, -0.1, NAN]], dtype=F64, requires_grad=True)
    old = torch.tensor([[0.0, 0.0, INF]], dtype=F64, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, NAN]], dtype=F64, requires_grad=True)
    clipped_policy_loss(logp, old, adv, m).loss.backward()
    assert adv.grad is None
    # logp_old enters only through ρ = exp(l − l_old): its gradient is minus logp's, not a second path.
    assert logp.grad is not None and old.grad is not None
    torch.testing.assert_close(old.grad, -logp.grad, rtol=0.0, atol=0.0)
    assert logp.grad[0, 2].item() == 0.0
