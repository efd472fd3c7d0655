"""The per-token loss functions the stages call (``clipped_policy_token_loss``,
``gspo_policy_token_loss``, ``value_token_loss``, ``approx_kl_k2_all_positions``) against their naive
twins token by token, at their documented defaults and with every argument off its default (each
argument must reach the math). The mutation run over the stage-table layout found them covered only
through the pipeline's tests, not the core's (#20)."""

from __future__ import annotations

import pytest
import torch

from refppo.core.gspo import gspo_policy_loss_naive, gspo_policy_token_loss
from refppo.core.policy import (
    approx_kl_k2_all_positions,
    clipped_policy_loss_naive,
    clipped_policy_token_loss,
)
from refppo.core.value import value_loss_naive, value_token_loss

F64 = torch.float64


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 9
    lengths = torch.tensor([9, 4, 6, 1, 7, 3])
    mask = torch.arange(T).expand(B, T) < lengths.unsqueeze(1)
    old = -torch.rand(B, T, generator=g, dtype=F64) - 0.1
    junk = torch.full((B, T), 1e30, dtype=F64)
    return {
        "mask": mask,
        "old": torch.where(mask, old, junk),
        "new": torch.where(mask, old + 0.6 * torch.randn(B, T, generator=g, dtype=F64), junk),
        "adv": torch.where(mask, torch.randn(B, T, generator=g, dtype=F64), junk),
        "v": torch.where(mask, torch.randn(B, T, generator=g, dtype=F64), junk),
        "v_old": torch.where(mask, torch.randn(B, T, generator=g, dtype=F64), junk),
        "ret": torch.where(mask, torch.randn(B, T, generator=g, dtype=F64), junk),
    }


def _close(t: torch.Tensor, rows: list[list[float]], m: torch.Tensor, tol: float = 1e-12) -> None:
    want = torch.tensor(rows, dtype=F64)
    assert float(torch.where(m, t - want, 0.0).abs().max()) <= tol


POLICY_ARGS = [
    {},
    {"clip_low": 0.1, "clip_high": 0.3},
    {"clip_low": 0.15, "dual_clip": 2.0},
    {"log_ratio_clamp": 0.3},
]


@pytest.mark.parametrize("kw", POLICY_ARGS, ids=lambda k: ",".join(k) or "defaults")
def test_clipped_policy_token_loss_equals_its_naive_twin_per_token(kw: dict[str, float]) -> None:
    x = _batch()
    got = clipped_policy_token_loss(x["new"], x["old"], x["adv"], x["mask"], **kw)
    want = clipped_policy_loss_naive(x["new"], x["old"], x["adv"], x["mask"], **kw)
    _close(got.per_token, want.per_token, x["mask"])
    _close(got.ratio, want.ratio, x["mask"])
    assert abs(float(got.clipfrac) - want.clipfrac) <= 1e-12 and want.clipfrac > 0  # the clip binds
    assert abs(float(got.clipfrac_lower) - want.clipfrac_lower) <= 1e-12
    assert abs(float(got.approx_kl) - want.approx_kl) <= 1e-12
    assert abs(float(got.approx_kl_k2) - want.approx_kl_k2) <= 1e-12


def test_the_default_clip_range_is_0_2() -> None:
    x = _batch(1)
    got = clipped_policy_token_loss(x["new"], x["old"], x["adv"], x["mask"])
    for eps, same in ((0.2, True), (0.1, False), (0.3, False)):
        want = clipped_policy_loss_naive(x["new"], x["old"], x["adv"], x["mask"], clip_low=eps)
        err = float(
            torch.where(x["mask"], got.per_token - torch.tensor(want.per_token, dtype=F64), 0.0).abs().max()
        )
        assert (err <= 1e-12) is same, eps
    g = gspo_policy_token_loss(x["new"], x["old"], x["adv"], x["mask"])
    for eps, same in ((0.2, True), (0.1, False)):
        gw = gspo_policy_loss_naive(x["new"], x["old"], x["adv"], x["mask"], clip_low=eps)
        assert (abs(float(g.per_token.sum() / x["mask"].sum()) - float(gw.loss)) <= 1e-12) is same, eps


@pytest.mark.parametrize(
    "kw",
    [{}, {"clip_low": 0.05, "clip_high": 0.1}, {"log_ratio_max": 0.05}],
    ids=lambda k: ",".join(k) or "defaults",
)
def test_gspo_policy_token_loss_equals_its_naive_twin(kw: dict[str, float]) -> None:
    x = _batch(2)
    got = gspo_policy_token_loss(x["new"], x["old"], x["adv"], x["mask"], **kw)
    want = gspo_policy_loss_naive(x["new"], x["old"], x["adv"], x["mask"], **kw)
    n = float(x["mask"].sum())
    assert abs(float(got.per_token.sum()) / n - float(want.loss)) <= 1e-12  # token-mean of the per-token form
    assert abs(float(got.clipfrac) - float(want.clipfrac)) <= 1e-12


@pytest.mark.parametrize(
    "kw",
    [{}, {"clip": 0.05}, {"clip": 0.05, "clip_form": "delta"}, {"kind": "unclipped", "clip": None}],
    ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "defaults",
)
def test_value_token_loss_equals_its_naive_twin_per_token(kw: dict[str, object]) -> None:
    x = _batch(3)
    got = value_token_loss(x["v"], x["v_old"], x["ret"], x["mask"], **kw)  # type: ignore[arg-type]  # parametrized
    want = value_loss_naive(x["v"], x["v_old"], x["ret"], x["mask"], **kw)  # type: ignore[arg-type]  # parametrized
    _close(got.per_token, want.per_token, x["mask"])
    assert abs(float(got.clipfrac) - want.clipfrac) <= 1e-12
    if kw.get("clip") == 0.05:
        assert want.clipfrac > 0  # the clip binds
    default = value_token_loss(x["v"], x["v_old"], x["ret"], x["mask"])
    at_02 = value_loss_naive(x["v"], x["v_old"], x["ret"], x["mask"], clip=0.2)
    _close(default.per_token, at_02.per_token, x["mask"])


def test_approx_kl_k2_all_positions_is_half_the_squared_log_ratio_over_every_position() -> None:
    x = _batch(4)
    m = x["mask"]
    B, T = m.shape
    total = 0.0
    for b in range(B):
        for t in range(T):
            if m[b, t]:
                d = float(x["new"][b, t] - x["old"][b, t])
                total += 0.5 * d * d
    want = total / (B * T)  # padding counts in the denominator (TRL's approxkl over the frame)
    got = float(approx_kl_k2_all_positions(x["new"], x["old"], m))
    assert abs(got - want) <= 1e-14
    # a row with no valid token is allowed here (the mask check without the non-empty-row rule)
    m2 = m.clone()
    m2[0] = False
    d0 = torch.where(m[0], x["new"][0] - x["old"][0], 0.0)
    want2 = (total - 0.5 * float((d0 * d0).sum())) / (B * T)
    assert abs(float(approx_kl_k2_all_positions(x["new"], x["old"], m2)) - want2) <= 1e-14
