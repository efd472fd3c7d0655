"""Tests for the core survivors of ``tools/mutate.py`` on this batch's changes (issue #23):
``grad_is_clip`` (refppo/core/kl.py), ``prompt_mean_loss`` (aggregate.py), ``gate_statistic``
(rollout_correction.py). Each test pins one documented behaviour that a surviving mutant changed;
the expected values are worked out by hand in the comments, never taken from the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from refppo.core.kl import token_kl
from refppo.core.rollout_correction import gate_statistic
from refppo.errors import DtypeError, HyperparameterError

F64 = torch.float64


def _one_token() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    lp, ref, old = (torch.tensor([[x]], dtype=F64) for x in (-1.0, -1.5, -1.2))
    return lp, ref, old, torch.ones(1, 1, dtype=torch.bool)


@pytest.mark.parametrize("clip", [True, False, "2.0"])
def test_grad_is_clip_refuses_a_bool_or_a_string(clip: object) -> None:
    # kl.check_grad_is: "a number > 0 or None"; a bool is not a number here (True would pass > 0)
    lp, ref, old, m = _one_token()
    with pytest.raises(HyperparameterError, match="kl_grad_is_clip"):
        token_kl(lp, ref, m, "k1", logp_old=old, grad_is_clip=clip)  # type: ignore[arg-type]


def test_grad_is_clip_refuses_old_logprobs_of_another_dtype() -> None:
    # logp_old must have logp's dtype (float64 vs float32): a DtypeError naming both
    lp, ref, old, m = _one_token()
    with pytest.raises(DtypeError, match="logp_old"):
        token_kl(lp, ref, m, "k1", logp_old=old.to(torch.float32), grad_is_clip=10.0)
    with pytest.raises(DtypeError, match="logp_old"):
        token_kl(lp.to(torch.float32), ref.to(torch.float32), m, "k1", logp_old=old, grad_is_clip=10.0)


def test_importance_weight_is_detached_second_derivative() -> None:
    # k1: KL_t = l − l_ref, so ∂²KL/∂l² = 0; with w = min(exp(l − l_old), c) detached (the module
    # docstring: "detached"), ∂²(sg(KL) + w·(KL − sg(KL)))/∂l² = w·∂²KL/∂l² = 0. A w that is not
    # detached adds 2·∂w/∂l·∂KL/∂l = 2·w = 2·exp(0.2) here (l − l_old = 0.2, unclipped at c = 10).
    lp, ref, old, m = _one_token()
    lp.requires_grad_(True)
    out = token_kl(lp, ref, m, "k1", logp_old=old, grad_is_clip=10.0)
    (g,) = torch.autograd.grad(out.sum(), lp, create_graph=True)
    assert abs(float(g) - math.exp(0.2)) < 1e-14  # first derivative: w·1
    if g.requires_grad:
        (h,) = torch.autograd.grad(g.sum(), lp, allow_unused=True)
        assert h is None or abs(float(h)) < 1e-14


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_gate_statistic_is_zero_on_padding(level: str) -> None:
    # one row, one valid token: x = l^prox − l^beh = 0.5; the ratio statistic e^x (a row of one token:
    # its mean is x too), and 0 on the padded slot (where e^0 = 1 would show a leak)
    lp = torch.tensor([[-1.0, -1.0]], dtype=F64)
    lb = torch.tensor([[-1.5, 5.0]], dtype=F64)
    m = torch.tensor([[True, False]])
    out = gate_statistic(lp, lb, m, stat="ratio", level=level, reduce="mean")
    assert out[0, 1].item() == 0.0
    assert abs(out[0, 0].item() - math.exp(0.5)) < 1e-15
