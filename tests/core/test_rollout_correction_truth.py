"""Truth tables of the rollout correction by hand: in every region the VALUE and the GRADIENT w.r.t. the
log-probs (torch autograd) equal closed forms written here (refppo/core/rollout_correction.py,
rollout_losses.py, cispo.py; spec/rollout-correction.md).

Regions: the importance weight ``w`` below / inside / above ``[C_low, C_high] = [0.5, 2]`` (and on
each bound: closed), truncated or masked; the PPO ratio ``ρ`` clipped or not for ``A > 0`` and ``A < 0``
(``ε = 0.2``, no dual clip); detached or not; CISPO's clipped weight in each of its three regions.
"""

from __future__ import annotations

import math

import pytest
import torch

from refppo.core.cispo import cispo_policy_loss, weighted_logprob_loss
from refppo.core.policy import clipped_policy_loss
from refppo.core.rollout_correction import is_weights
from refppo.core.rollout_losses import (
    BehaviourWeight,
    PolicyClip,
    corrected_policy_loss,
    decoupled_policy_loss,
)

F64 = torch.float64
LO, HI = 0.5, 2.0

# (region, log w, C_low, C_high, truncated w', masked w', kept by the mask, ∂w'/∂l^num truncated, masked)
WEIGHT_TABLE = [
    ("w<C_low", math.log(0.25), LO, HI, 0.5, 0.0, False, 0.0, 0.0),
    ("inside", math.log(1.3), LO, HI, 1.3, 1.3, True, 1.3, 1.3),
    ("w>C_high", math.log(4.0), LO, HI, 2.0, 0.0, False, 0.0, 0.0),
    ("w=C_low (closed)", 0.0, 1.0, HI, 1.0, 1.0, True, 1.0, 1.0),  # w = e^0 = 1 exactly, on the bound
    ("w=C_high (closed)", 0.0, LO, 1.0, 1.0, 1.0, True, 1.0, 1.0),
]


@pytest.mark.parametrize(
    ("region", "log_w", "lo", "hi", "trunc", "masked", "kept", "g_trunc", "g_mask"), WEIGHT_TABLE
)
def test_weight_truth_table(
    region: str, log_w: float, lo: float, hi: float, trunc: float, masked: float, kept: bool, g_trunc: float,
    g_mask: float,
) -> None:  # fmt: skip
    beh = torch.tensor([[-1.0, 7.5]], dtype=F64)  # one valid token, junk on the padding
    mask = torch.tensor([[True, False]])
    for mode, value, grad, keep in (("truncate", trunc, g_trunc, True), ("mask", masked, g_mask, kept)):
        num = (beh + torch.tensor([[log_w, 0.0]], dtype=F64)).requires_grad_(True)
        w = is_weights(num, beh, mask, mode=mode, low=lo, high=hi, detach=False)
        w.weight.sum().backward()
        assert num.grad is not None
        assert float(w.weight.detach()[0, 0]) == pytest.approx(value, rel=1e-12), f"{region} {mode}: value"
        assert bool(w.keep[0, 0]) is keep, f"{region} {mode}: keep"
        assert float(num.grad[0, 0]) == pytest.approx(grad, rel=1e-12, abs=0.0), f"{region} {mode}: ∂w'/∂l"
        assert float(num.grad[0, 1]) == 0.0 and float(w.weight.detach()[0, 1]) == 0.0
        assert not is_weights(num, beh, mask, mode=mode, low=lo, high=hi).weight.requires_grad, "detached"


