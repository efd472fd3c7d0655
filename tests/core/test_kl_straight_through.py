"""The straight-through KL estimators ``k1+``, ``k3+``, ``abs+`` (verl 0.9.1 ``core_algos.kl_penalty``
with a ``+`` suffix; issue #13 item 3): the base estimator's value, bit for bit and clamps included,
and the gradient ``d = log π − log π_ref`` of ``½ d²`` on every valid token, unclamped."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import Ragged, ragged_batches

from refppo.conventions import KLEstimator
from refppo.core.grad import kl_loss_grad_naive
from refppo.core.kl import token_kl, token_kl_naive
from refppo.core.objective import kl_loss

pytestmark = pytest.mark.property

ST = [e for e in KLEstimator if e.straight_through]
clamps = st.sampled_from([(None, None), ((-20.0, 20.0), 10.0), ((-0.5, 0.5), 0.3), ((-10.0, None), 10.0)])


def test_the_straight_through_names() -> None:
    assert [e.value for e in ST] == ["k1+", "k3+", "abs+"]
    assert [e.base.value for e in ST] == ["k1", "k3", "abs"]
    assert not any(e.straight_through for e in KLEstimator if not e.value.endswith("+"))


@given(ragged_batches(), st.sampled_from(ST), clamps)
def test_value_is_the_base_estimators_bit_for_bit(b: Ragged, est: KLEstimator, clamp: tuple) -> None:
    lrc, vc = clamp
    lp, lr = b.floats(-3.0, -0.01), b.floats(-3.0, -0.01)
    got = token_kl(lp, lr, b.mask, est, log_ratio_clamp=lrc, value_clamp=vc)
    assert torch.equal(got, token_kl(lp, lr, b.mask, est.base, log_ratio_clamp=lrc, value_clamp=vc))
    naive = token_kl_naive(lp, lr, b.mask, est, log_ratio_clamp=lrc, value_clamp=vc)
    torch.testing.assert_close(got.double(), naive.double(), atol=1e-6, rtol=1e-5)


@given(ragged_batches(dtypes=(torch.float64,)), st.sampled_from(ST), clamps)
def test_gradient_is_the_unclamped_log_ratio(b: Ragged, est: KLEstimator, clamp: tuple) -> None:
    """∂ Σ_t KL_t / ∂ log π_t = d_t on valid tokens (clamps or not), 0 on padding; the base
    estimator's own gradient differs (k1: 1, k3: 1 − e^{−d}, abs: sign d) wherever d ∉ {0, 1}."""
    lrc, vc = clamp
    lp = b.floats(-6.0, -0.01).requires_grad_(True)
    lr = b.floats(-6.0, -0.01)
    token_kl(lp, lr, b.mask, est, log_ratio_clamp=lrc, value_clamp=vc).sum().backward()
    assert lp.grad is not None
    d = torch.where(b.mask, lp.detach() - lr, 0.0)
    assert torch.equal(lp.grad, d)
    twin = kl_loss_grad_naive(lp.detach(), lr, b.mask, est, "token-sum", log_ratio_clamp=lrc, value_clamp=vc)
    torch.testing.assert_close(lp.grad, twin, atol=1e-12, rtol=1e-12)
    base = lp.detach().clone().requires_grad_(True)
    token_kl(base, lr, b.mask, est.base, log_ratio_clamp=lrc, value_clamp=vc).sum().backward()
    assert base.grad is not None
    moved = b.mask & (d.abs() > 1e-3) & ((d - 1).abs() > 1e-3)
    if bool(moved.any()):
        assert float((base.grad - lp.grad)[moved].abs().max()) > 0


@given(
    ragged_batches(dtypes=(torch.float64,)),
    st.sampled_from(ST),
    st.sampled_from(["token-mean", "seq-mean-token-mean"]),
)
def test_kl_loss_gradient_matches_the_twin(b: Ragged, est: KLEstimator, agg: str) -> None:
    lp = b.floats(-4.0, -0.01).requires_grad_(True)
    lr = b.floats(-4.0, -0.01)
    kl_loss(lp, lr, b.mask, est, agg, log_ratio_clamp=(-20.0, 20.0), value_clamp=10.0).backward()
    assert lp.grad is not None
    want = kl_loss_grad_naive(
        lp.detach(), lr, b.mask, est, agg, log_ratio_clamp=(-20.0, 20.0), value_clamp=10.0
    )
    torch.testing.assert_close(lp.grad, want, atol=1e-12, rtol=1e-10)
