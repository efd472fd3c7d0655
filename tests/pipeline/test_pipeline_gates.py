"""The rollout_correction stage under a rejection gate ``rollout_rs*``: its naive twin, properties and
the truth table of the weighted surrogate per region (value and gradient), worked by hand."""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refppo.pipeline.blocks import Evaluation
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.stages import BY_NAME

RC = BY_NAME["rollout_correction"]
GATES = st.fixed_dictionaries(
    {
        "rollout_rs": st.sampled_from(["token", "sequence"]),
        "rollout_rs_stat": st.sampled_from(["ratio", "k1", "k2", "k3"]),
        "rollout_rs_order": st.sampled_from(["proximal", "behaviour"]),
        "rollout_rs_reduce": st.sampled_from(["sum", "mean", "max"]),
        "rollout_rs_high": st.sampled_from([0.05, 0.3, 1.2, 2.0]),
        "rollout_is": st.sampled_from([None, "token", "sequence"]),
        "rollout_is_high": st.sampled_from([None, 1.5]),
    }
)


def _q(seed: int, b: int = 4, t: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, t + 1, (b,), generator=g)
    m = torch.arange(t).unsqueeze(0) < lens.unsqueeze(1)
    prox = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2
    beh = prox - 0.6 * torch.randn(b, t, generator=g, dtype=torch.float64)
    return {"old_logprobs": prox, "rollout_logprobs": torch.where(m, beh, 7.0), "mask": m}


@settings(max_examples=60, deadline=None)
@given(gate=GATES, seed=st.integers(0, 10_000))
def test_the_stage_equals_its_naive_twin(gate: dict[str, Any], seed: int) -> None:
    conv, hp, q = Convention.of(**gate), Hyperparams(), _q(seed)
    fast = RC.run(q, conv, hp)
    slow = RC.run(q, conv, hp, naive=True)
    assert torch.equal(fast["is_keep"], slow["is_keep"])
    torch.testing.assert_close(fast["is_weights"], slow["is_weights"], rtol=1e-12, atol=0.0)


@settings(max_examples=60, deadline=None)
@given(gate=GATES, seed=st.integers(0, 10_000))
def test_a_gate_only_zeroes_weights(gate: dict[str, Any], seed: int) -> None:
    """``w'(gate) = w'(no gate)·keep``: kept tokens carry the ungated weight, the others 0, padding 0."""
    q, hp = _q(seed), Hyperparams()
    on = RC.run(q, Convention.of(**gate), hp)
    off_conv = Convention.of(**{k: v for k, v in gate.items() if k.startswith("rollout_is")})
    off = RC.run(q, off_conv, hp)
    base = torch.where(q["mask"], 1.0, 0.0).double() if off["is_weights"] is None else off["is_weights"]
    assert torch.equal(on["is_weights"], torch.where(on["is_keep"], base, 0.0))
    assert not bool((on["is_keep"] & ~q["mask"]).any())


def test_the_truth_table_of_a_token_k2_gate() -> None:
    """One row, ``d = l^prox − l^beh`` = (0.1, 1.0, −0.9, 0.2, pad), gate ``½d² ≤ 0.3`` (keeps |d| ≤
    0.7746) on the raw token weight ``e^d``; ``A`` = 1, ``l = l^old`` (ρ = 1, unclipped), token-mean:
    ``pg = Σ_t w'_t·(−1)/4`` and ``∂pg/∂l_t = −w'_t/4`` (padding: 0)."""
    d = [0.1, 1.0, -0.9, 0.2]
    m = torch.tensor([[True, True, True, True, False]])
    prox = torch.tensor([[-1.0, -1.2, -0.4, -2.0, 0.0]], dtype=torch.float64)
    beh = prox - torch.tensor([[*d, 0.0]], dtype=torch.float64)
    conv = Convention.of(rollout_is="token", rollout_rs="token", rollout_rs_stat="k2", rollout_rs_high=0.3)
    hp = Hyperparams()
    w = RC.run({"old_logprobs": prox, "rollout_logprobs": beh, "mask": m}, conv, hp)["is_weights"]
    want = [math.exp(0.1), 0.0, 0.0, math.exp(0.2), 0.0]  # kept, rejected (d=1), rejected (d=−0.9), kept
    torch.testing.assert_close(w[0], torch.tensor(want, dtype=torch.float64), rtol=1e-14, atol=0.0)
    lp = prox.clone().requires_grad_(True)
    q = {
        "logprobs": lp,
        "old_logprobs": prox,
        "advantages": torch.ones_like(prox),
        "mask": m,
        "is_weights": w,
    }
    per = BY_NAME["policy"].run(q, conv, hp, Evaluation())["pg_per_token"]
    pg = BY_NAME["policy_agg"].run({"pg_per_token": per, "mask": m}, conv, hp)["pg_loss"]
    assert math.isclose(float(pg), -(math.exp(0.1) + math.exp(0.2)) / 4, rel_tol=1e-12)
    (g,) = torch.autograd.grad(pg, lp)
    torch.testing.assert_close(g[0], -torch.tensor(want, dtype=torch.float64) / 4, rtol=1e-14, atol=0.0)