def test_sequence_weight_gradient_product_is_w_and_geometric_is_w_over_length() -> None:
    # one row of 3 valid tokens, d = (0.1, −0.2, 0.3): Σd = 0.2, mean 0.2/3; not detached, no bound
    beh = torch.tensor([[-1.0, -2.0, -0.5, 9.0]], dtype=F64)
    d = torch.tensor([[0.1, -0.2, 0.3, 0.0]], dtype=F64)
    mask = torch.tensor([[True, True, True, False]])
    for agg, w_b, per_token_grad in (
        ("product", math.exp(0.2), 3 * math.exp(0.2)),
        ("geometric", math.exp(0.2 / 3), math.exp(0.2 / 3)),
    ):
        num = (beh + d).requires_grad_(True)
        w = is_weights(num, beh, mask, level="sequence", agg=agg, detach=False)
        torch.testing.assert_close(w.weight[0, :3], torch.full((3,), w_b, dtype=F64), rtol=1e-13, atol=0.0)
        w.weight.sum().backward()  # Σ_t w_b = 3·w_b; ∂/∂l_t = 3·∂w_b/∂l_t = 3·w_b (product), w_b (geometric)
        assert num.grad is not None
        torch.testing.assert_close(
            num.grad[0, :3], torch.full((3,), per_token_grad, dtype=F64), rtol=1e-13, atol=0.0
        )
        assert float(num.grad[0, 3]) == 0.0


def test_log_clamp_caps_the_weight_and_blocks_its_gradient() -> None:
    beh = torch.zeros(1, 2, dtype=F64)
    num = torch.tensor([[0.5, 0.1]], dtype=F64, requires_grad=True)  # κ = 0.3: the first is clamped
    w = is_weights(num, beh, torch.ones(1, 2, dtype=torch.bool), log_ratio_clamp=0.3, detach=False)
    w.weight.sum().backward()
    assert num.grad is not None
    torch.testing.assert_close(
        w.weight, torch.tensor([[math.exp(0.3), math.exp(0.1)]], dtype=F64), rtol=1e-14, atol=0.0
    )
    assert num.grad.tolist()[0] == [0.0, pytest.approx(math.exp(0.1), rel=1e-14)]


# PPO regions (ε = 0.2): (name, A, ρ, ℓ^PPO, ∂ℓ^PPO/∂l per token before 1/N)
PPO = [
    ("A>0 inside", 2.0, 1.1, -2.2, -2.2),
    ("A>0 ρ>1+ε (clipped)", 2.0, 1.5, -2.4, 0.0),
    ("A<0 ρ>1+ε (unclipped)", -2.0, 1.5, 3.0, 3.0),
    ("A<0 ρ<1−ε (clipped)", -2.0, 0.5, 1.6, 0.0),
]
# weight regions of [0.5, 2]: (name, w, truncated w', masked w')
W = [("w<C_low", 0.25, 0.5, 0.0), ("inside", 1.3, 1.3, 1.3), ("w>C_high", 4.0, 2.0, 0.0)]


def _row(ppo: tuple[str, float, float, float, float], w: float) -> dict[str, torch.Tensor]:
    """Three valid tokens in one PPO region and one weight region, two junk positions (N = 3)."""
    _, a, rho, _, _ = ppo
    old = torch.tensor([[-1.0, -2.0, -0.7, float("nan"), 7.0]], dtype=F64)
    beh = old - math.log(w)
    cur = old + math.log(rho)
    cur[0, 3:] = float("inf")
    adv = torch.tensor([[a, a, a, float("nan"), float("nan")]], dtype=F64)
    return {"old": old, "beh": beh, "cur": cur, "adv": adv, "mask": torch.tensor([[True] * 3 + [False] * 2])}


