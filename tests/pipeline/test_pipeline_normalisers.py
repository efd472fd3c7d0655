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

from refppo.agg_conventions import MASK_AGGS
from refppo.conventions import KLEstimator, KLPlacement, LossAgg, ScorePosition
from refppo.core.kl import token_kl
from refppo.core.normalize import normalize
from refppo.core.objective import entropy_bonus, kl_loss
from refppo.core.policy import clipped_policy_loss
from refppo.core.rewards import token_rewards
from refppo.core.value import value_loss
from refppo.pipeline.blocks import Normalisers
from refppo.pipeline.rollout import value_mask
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import rollout_quantities, update_quantities

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
        agg=conv.agg.loss,
        **pol,
    )
    vf = value_loss(
        x["values"], x["old_values"], x["returns"], vm, clip=hp.cliprange_value, agg=conv.agg.loss, **val
    )
    ent = entropy_bonus(x["entropy"], x["mask"], conv.agg.loss, **pol)
    kl = kl_loss(x["logprobs"], x["ref_logprobs"], x["mask"], conv.kl.estimator, conv.agg.loss, **pol)
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


# prompt-mean's split (a table of N_p by prompt): tests/pipeline/test_prompt_mean_agg.py
@pytest.mark.parametrize("agg", list(MASK_AGGS))
def test_update_quantities_passes_the_global_normalisers_to_every_term(agg: LossAgg) -> None:
    x = _batch()
    conv = Convention.of(
        loss_agg=agg,
        kl_in=KLPlacement.LOSS,
        kl_estimator=KLEstimator.K3,
        score_at=ScorePosition.AFTER_LAST_VALID,
    )
    hp = Hyperparams(vf_coef=0.25, ent_coef=0.01, kl_coef=0.1, horizon=H)
    vm_all = value_mask(x["mask"], conv.reward.score_at)
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
    conv = Convention.of(loss_agg=LossAgg.SEQ_MEAN_TOKEN_SUM_NORM, kl_in=KLPlacement.LOSS)
    hp = Hyperparams(vf_coef=0.5, ent_coef=0.02, kl_coef=0.2, horizon=H)
    got = _pipeline(x, x["mask"], hp, conv, Normalisers())
    want = _direct(x, x["mask"], hp, conv, {"horizon": H}, {"horizon": H})
    default_h = _direct(x, x["mask"], hp, conv, {}, {})
    for k in ("pg", "vf", "ent", "kl"):
        assert _close(got[k], want[k]), (k, got[k], want[k])
        assert not _close(default_h[k], want[k])  # H = 11 is not the default T = 6


def test_update_quantities_value_token_count_applies_to_the_value_loss_only() -> None:
    x = _batch(seed=9)
    conv = Convention.of(score_at=ScorePosition.AFTER_LAST_VALID)
    hp = Hyperparams()
    vm = value_mask(x["mask"], conv.reward.score_at)
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
    conv = Convention.of(kl_estimator=KLEstimator.K3, kl_log_ratio_clamp=(-0.1, 0.1), kl_value_clamp=0.005)
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
        conv=Convention.of(kl_in=KLPlacement.LOSS),
    )
    assert rq.token_rewards.sum(dim=1).tolist() == scores.tolist()
    assert bool((rq.kl == 0).all())


@pytest.mark.parametrize("where", list(ScorePosition))
def test_rollout_rewards_put_the_score_where_the_convention_says(where: ScorePosition) -> None:
    # The reward-model score lands at p(L) of the convention (rewards.token_rewards, called directly).
    x = _batch(seed=13)
    scores = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64)
    hp, conv = Hyperparams(kl_coef=0.1), Convention.of(score_at=where)
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


# ----- every non-default convention reaches its core step (survivors of tools/mutate.py's final run)


