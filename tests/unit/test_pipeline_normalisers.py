"""``pipeline.update_quantities`` passes the global normalisers and ``hp.horizon`` to every loss term.

The micro-batch and DDP tests compare the pipeline with itself (a micro-batched step against the
whole step through the same function), so a normaliser the pipeline forgets to pass cancels out in
both. Here each loss of one micro-batch is compared with the core step called *directly* with the
global normaliser (``token_count``, ``seq_count``, the value mask's own ``value_token_count``,
``horizon``), and the total with ``pg + vf_coef·vf − ent_coef·H + kl_coef·kl`` (spec/ppo.md,
"total_loss") written out here. Each case also checks that the normaliser changes the value, so a
dropped one cannot pass by coincidence. No expected value of an aggregation mode is written here:
the modes' meaning is the core's (spec/ppo.md, "aggregate_loss").
"""

from __future__ import annotations

import pytest
import torch

from refppo.conventions import KLEstimator, KLPlacement, LossAgg, ScorePosition
from refppo.core.kl import token_kl
from refppo.core.objective import entropy_bonus, kl_loss
from refppo.core.policy import clipped_policy_loss
from refppo.core.rewards import token_rewards
from refppo.core.value import value_loss
from refppo.pipeline import (
    Convention,
    Hyperparams,
    Normalisers,
    rollout_quantities,
    update_quantities,
    value_mask,
)

B, T = 4, 6
LENGTHS = [6, 2, 4, 3]
MICRO = slice(1, 3)  # rows 1 and 2: a micro-batch whose local counts differ from the global ones
H = 11.0  # a horizon different from T


