"""Hand-worked gradients of refppo/core/grad.py, and the tie rules of torch autograd it relies on.

Every expected value below is worked out in the comments from the equations of spec/ppo.md
("Gradients"); each is checked against the twin *and* against autograd through the core.
"""

from __future__ import annotations

import math

import pytest
import torch

from refppo.conventions import KLEstimator, LossAgg, ValueClipForm
from refppo.core.aggregate import agg_weights_naive, aggregate_loss
from refppo.core.grad import kl_loss_grad_naive, policy_grad_naive, value_grad_naive
from refppo.core.objective import kl_loss
from refppo.core.policy import clipped_policy_loss
from refppo.core.value import value_loss
from refppo.errors import DumpError
from refppo.pipeline.grad_naive import objective_grads_naive
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import update_quantities

F64 = torch.float64
NAN = math.nan


def _t(rows: list[list[float]], grad: bool = False) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64, requires_grad=grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_tie_rules_are_the_ones_the_twin_states(dtype: torch.dtype) -> None:
    """refppo/core/grad.py "Ties": maximum/minimum split a tie ½/½, clamp passes its closed
    interval (scalar and tensor bounds), where sends 0 to the branch it did not pick, |0|' = 0."""
    a = torch.tensor([1.0, 2.0, 3.0], dtype=dtype, requires_grad=True)
    b = torch.tensor([1.0, 1.0, 4.0], dtype=dtype, requires_grad=True)
    torch.maximum(a, b).sum().backward()
    assert a.grad is not None and b.grad is not None
    assert a.grad.tolist() == [0.5, 1.0, 0.0] and b.grad.tolist() == [0.5, 0.0, 1.0]
    a.grad, b.grad = None, None
    torch.minimum(a, b).sum().backward()
    assert a.grad.tolist() == [0.5, 0.0, 1.0] and b.grad.tolist() == [0.5, 1.0, 0.0]
    # 0.75 and 1.25 are exact in both dtypes; the bounds themselves pass, beyond them nothing does
    x = torch.tensor([0.75, 1.25, 1.0, 1.5, 0.5], dtype=dtype, requires_grad=True)
    torch.clamp(x, 0.75, 1.25).sum().backward()
    assert x.grad is not None and x.grad.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    x.grad = None
    lo, hi = torch.full((5,), 0.75, dtype=dtype), torch.full((5,), 1.25, dtype=dtype)
    torch.clamp(x, min=lo, max=hi).sum().backward()
    assert x.grad.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    y = torch.tensor([0.0, -0.0, 2.0, -2.0], dtype=dtype, requires_grad=True)
    y.abs().sum().backward()
    assert y.grad is not None and y.grad.tolist() == [0.0, 0.0, 1.0, -1.0]
    z = torch.tensor([NAN, 1.0], dtype=dtype, requires_grad=True)
    torch.where(torch.tensor([False, True]), z, torch.zeros((), dtype=dtype)).sum().backward()
    assert z.grad is not None and z.grad.tolist() == [0.0, 1.0]


MASK = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]])  # L_b = 2, 1, 3; N = 6; B = 3; T = 4


@pytest.mark.parametrize(
    ("agg", "norm", "want_rows"),
    [
        ("token-mean", {}, (1 / 6, 1 / 6, 1 / 6)),  # 1/N
        ("token-mean", {"token_count": 10.0}, (0.1, 0.1, 0.1)),  # 1/N_tok
        ("seq-mean-token-mean", {}, (1 / 6, 1 / 3, 1 / 9)),  # 1/(L_b·B): 1/(2·3), 1/(1·3), 1/(3·3)
        ("seq-mean-token-mean", {"seq_count": 5.0}, (0.1, 0.2, 1 / 15)),  # 1/(L_b·5)
        ("seq-mean-token-sum", {}, (1 / 3, 1 / 3, 1 / 3)),  # 1/B
        ("seq-mean-token-sum-norm", {}, (1 / 12, 1 / 12, 1 / 12)),  # 1/(T·B) = 1/(4·3)
        ("seq-mean-token-sum-norm", {"horizon": 8.0, "seq_count": 5.0}, (1 / 40,) * 3),  # 1/(8·5)
        ("token-sum", {"token_count": 10.0, "seq_count": 5.0}, (1.0, 1.0, 1.0)),  # no normaliser
    ],
)
def test_agg_weights_hand_example(agg: str, norm: dict[str, float], want_rows: tuple[float, ...]) -> None:
    want = torch.tensor([[w] * 4 for w in want_rows], dtype=F64) * MASK
    got = torch.tensor(agg_weights_naive(MASK, agg, **norm), dtype=F64)  # type: ignore[arg-type]  # kwargs
    torch.testing.assert_close(got, want, rtol=1e-15, atol=0.0)
    lm = torch.zeros(3, 4, dtype=F64, requires_grad=True)  # ∂agg/∂L by autograd agrees
    aggregate_loss(lm, MASK, agg, **norm).backward()
    assert lm.grad is not None
    torch.testing.assert_close(lm.grad, want, rtol=1e-15, atol=0.0)