@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("wr", W, ids=[w[0] for w in W])
@pytest.mark.parametrize("ppo", PPO, ids=[p[0] for p in PPO])
def test_corrected_surrogate_truth_table(
    ppo: tuple[str, float, float, float, float], wr: tuple[str, float, float, float], mode: str
) -> None:
    r = _row(ppo, wr[1])
    c = wr[2] if mode == "truncate" else wr[3]
    w = is_weights(r["old"], r["beh"], r["mask"], mode=mode, low=LO, high=HI)
    x = r["cur"].clone().requires_grad_(True)
    out = corrected_policy_loss(x, r["old"], r["adv"], r["mask"], w.weight, keep=w.keep, clip=PolicyClip(0.2))
    out.loss.backward()
    assert x.grad is not None
    value, grad = c * ppo[3], c * ppo[4] / 3  # ℓ = c·ℓ^PPO, ∂ = c·∂ℓ^PPO/∂l / N
    torch.testing.assert_close(
        out.per_token[0, :3], torch.full((3,), value, dtype=F64), rtol=1e-12, atol=1e-12
    )
    torch.testing.assert_close(out.loss, torch.tensor(value, dtype=F64), rtol=1e-12, atol=1e-12)
    if grad == 0.0:
        assert bool((x.grad[0, :3] == 0).all()), (
            f"{ppo[0]}, {wr[0]}, {mode}: the gradient must vanish exactly"
        )
    else:
        torch.testing.assert_close(x.grad[0, :3], torch.full((3,), grad, dtype=F64), rtol=1e-12, atol=0.0)
    assert bool((x.grad[0, 3:] == 0).all())
    # the statistics are the unweighted PPO ones, whatever the weight
    assert float(out.clipfrac) == (1.0 if ppo[4] == 0.0 else 0.0)


@pytest.mark.parametrize("wr", W, ids=[w[0] for w in W])
@pytest.mark.parametrize("ppo", PPO, ids=[p[0] for p in PPO])
def test_detached_and_differentiable_weights_differ_exactly_where_the_weight_passes_a_gradient(
    ppo: tuple[str, float, float, float, float], wr: tuple[str, float, float, float]
) -> None:
    # the bypass form: the weight's numerator is the CURRENT l, so its gradient can flow (verl #4105)
    r = _row(ppo, 1.0)
    beh = r["cur"] - math.log(wr[1])  # w = π_θ/π^beh in the drawn weight region
    grads = []
    for detach in (True, False):
        x = r["cur"].clone().requires_grad_(True)
        w = is_weights(x, beh, r["mask"], low=LO, high=HI, detach=detach)
        corrected_policy_loss(
            x, r["old"], r["adv"], r["mask"], w.weight, clip=PolicyClip(0.2)
        ).loss.backward()
        assert x.grad is not None
        grads.append(x.grad[0, :3].clone())
    c, inside = wr[2], wr[1] == wr[2]  # truncated weight; it passes a gradient only strictly inside
    detached = c * ppo[4] / 3
    differentiable = detached + (ppo[3] * c / 3 if inside else 0.0)  # + ℓ^PPO·∂w'/∂l / N, ∂w'/∂l = w'
    torch.testing.assert_close(grads[0], torch.full((3,), detached, dtype=F64), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grads[1], torch.full((3,), differentiable, dtype=F64), rtol=1e-12, atol=1e-15)
    assert bool((grads[0] != grads[1]).all()) is inside, "they differ iff the weight is inside its band"


# CISPO, ε_low = 0.2, ε_high = 0.28: (ρ, c = clip(ρ)); every region keeps a gradient −c·A/N
CISPO = [(0.5, 0.8), (1.0, 1.0), (1.5, 1.28)]


@pytest.mark.parametrize("a", [2.0, -2.0])
@pytest.mark.parametrize(("rho", "c"), CISPO)
def test_cispo_truth_table_every_region_keeps_its_gradient(rho: float, c: float, a: float) -> None:
    r = _row(("", a, rho, 0.0, 0.0), 1.0)
    x = r["cur"].clone().requires_grad_(True)
    out = cispo_policy_loss(x, r["old"], r["adv"], r["mask"], clip_low=0.2, clip_high=0.28)
    out.loss.backward()
    assert x.grad is not None
    value = -c * a * r["cur"][0, :3]  # −sg(c)·A·l: the value carries the log-prob itself
    torch.testing.assert_close(out.per_token[0, :3], value, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad[0, :3], torch.full((3,), -c * a / 3, dtype=F64), rtol=1e-12, atol=0.0)
    assert float(out.clipfrac) == (0.0 if rho == 1.0 else 1.0)
    # the clipped surrogate's gradient vanishes in its clipped regions; CISPO's never does
    ppo = clipped_policy_loss(x, r["old"], r["adv"], r["mask"], clip_low=0.2, clip_high=0.28)
    clipped = (a > 0 and rho > 1.28) or (a < 0 and rho < 0.8)
    g = torch.autograd.grad(ppo.loss, x)[0][0, 0].item()
    assert g == (0.0 if clipped else pytest.approx(-a * rho / 3, rel=1e-12))