def test_update_quantities_passes_every_policy_value_and_kl_convention() -> None:
    """|l − l_old| = 0.8 on every token (ρ = e^±0.8, clamped to e^±0.6) and advantages of both signs,
    so the upper clip, the dual clip (1.5 < e^0.6) and the clamp all bind. Non-default clip ranges,
    dual clip, log-ratio clamp, value clip range and form, KL
    clamps and
    KL in the loss: ``update_quantities`` equals each core step called directly with them, and each
    setting changes the value on this batch (so dropping one cannot pass)."""
    x = _batch(seed=17)
    vm = x["mask"]
    hp = Hyperparams(cliprange=0.1, cliprange_high=0.35, cliprange_value=0.05, kl_coef=0.3, vf_coef=0.5)
    conv = Convention.of(
        dual_clip=1.5,
        log_ratio_clamp=0.6,
        value_clip_form="delta",
        kl_in=KLPlacement.LOSS,
        kl_estimator=KLEstimator.K3,
        kl_log_ratio_clamp=(-0.1, 0.15),
        kl_value_clamp=0.008,
    )
    x["logprobs"] = x["old_logprobs"] + 0.8 * torch.sign(
        torch.randn(B, T, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    )
    got = _pipeline(x, vm, hp, conv, Normalisers())
    pol = {"clip_low": 0.1, "clip_high": 0.35, "dual_clip": 1.5, "log_ratio_clamp": 0.6}
    lp = (x["logprobs"], x["old_logprobs"], x["advantages"], x["mask"])
    pg = float(clipped_policy_loss(*lp, **pol).loss)
    va = (x["values"], x["old_values"], x["returns"], vm)
    vf = float(value_loss(*va, clip=0.05, kind="clipped", clip_form="delta").loss)
    kla = (x["logprobs"], x["ref_logprobs"], x["mask"], KLEstimator.K3, LossAgg.TOKEN_MEAN)
    kl = float(kl_loss(*kla, log_ratio_clamp=(-0.1, 0.15), value_clamp=0.008))
    assert _close(got["pg"], pg) and _close(got["vf"], vf) and _close(got["kl"], kl), (got, pg, vf, kl)
    # each setting matters here
    for drop in ("clip_high", "dual_clip", "log_ratio_clamp"):
        other = {k: v for k, v in pol.items() if k != drop}
        assert not _close(float(clipped_policy_loss(*lp, **other).loss), pg), drop
    assert not _close(float(value_loss(*va, kind="clipped", clip_form="delta").loss), vf)
    assert not _close(float(value_loss(*va, clip=0.05, kind="unclipped").loss), vf)
    assert not _close(float(kl_loss(*kla, value_clamp=0.008)), kl)
    assert not _close(float(kl_loss(*kla, log_ratio_clamp=(-0.1, 0.15))), kl)


def test_rollout_quantities_passes_every_whitening_setting_and_the_all_reduce() -> None:
    """Population variance, a large eps applied as ``1/(σ + ε)``, and reward whitening: the rewards and
    advantages equal ``normalize`` called directly with those settings; the all-reduce hook is used by
    both normalisations."""
    x = _batch(seed=23)
    scores = torch.randn(B, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    hp = Hyperparams(whiten_eps=0.5, kl_coef=0.1)
    conv = Convention.of(whiten_variance="population", whiten_eps_at="std", whiten_rewards="masked")
    calls: list[int] = []

    def one_rank(t: torch.Tensor) -> torch.Tensor:  # a SUM all-reduce over a single rank
        calls.append(int(t.numel()))
        return t

    args = {
        "old_logprobs": x["old_logprobs"],
        "ref_logprobs": x["ref_logprobs"],
        "old_values": x["old_values"],
    }
    rq = rollout_quantities(scores=scores, mask=x["mask"], hp=hp, conv=conv, all_reduce=one_rank, **args)
    assert len(calls) >= 4, "both normalisations (rewards and advantages) all-reduce their moments"
    base = rollout_quantities(scores=scores, mask=x["mask"], hp=hp, conv=Convention(), **args)
    vm = rq.value_mask
    raw_rewards = token_rewards(scores, base.kl, x["mask"], 0.1, score_at=ScorePosition.LAST_VALID)
    settings = {"unbiased": False, "eps": 0.5, "eps_at": "std"}
    want_r = normalize(raw_rewards, vm, "masked", **settings)
    assert torch.allclose(rq.token_rewards, want_r, rtol=0, atol=1e-12)
    want_a = normalize(rq.advantages_raw, x["mask"], "masked", **settings)
    assert torch.allclose(rq.advantages, want_a, rtol=0, atol=1e-12)
    for key, default in (("unbiased", True), ("eps", 1e-8), ("eps_at", "variance")):
        other = {**settings, key: default}
        assert not torch.allclose(normalize(rq.advantages_raw, x["mask"], "masked", **other), want_a), key
        assert not torch.allclose(normalize(raw_rewards, vm, "masked", **other), want_r), key


def test_update_quantities_passes_the_value_loss_kind_and_clip_form() -> None:
    """``value_loss=unclipped``: the pipeline's value loss is ½(V − R)² averaged (here 0.5·(0.1² +
    0.2²)/2 = 0.0125 with V = (0.3, 0.5), R = (0.2, 0.3), V_old far away so the clipped loss would
    differ). ``value_clip_form=delta`` in float32: the tie of tests/core/test_core_value.py (V_old
    0.1, V −0.05, R −0.04, ε_v 0.2) counts as clipped only in the delta form (vf_clipfrac 1 vs 0)."""
    one = torch.ones(1, 2, dtype=torch.bool)
    f64 = {"dtype": torch.float64}
    base = {
        "logprobs": torch.zeros(1, 2, **f64),
        "old_logprobs": torch.zeros(1, 2, **f64),
        "advantages": torch.zeros(1, 2, **f64),
        "mask": one,
    }
    v, v_old, ret = (
        torch.tensor([[0.3, 0.5]], **f64),
        torch.tensor([[2.0, 2.0]], **f64),
        torch.tensor([[0.2, 0.3]], **f64),
    )
    hp = Hyperparams(cliprange_value=0.2)
    uq = update_quantities(
        **base, values=v, old_values=v_old, returns=ret, hp=hp, conv=Convention.of(value_loss="unclipped")
    )
    assert abs(float(uq.vf_loss) - 0.0125) <= 1e-15
    clipped = update_quantities(**base, values=v, old_values=v_old, returns=ret, hp=hp, conv=Convention())
    assert abs(float(clipped.vf_loss) - 0.0125) > 0.1
    f32 = {"dtype": torch.float32}
    tie = {
        "logprobs": torch.zeros(1, 1, **f32),
        "old_logprobs": torch.zeros(1, 1, **f32),
        "advantages": torch.zeros(1, 1, **f32),
        "mask": torch.ones(1, 1, dtype=torch.bool),
        "values": torch.tensor([[-0.05]], **f32),
        "old_values": torch.tensor([[0.1]], **f32),
        "returns": torch.tensor([[-0.04]], **f32),
        "hp": hp,
    }
    assert float(update_quantities(**tie, conv=Convention.of(value_clip_form="delta")).vf_clipfrac) == 1.0
    assert float(update_quantities(**tie, conv=Convention()).vf_clipfrac) == 0.0