def _policy_grads(
    rho: list[float], adv: list[float], **kw: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(autograd, twin) of ∂pg/∂l for one row with l^old = 0 and l = ln ρ (token-sum: w = 1)."""
    lp = _t([[math.log(r) for r in rho]])
    old, a, m = torch.zeros_like(lp), _t([adv]), torch.ones_like(lp, dtype=torch.bool)
    x = lp.clone().requires_grad_(True)
    clipped_policy_loss(x, old, a, m, agg="token-sum", **kw).loss.backward()  # type: ignore[arg-type]  # kwargs
    assert x.grad is not None
    return x.grad, policy_grad_naive(lp, old, a, m, agg="token-sum", **kw)  # type: ignore[arg-type]  # kwargs


def test_policy_grad_hand_example_every_region() -> None:
    # ε = 0.2, token-sum (w = 1), ∂ℓ/∂l = −A·ρ where the unclipped branch is active:
    #   A=+1, ρ=1.1 (inside)          -> −1.1
    #   A=+1, ρ=1.5 (clipped high)    ->  0
    #   A=−2, ρ=0.5 (clipped low)     ->  0
    #   A=−2, ρ=2   (1+ε < ρ ≤ c=3)   -> −(−2)·2 = 4
    #   A=−2, ρ=4   (ρ > c: dual cap) ->  0 with dual-clip, 8 without
    #   A=0,  ρ=1.3                   ->  0
    rho, adv = [1.1, 1.5, 0.5, 2.0, 4.0, 1.3], [1.0, 1.0, -2.0, -2.0, -2.0, 0.0]
    for dual, last in ((3.0, 0.0), (None, 8.0)):
        auto, twin = _policy_grads(rho, adv, dual_clip=dual)
        want = _t([[-1.1, 0.0, 0.0, 4.0, last, 0.0]])
        torch.testing.assert_close(twin, want, rtol=1e-14, atol=1e-15)
        torch.testing.assert_close(auto, want, rtol=1e-14, atol=1e-15)


def test_policy_grad_ties_hand_example() -> None:
    # ρ = 1 exactly with ε_high = 0: L1 = L2 = −A (tie, ½ each) and clamp(1, 0.8, 1) passes its
    # bound, so both halves carry −A·ρ: whole gradient −1 (an exclusive clamp would give −½).
    auto, twin = _policy_grads([1.0], [1.0], clip_high=0.0)
    assert auto.tolist() == twin.tolist() == [[-1.0]]
    # ρ = 1 with ε_low = 0, A = −1: the lower bound, whole gradient +1.
    auto, twin = _policy_grads([1.0], [-1.0], clip_low=0.0)
    assert auto.tolist() == twin.tolist() == [[1.0]]
    # Dual-clip tie ρ = c = 2 (d = ln 2; both torch and math round exp(ln 2) to 2.0), A = −1:
    # ℓ = −Aρ = 2 = −cA: min splits ½/½, ℓ's half carries −A·ρ = 2 -> 1.
    assert torch.exp(torch.tensor(math.log(2.0), dtype=F64)).item() == math.exp(math.log(2.0)) == 2.0
    auto, twin = _policy_grads([2.0], [-1.0], dual_clip=2.0)
    assert auto.tolist() == twin.tolist() == [[1.0]]


def test_policy_grad_log_ratio_clamp_boundary_hand_example() -> None:
    # κ = 0.5, A = −1 (ε = 0.2, so ρ = e^{0.5} ≈ 1.65 > 1.2 is unclipped for A < 0):
    # d = 0.5 exactly sits on the clamp's bound: passes, ∂ = −A·e^{0.5} = e^{0.5};
    # d = 0.75 is beyond it: the clamp blocks, ∂ = 0 although ℓ = −A·e^{0.5} is the same value.
    lp, old, m = _t([[0.5, 0.75]]), torch.zeros(1, 2, dtype=F64), torch.ones(1, 2, dtype=torch.bool)
    adv = _t([[-1.0, -1.0]])
    x = lp.clone().requires_grad_(True)
    clipped_policy_loss(x, old, adv, m, agg="token-sum", log_ratio_clamp=0.5).loss.backward()
    twin = policy_grad_naive(lp, old, adv, m, agg="token-sum", log_ratio_clamp=0.5)
    want = _t([[math.exp(0.5), 0.0]])
    torch.testing.assert_close(twin, want, rtol=1e-15, atol=0.0)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, want, rtol=1e-15, atol=0.0)


@pytest.mark.parametrize("form", list(ValueClipForm))
def test_value_grad_hand_example_with_ties(form: ValueClipForm) -> None:
    # V_old = 0, ε_v = 0.25, token-sum (w = 1); ℓ = ½ max((V−R)², (V^clip−R)²):
    #   V=0.1,  R=1: inside, V^clip = V (tie, both halves equal)     -> V − R = −0.9
    #   V=0.25, R=1: on the bound, clamp passes (tie)                -> −0.75
    #   V=0.75, R=0.5: V^clip = 0.25, (0.25)² = (−0.25)² tie; the clipped half is blocked
    #                                                                 -> ½(V − R) = 0.125
    #   V=1,    R=0: (V−R)² = 1 > (0.25)²: unclipped                  -> 1
    #   V=1,    R=2: (0.25−2)² = 3.0625 > 1: clipped, blocked         -> 0
    v, r = _t([[0.1, 0.25, 0.75, 1.0, 1.0, NAN]]), _t([[1.0, 1.0, 0.5, 0.0, 2.0, NAN]])
    old, m = _t([[0.0] * 5 + [NAN]]), torch.tensor([[1, 1, 1, 1, 1, 0]])
    x = v.clone().requires_grad_(True)
    value_loss(x, old, r, m, clip=0.25, agg="token-sum", clip_form=form).loss.backward()
    twin = value_grad_naive(v, old, r, m, clip=0.25, agg="token-sum", clip_form=form)
    want = _t([[-0.9, -0.75, 0.125, 1.0, 0.0, 0.0]])
    torch.testing.assert_close(twin, want, rtol=1e-15, atol=1e-16)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, want, rtol=1e-15, atol=1e-16)
    # unclipped: V − R everywhere
    x.grad = None
    value_loss(x, old, r, m, kind="unclipped", agg="token-sum").loss.backward()
    want_u = _t([[-0.9, -0.75, 0.25, 1.0, -1.0, 0.0]])
    torch.testing.assert_close(value_grad_naive(v, old, r, m, kind="unclipped", agg="token-sum"), want_u)
    torch.testing.assert_close(x.grad, want_u)


@pytest.mark.parametrize(
    ("est", "vc", "want"),
    [
        # d = [0, 0.5, −1, 2], clamp (−1, 1.5): d = −1 on the bound passes, d = 2 beyond it is 0
        ("k1", None, [1.0, 1.0, 1.0, 0.0]),  # k' = 1
        ("k2", None, [0.0, 0.5, -1.0, 0.0]),  # k' = d
        ("k3", None, [0.0, 1 - math.exp(-0.5), 1 - math.e, 0.0]),  # k' = 1 − e^{−d}
        ("abs", None, [0.0, 1.0, -1.0, 0.0]),  # k' = sign d, sign 0 = 0
        ("k1", 0.5, [1.0, 1.0, 0.0, 0.0]),  # |k| = 0.5 = c_v passes; k = −1 is clamped
        ("k2", 0.125, [0.0, 0.5, 0.0, 0.0]),  # k(0.5) = 0.125 = c_v passes; k(−1) = 0.5 clamped
    ],
)
def test_kl_loss_grad_hand_example(est: str, vc: float | None, want: list[float]) -> None:
    lp, ref, m = _t([[0.0, 0.5, -1.0, 2.0]]), torch.zeros(1, 4, dtype=F64), torch.ones(1, 4, dtype=torch.bool)
    x = lp.clone().requires_grad_(True)
    kl_loss(x, ref, m, est, "token-sum", log_ratio_clamp=(-1.0, 1.5), value_clamp=vc).backward()
    twin = kl_loss_grad_naive(lp, ref, m, est, "token-sum", log_ratio_clamp=(-1.0, 1.5), value_clamp=vc)
    torch.testing.assert_close(twin, _t([want]), rtol=1e-15, atol=1e-16)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, _t([want]), rtol=1e-15, atol=1e-16)


@pytest.mark.parametrize("kl_in", ["loss", "reward"])
def test_objective_grads_hand_example(kl_in: str) -> None:
    # One row, 2 tokens, token-mean (w = ½), ρ = 1 (l = l^old = 0), A = [1, −1]:
    #   ∂pg/∂l = −A·ρ·w = [−0.5, 0.5]
    # kl_in=loss, k1, d = l − l^ref = [1, −0.5]: ∂kl/∂l = w = [0.5, 0.5]; kl_coef = 0.5
    #   ∂J/∂l = [−0.5 + 0.25, 0.5 + 0.25] = [−0.25, 0.75]   (kl_in=reward: [−0.5, 0.5])
    # V = V_old = [1, 0] (no clip active), R = [0, 1]: ∂vf/∂V = (V − R)·w = [0.5, −0.5]; vf_coef 0.1
    #   ∂J/∂V = [0.05, −0.05]
    # entropy (ent_coef 0.5) is an input: nothing reaches the log-probs through it.
    hp = Hyperparams(kl_coef=0.5, vf_coef=0.1, ent_coef=0.5)
    conv = Convention.of(kl_in=kl_in, kl_estimator=KLEstimator.K1, loss_agg=LossAgg.TOKEN_MEAN)  # type: ignore[arg-type]  # str parsed
    ts = {
        "old_logprobs": _t([[0.0, 0.0]]),
        "ref_logprobs": _t([[-1.0, 0.5]]),
        "old_values": _t([[1.0, 0.0]]),
        "advantages": _t([[1.0, -1.0]]),
        "returns": _t([[0.0, 1.0]]),
        "entropy": _t([[2.0, 3.0]]),
    }
    mask = torch.ones(1, 2, dtype=torch.bool)
    lp, v = _t([[0.0, 0.0]], grad=True), _t([[1.0, 0.0]], grad=True)
    update_quantities(logprobs=lp, values=v, mask=mask, hp=hp, conv=conv, **ts).loss.backward()
    twin_lp, twin_v = objective_grads_naive(
        logprobs=lp.detach(), values=v.detach(), mask=mask, hp=hp, conv=conv, **ts
    )
    want_lp = _t([[-0.25, 0.75]] if kl_in == "loss" else [[-0.5, 0.5]])
    want_v = _t([[0.05, -0.05]])
    for got in (lp.grad, twin_lp):
        assert got is not None
        torch.testing.assert_close(got, want_lp, rtol=1e-15, atol=1e-16)
    for got in (v.grad, twin_v):
        assert got is not None
        torch.testing.assert_close(got, want_v, rtol=1e-15, atol=1e-16)


def test_objective_grads_with_kl_in_loss_need_ref_logprobs() -> None:
    z = torch.zeros(1, 2, dtype=F64)
    with pytest.raises(DumpError, match=r"'ref_logprobs'.*kl_loss stage under kl_coef=0.05 \(kl_in=loss\)"):
        objective_grads_naive(
            logprobs=z,
            values=z,
            old_logprobs=z,
            old_values=z,
            advantages=z,
            returns=z,
            mask=torch.ones(1, 2, dtype=torch.bool),
            hp=Hyperparams(),
            conv=Convention.of(kl_in="loss"),  # type: ignore[arg-type]  # str parsed
        )