def _batch(seed: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd() -> torch.Tensor:
        return torch.randn(B, T, generator=g, dtype=torch.float64)

    old = -rnd().abs() - 0.5
    return {
        "mask": torch.arange(T).expand(B, T) < torch.tensor(LENGTHS).unsqueeze(1),
        "old_logprobs": old,
        "logprobs": old + 0.3 * rnd(),
        "ref_logprobs": old + 0.2 * rnd(),
        "advantages": rnd(),
        "old_values": rnd(),
        "values": rnd(),
        "returns": rnd(),
        "entropy": rnd().abs(),
    }


def _micro(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v[MICRO] for k, v in x.items()}


def _direct(
    x: dict[str, torch.Tensor],
    vm: torch.Tensor,
    hp: Hyperparams,
    conv: Convention,
    pol: dict[str, float],
    val: dict[str, float],
) -> dict[str, float]:
    """Each loss from the core step itself, with the normalisers given."""
    pg = clipped_policy_loss(
        x["logprobs"],
        x["old_logprobs"],
        x["advantages"],
        x["mask"],
        clip_low=hp.cliprange,
        agg=conv.loss_agg,
        **pol,
    )
    vf = value_loss(
        x["values"], x["old_values"], x["returns"], vm, clip=hp.cliprange_value, agg=conv.loss_agg, **val
    )
    ent = entropy_bonus(x["entropy"], x["mask"], conv.loss_agg, **pol)
    kl = kl_loss(x["logprobs"], x["ref_logprobs"], x["mask"], conv.kl_estimator, conv.loss_agg, **pol)
    return {"pg": float(pg.loss), "vf": float(vf.loss), "ent": float(ent), "kl": float(kl)}


def _pipeline(
    x: dict[str, torch.Tensor], vm: torch.Tensor, hp: Hyperparams, conv: Convention, norm: Normalisers
) -> dict[str, float]:
    uq = update_quantities(
        logprobs=x["logprobs"],
        values=x["values"],
        old_logprobs=x["old_logprobs"],
        old_values=x["old_values"],
        advantages=x["advantages"],
        returns=x["returns"],
        mask=x["mask"],
        value_mask_=vm,
        ref_logprobs=x["ref_logprobs"],
        entropy=x["entropy"],
        hp=hp,
        conv=conv,
        norm=norm,
    )
    out = {"pg": uq.pg_loss, "vf": uq.vf_loss, "ent": uq.entropy_loss, "kl": uq.kl_loss, "loss": uq.loss}
    return {k: float(v) for k, v in out.items()}


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-12 * max(1.0, abs(b))


@pytest.mark.parametrize("agg", list(LossAgg))
def test_update_quantities_passes_the_global_normalisers_to_every_term(agg: LossAgg) -> None:
    x = _batch()
    conv = Convention(
        loss_agg=agg,
        kl_in=KLPlacement.LOSS,
        kl_estimator=KLEstimator.K3,
        score_at=ScorePosition.AFTER_LAST_VALID,
    )
    hp = Hyperparams(vf_coef=0.25, ent_coef=0.01, kl_coef=0.1, horizon=H)
    vm_all = value_mask(x["mask"], conv.score_at)
    n_pol, n_val = float(x["mask"].sum()), float(vm_all.sum())
    assert n_pol != n_val  # the value mask has the score slot: its own token count
    norm = Normalisers(token_count=n_pol, seq_count=float(B), value_token_count=n_val)
    mx, vm = _micro(x), vm_all[MICRO]
    got = _pipeline(mx, vm, hp, conv, norm)
    pol = {"token_count": n_pol, "seq_count": float(B), "horizon": H}
    want = _direct(mx, vm, hp, conv, pol, dict(pol, token_count=n_val))
    for k in ("pg", "vf", "ent", "kl"):
        assert _close(got[k], want[k]), (k, got[k], want[k])
    total = want["pg"] + 0.25 * want["vf"] - 0.01 * want["ent"] + 0.1 * want["kl"]
    assert _close(got["loss"], total)
    # The normalisers matter for this mode: the local ones (or the policy count for the value
    # loss) give another value, so a dropped normaliser cannot pass the comparison above.
    local = _direct(mx, vm, hp, conv, {}, {})
    wrong_val = _direct(mx, vm, hp, conv, pol, pol)
    if agg is not LossAgg.TOKEN_SUM:  # token-sum takes no normaliser
        assert not _close(local["pg"], want["pg"])
        assert not _close(local["vf"], want["vf"])
    if agg is LossAgg.TOKEN_MEAN:
        assert not _close(wrong_val["vf"], want["vf"])


def test_update_quantities_uses_hp_horizon_for_the_sum_norm_mode() -> None:
    x = _batch(seed=8)
    conv = Convention(loss_agg=LossAgg.SEQ_MEAN_TOKEN_SUM_NORM, kl_in=KLPlacement.LOSS)
    hp = Hyperparams(vf_coef=0.5, ent_coef=0.02, kl_coef=0.2, horizon=H)
    got = _pipeline(x, x["mask"], hp, conv, Normalisers())
    want = _direct(x, x["mask"], hp, conv, {"horizon": H}, {"horizon": H})
    default_h = _direct(x, x["mask"], hp, conv, {}, {})
    for k in ("pg", "vf", "ent", "kl"):
        assert _close(got[k], want[k]), (k, got[k], want[k])
        assert not _close(default_h[k], want[k])  # H = 11 is not the default T = 6


def test_update_quantities_value_token_count_applies_to_the_value_loss_only() -> None:
    x = _batch(seed=9)
    conv = Convention(score_at=ScorePosition.AFTER_LAST_VALID)
    hp = Hyperparams()
    vm = value_mask(x["mask"], conv.score_at)
    got = _pipeline(x, vm, hp, conv, Normalisers(value_token_count=40.0))
    want = _direct(x, vm, hp, conv, {}, {"token_count": 40.0})
    assert _close(got["vf"], want["vf"]) and _close(got["pg"], want["pg"])
    assert not _close(_direct(x, vm, hp, conv, {}, {})["vf"], want["vf"])


def test_value_mask_keeps_width_t_when_no_row_reaches_the_last_position() -> None:
    # Lengths 2 and 3 of T = 5, score at the last valid token: the value mask is the mask itself,
    # [B, T] wide although no score sits at T − 1.
    mask = torch.arange(5).expand(2, 5) < torch.tensor([[2], [3]])
    vm = value_mask(mask, ScorePosition.LAST_VALID)
    assert vm.shape == (2, 5) and bool((vm == mask).all())
    # after_last_valid adds the slot after the last valid token: positions 2 and 3.
    want = torch.arange(5).expand(2, 5) <= torch.tensor([[2], [3]])
    assert bool((value_mask(mask, ScorePosition.AFTER_LAST_VALID) == want).all())


def test_rollout_quantities_passes_the_kl_clamps_to_token_kl() -> None:
    x = _batch(seed=11)
    conv = Convention(kl_estimator=KLEstimator.K3, kl_log_ratio_clamp=(-0.1, 0.1), kl_value_clamp=0.005)
    rq = rollout_quantities(
        scores=torch.randn(B, generator=torch.Generator().manual_seed(1), dtype=torch.float64),
        old_logprobs=x["old_logprobs"],
        ref_logprobs=x["ref_logprobs"],
        old_values=x["old_values"],
        mask=x["mask"],
        hp=Hyperparams(),
        conv=conv,
    )
    args = (x["old_logprobs"], x["ref_logprobs"], x["mask"], KLEstimator.K3)
    want = token_kl(*args, log_ratio_clamp=(-0.1, 0.1), value_clamp=0.005)
    assert bool((rq.kl == want).all())
    # Both clamps bind on this batch (k3 at d = 0.1 is 0.00484 < 0.005, at d = −0.1 0.00517 > 0.005):
    # without either the KL differs.
    assert not bool((token_kl(*args, value_clamp=0.005) == want).all())
    assert not bool((token_kl(*args, log_ratio_clamp=(-0.1, 0.1)) == want).all())


def test_rollout_rewards_carry_no_kl_when_kl_is_in_the_loss() -> None:
    # kl_in = loss: the reward is the score alone (spec/ppo.md, token_rewards with kl = None), so
    # each row's rewards sum to its score and the reported reward KL is 0.
    x = _batch(seed=12)
    scores = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64)
    rq = rollout_quantities(
        scores=scores,
        old_logprobs=x["old_logprobs"],
        ref_logprobs=x["ref_logprobs"],
        old_values=x["old_values"],
        mask=x["mask"],
        hp=Hyperparams(kl_coef=0.3),
        conv=Convention(kl_in=KLPlacement.LOSS),
    )
    assert rq.token_rewards.sum(dim=1).tolist() == scores.tolist()
    assert bool((rq.kl == 0).all())


@pytest.mark.parametrize("where", list(ScorePosition))
def test_rollout_rewards_put_the_score_where_the_convention_says(where: ScorePosition) -> None:
    # The reward-model score lands at p(L) of the convention (rewards.token_rewards, called directly).
    x = _batch(seed=13)
    scores = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64)
    hp, conv = Hyperparams(kl_coef=0.1), Convention(score_at=where)
    rq = rollout_quantities(
        scores=scores,
        old_logprobs=x["old_logprobs"],
        ref_logprobs=x["ref_logprobs"],
        old_values=x["old_values"],
        mask=x["mask"],
        hp=hp,
        conv=conv,
    )
    want = token_rewards(scores, rq.kl, x["mask"], 0.1, score_at=where)
    assert bool((rq.token_rewards == want).all())
