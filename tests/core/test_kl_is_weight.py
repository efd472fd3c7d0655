"""The importance-weighted KL-loss gradient (``grad_is_clip``, refppo/core/kl.py; OpenRLHF 0.11.2
``unbiased_gradient``): the value is the plain estimator's, the autograd gradient is the gradient
twin's (``kl_loss_grad_naive`` with the weight), a hand-worked token, and the refusals."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import Ragged, ragged_batches

from refppo.conventions import KLEstimator, LossAgg
from refppo.core.grad import kl_loss_grad_naive
from refppo.core.kl import token_kl, token_kl_naive
from refppo.core.objective import kl_loss, kl_loss_naive
from refppo.errors import HyperparameterError, ShapeError

pytestmark = pytest.mark.property


@given(
    ragged_batches(dtypes=(torch.float64,)),
    st.sampled_from(list(KLEstimator)),
    st.sampled_from([LossAgg.TOKEN_MEAN, LossAgg.SEQ_MEAN_TOKEN_MEAN, LossAgg.TOKEN_SUM]),
    st.sampled_from([0.5, 1.2, 10.0]),
)
def test_value_unchanged_and_gradient_is_the_weighted_twin(
    b: Ragged, est: KLEstimator, agg: LossAgg, c: float
) -> None:
    old = b.floats(-4.0, -0.05)
    lp = (old + b.valid(-1.5, 1.5)).requires_grad_(True)  # exp(l − l_old) on both sides of c
    ref = old + b.valid(-1.0, 1.0)
    kw = {"log_ratio_clamp": (-10.0, None), "value_clamp": 10.0}
    plain = kl_loss(lp, ref, b.mask, est, agg, **kw)  # type: ignore[arg-type]
    weighted = kl_loss(lp, ref, b.mask, est, agg, logp_old=old, grad_is_clip=c, **kw)  # type: ignore[arg-type]
    assert torch.equal(weighted.detach(), plain.detach())
    naive = kl_loss_naive(lp.detach(), ref, b.mask, est, agg, logp_old=old, grad_is_clip=c, **kw)  # type: ignore[arg-type]
    torch.testing.assert_close(weighted.detach(), naive, rtol=1e-12, atol=1e-12)
    (g,) = torch.autograd.grad(weighted, lp)
    want = kl_loss_grad_naive(lp.detach(), ref, b.mask, est, agg, logp_old=old, grad_is_clip=c, **kw)  # type: ignore[arg-type]
    torch.testing.assert_close(torch.where(b.mask, g, 0.0), want, rtol=1e-10, atol=1e-12)


def test_hand_worked_token() -> None:
    # d = l − l_ref = 0.5, l − l_old = log 2: k3+ gradient d = 0.5, times w = min(2, c)
    lp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    ref, old = (
        torch.tensor([[-1.5]], dtype=torch.float64),
        torch.tensor([[-1.0 - math.log(2.0)]], dtype=torch.float64),
    )
    m = torch.ones(1, 1, dtype=torch.bool)
    for c, want in ((10.0, 1.0), (1.5, 0.75)):
        out = token_kl(lp, ref, m, "k3+", logp_old=old, grad_is_clip=c)
        (g,) = torch.autograd.grad(out.sum(), lp)
        assert abs(float(g) - want) < 1e-15
        assert abs(float(out.detach()) - (math.exp(-0.5) + 0.5 - 1.0)) < 1e-15


@pytest.mark.parametrize(
    ("old", "c", "err", "text"),
    [
        (None, 10.0, HyperparameterError, "needs the old log-probs"),
        (torch.zeros(2, 2, dtype=torch.float64), 0.0, HyperparameterError, "kl_grad_is_clip"),
        (torch.zeros(2, 2, dtype=torch.float64), float("inf"), HyperparameterError, "kl_grad_is_clip"),
        (torch.zeros(3, 2, dtype=torch.float64), 10.0, ShapeError, "logp_old"),
    ],
)
def test_refusals_are_the_same_in_the_twins(
    old: torch.Tensor | None, c: float, err: type[Exception], text: str
) -> None:
    lp = ref = torch.zeros(2, 2, dtype=torch.float64)
    m = torch.ones(2, 2, dtype=torch.bool)
    for f in (token_kl, token_kl_naive):
        with pytest.raises(err, match=text):
            f(lp, ref, m, "k3+", logp_old=old, grad_is_clip=c)
    with pytest.raises(err, match=text):
        kl_loss_grad_naive(lp, ref, m, "k3+", logp_old=old, grad_is_clip=c)