def test_cispo_without_a_lower_bound_is_trls_cap() -> None:
    # TRL 1.16.0 loss_type="cispo": sg(min(ρ, ε_max)), ε_max = 2 -> clip_low None, clip_high = 1
    r = _row(("", 1.0, 0.5, 0.0, 0.0), 1.0)
    out = cispo_policy_loss(r["cur"], r["old"], r["adv"], r["mask"], clip_low=None, clip_high=1.0)
    torch.testing.assert_close(
        out.per_token[0, :3], -0.5 * r["cur"][0, :3], rtol=1e-12, atol=1e-12
    )  # c = ρ = 0.5


@pytest.mark.parametrize("a", [2.0, -2.0])
def test_weighted_reinforce_gradient_is_minus_w_a_and_a_live_weight_adds_a_term(a: float) -> None:
    r = _row(("", a, 1.0, 0.0, 0.0), 1.0)
    beh = r["cur"] - math.log(1.3)  # w = 1.3 inside [0.5, 2]
    out = []
    for detach in (True, False):
        x = r["cur"].clone().requires_grad_(True)
        w = is_weights(x, beh, r["mask"], high=HI, detach=detach).weight
        weighted_logprob_loss(x, w, r["adv"], r["mask"])[0].backward()
        assert x.grad is not None
        out.append(x.grad[0, :3])
    torch.testing.assert_close(out[0], torch.full((3,), -1.3 * a / 3, dtype=F64), rtol=1e-12, atol=0.0)
    # not detached: −A·(w + l·∂w/∂l)/N = −A·w·(1 + l)/N
    torch.testing.assert_close(out[1], -1.3 * a * (1 + r["cur"][0, :3]) / 3, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("ppo", PPO, ids=[p[0] for p in PPO])
@pytest.mark.parametrize(("w", "kept"), [(1.5, True), (3.0, False)])
def test_decoupled_truth_table_and_the_ratio_is_against_the_proximal_policy(
    ppo: tuple[str, float, float, float, float], w: float, kept: bool
) -> None:
    r = _row(ppo, w)  # π_θ/π^prox = ρ, π^prox/π^beh = w; AReaL mask mode, cap 2
    x = r["cur"].clone().requires_grad_(True)
    out = decoupled_policy_loss(
        x, r["old"], r["beh"], r["adv"], r["mask"], behaviour=BehaviourWeight(high=2.0)
    )
    out.policy.loss.backward()
    assert x.grad is not None
    c = w if kept else 0.0
    torch.testing.assert_close(
        out.policy.per_token[0, :3], torch.full((3,), c * ppo[3], dtype=F64), rtol=1e-12, atol=1e-12
    )
    torch.testing.assert_close(
        x.grad[0, :3], torch.full((3,), c * ppo[4] / 3, dtype=F64), rtol=1e-12, atol=1e-15
    )
    assert out.weights.keep[0, :3].tolist() == [kept] * 3
    # the ratio against the behaviour policy (the bug "old := behaviour"): max(−A·ρw, −A·clip(ρw)); it
    # equals the decoupled term where both are unclipped and kept (w·ρ = π_θ/π^beh), not where a clip acts
    a, rho = ppo[1], ppo[2]
    wrong = max(-a * rho * w, -a * min(max(rho * w, 0.8), 1.2))
    got_wrong = clipped_policy_loss(r["cur"], r["beh"], r["adv"], r["mask"]).per_token[0, :3]
    torch.testing.assert_close(got_wrong, torch.full((3,), wrong, dtype=F64), rtol=1e-12, atol=1e-12)
    same = kept and ppo[4] != 0.0 and wrong == pytest.approx(-a * rho * w, rel=1e-12)
    assert (wrong == pytest.approx(c * ppo[3], rel=1e-12)) is same
