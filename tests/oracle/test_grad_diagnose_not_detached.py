"""``∂pg/∂A`` of the "advantages not detached" hypothesis against autograd of a HAND-WRITTEN loss
whose advantages are a leaf (``grad_helpers._ratio`` and the clipped surrogate restated), for every
ratio form: plain, dual clip, log-ratio clamp binding, GSPO with its clamp binding, and tokens with
A = 0 exactly (torch's ½/½ share of the tied ``max`` branches).

The diagnosis reads the core's per-token loss (``pipeline.policy_term``) and never this formula.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from grad_helpers import _ratio
from oracle_helpers import HP, make_inputs, setup_for

from refppo.oracle.check.grad import UpdateInputs
from refppo.oracle.check.grad_diagnose import _not_detached

F64 = torch.float64
CONVS: dict[str, dict[str, Any]] = {
    "plain": {},
    "dual_clip": {"dual_clip": 1.25},
    "clamp": {"log_ratio_clamp": 0.15},
    "gspo_clamp": {"policy_loss": "gspo", "log_ratio_clamp": 0.02},
}


def _hand(
    lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, m: torch.Tensor, conv: dict[str, Any]
) -> torch.Tensor:
    a = adv.clone().requires_grad_(True)
    ratio = _ratio(lp, old, m, conv)
    eps = HP["cliprange"]
    tok = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - eps, 1 + eps))
    if conv.get("dual_clip") is not None:
        tok = torch.where(a < 0, torch.minimum(tok, -conv["dual_clip"] * a), tok)
    loss = torch.where(m, tok, torch.zeros((), dtype=F64)).sum() / m.sum()
    (g,) = torch.autograd.grad(loss, a)
    return torch.where(m, g, torch.zeros((), dtype=F64))


@pytest.mark.parametrize("name", list(CONVS))
def test_dpg_da_equals_autograd_of_the_hand_written_loss(name: str) -> None:
    conv = CONVS[name]
    x = make_inputs(B=6, T=10, seed=4, lp_noise=0.4)
    m = x["response_mask"].bool()
    adv = torch.randn(6, 10, generator=torch.Generator().manual_seed(1), dtype=F64)
    adv[0, :3] = 0.0  # A = 0 exactly: the mean of the one-sided derivatives
    adv[2, 1] = 0.0
    inp = UpdateInputs(
        logprobs=x["logprobs"], values=x["values"], old_logprobs=x["old_logprobs"],
        old_values=x["old_values"], advantages=adv, returns=x["values"], mask=m, value_mask=m,
        ref_logprobs=x["ref_logprobs"], entropy=None,
    )  # fmt: skip
    zeros = torch.zeros_like(adv)
    got = -_not_detached(inp, setup_for(conv=conv), {"grad_values": zeros, "grad_logprobs": zeros})[
        "grad_values"
    ]
    want = _hand(x["logprobs"], x["old_logprobs"], adv, m, conv)
    assert float((got - want).abs().max()) <= 1e-15 * float(want.abs().max())
    d = torch.where(m, x["logprobs"] - x["old_logprobs"], zeros)
    if name == "clamp":  # control: the clamp binds (∂ρ/∂l = 0 there, ∂ℓ/∂A ≠ 0)
        assert bool((m & (d.abs() > 0.15) & (want != 0)).any())
    if name == "dual_clip":  # control: the cap −c·A binds at some A < 0
        assert bool((m & (adv < 0) & (torch.exp(d) > 1.25)).any())
    assert bool((want[0, :3] != 0).any())  # A = 0 tokens still carry ∂ℓ/∂A
