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
from refppo.core.objective import entropy_bonus, kl_loss
from refppo.core.policy import clipped_policy_loss
from refppo.core.value import value_loss
from refppo.pipeline import Convention, Hyperparams, Normalisers, update_quantities, value_mask

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
