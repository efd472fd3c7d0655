"""The logged clip fraction's counting conventions (``refppo/core/clipfrac.py``, ``clipfrac_counts``;
issue #22: AReaL 1.0.4's ``clip_ratio`` over the kept tokens, TRL 1.16.0's ``cispo_clip_ratio``).

- a hand-worked vector under every form (surrogate ``L2 > L1``; CISPO ``all``, ``by_advantage``;
  ``kept`` with a weight that rejects tokens; no lower bound);
- the vectorized count equals its naive twin (hypothesis, dyadic ratios: no rounding ties);
- the surrogate's count under ``all`` is the core's ``clipfrac`` bit for bit (the core called
  directly), and the policy stage equals its naive twin under each ``clipfrac_counts`` with a
  rollout-correction weight (and changes nothing where the convention changes nothing).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import Ragged, ragged_batches

from refppo.agg_conventions import ClipFracCounts
from refppo.core.clipfrac import clip_fraction, clip_fraction_naive
from refppo.core.policy import clipped_policy_token_loss
from refppo.pipeline.blocks import Evaluation
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.stages import BY_NAME

ALL, KEPT, BY_ADV = ClipFracCounts.ALL, ClipFracCounts.KEPT, ClipFracCounts.BY_ADVANTAGE
F = torch.float64
RATIO = torch.tensor([[0.5, 1.0, 1.5, 2.0], [0.5, 1.5, 0.0, 0.0]], dtype=F)
ADV = torch.tensor([[1.0, -1.0, 1.0, -1.0], [-1.0, 1.0, 9.0, 9.0]], dtype=F)
MASK = torch.tensor([[True, True, True, True], [True, True, False, False]])
W = torch.tensor([[1.0, 1.0, 0.0, 1.0], [0.0, 2.0, 0.0, 0.0]], dtype=F)


@pytest.mark.parametrize(
    ("band", "surrogate", "counts", "weight", "want"),
    [
        # L2 > L1: (1.5, A>0), (0.5, A<0), (1.5, A>0); never (0.5, A>0) nor (2.0, A<0)
        ((0.8, 1.2), True, ALL, None, 3 / 6),
        ((0.8, 1.2), True, BY_ADV, None, 3 / 6),
        ((0.8, 1.2), True, KEPT, W, 1 / 6),  # of those three only row 2's 1.5 has w ≠ 0
        ((0.8, 1.2), True, KEPT, None, 3 / 6),  # no correction: every token is kept
        ((0.8, 1.2), False, ALL, None, 5 / 6),  # outside the band: all but 1.0
        ((0.8, 1.2), False, BY_ADV, None, 3 / 6),  # (1.5, +), (0.5, −), (1.5, +)
        ((0.8, 1.2), False, KEPT, W, 3 / 6),  # outside and w ≠ 0: (0.5), (2.0), (1.5)
        ((None, 1.2), False, ALL, None, 3 / 6),  # no lower bound: ρ > 1.2 only
        ((None, 1.2), False, BY_ADV, None, 2 / 6),  # ρ > 1.2 on A > 0
    ],
)
def test_clip_fraction_hand_worked(
    band: tuple[float | None, float],
    surrogate: bool,
    counts: ClipFracCounts,
    weight: torch.Tensor | None,
    want: float,
) -> None:
    kw = {"band": band, "surrogate": surrogate, "counts": counts, "weight": weight}
    assert float(clip_fraction(RATIO, ADV, MASK, **kw)) == want  # type: ignore[arg-type]  # kwargs dict
    assert clip_fraction_naive(RATIO, ADV, MASK, **kw) == want  # type: ignore[arg-type]  # kwargs dict


DYADIC = torch.tensor([0.25, 0.5, 0.75, 0.875, 1.0, 1.125, 1.25, 1.5, 2.0, 4.0], dtype=F)
bands = st.sampled_from([(0.8, 1.2), (None, 1.28), (0.9, 1.5), (0.0, 1.0)])


def _draw(b: Ragged) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ρ, A, w')`` on ``b``: dyadic ratios off every band's bounds, advantages with zeros,
    weights with rejected (0) tokens; junk on the padding."""
    idx = torch.randint(0, DYADIC.numel(), (b.B, b.T), generator=b.gen)
    ratio = torch.where(b.mask, DYADIC[idx], 0.0)
    adv = torch.randint(-2, 3, (b.B, b.T), generator=b.gen).to(F)
    w = torch.randint(0, 3, (b.B, b.T), generator=b.gen).to(F) * 0.5
    return ratio, b.with_junk(adv), torch.where(b.mask, w, 0.0)


@given(ragged_batches(dtypes=(torch.float64,)), bands, st.booleans(), st.sampled_from(list(ClipFracCounts)))
def test_clip_fraction_matches_naive(
    b: Ragged, band: tuple[float | None, float], surrogate: bool, counts: ClipFracCounts
) -> None:
    ratio, adv, w = _draw(b)
    for weight in (None, w):
        kw = {"band": band, "surrogate": surrogate, "counts": counts, "weight": weight}
        got = float(clip_fraction(ratio, adv, b.mask, **kw))  # type: ignore[arg-type]  # kwargs dict
        assert got == pytest.approx(clip_fraction_naive(ratio, adv, b.mask, **kw), abs=1e-15)  # type: ignore[arg-type]


@given(ragged_batches(), st.sampled_from([(0.2, None), (0.2, 0.28), (0.0, 0.3)]))
def test_the_surrogate_count_is_the_cores_clipfrac(b: Ragged, clip: tuple[float, float | None]) -> None:
    """Under ``all`` the surrogate's ``L2 > L1`` is the core's own ``clipfrac``, bit for bit."""
    lp_old = b.valid(-4.0, 0.0)
    lp, adv = b.with_junk(lp_old + b.valid(-0.4, 0.4)), b.with_junk(b.valid(-1.0, 1.0))
    core = clipped_policy_token_loss(
        lp, b.with_junk(lp_old), adv, b.mask, clip_low=clip[0], clip_high=clip[1]
    )
    hi = clip[0] if clip[1] is None else clip[1]
    got = clip_fraction(
        core.ratio.detach(), adv, b.mask, band=(1.0 - clip[0], 1.0 + hi), surrogate=True, counts=ALL
    )
    assert torch.equal(got, core.clipfrac)


@pytest.mark.parametrize("loss", ["vanilla", "gspo", "cispo"])
@pytest.mark.parametrize("counts", list(ClipFracCounts))
def test_the_policy_stage_equals_its_naive_twin(loss: str, counts: ClipFracCounts) -> None:
    g = torch.Generator().manual_seed(7)
    m = torch.ones(6, 9, dtype=torch.bool)
    m[3:, 5:] = False
    lp_old = torch.rand(6, 9, generator=g, dtype=F) * -3.0
    lp = torch.where(m, lp_old + 0.6 * torch.randn(6, 9, generator=g, dtype=F), 0.0)
    adv = torch.where(m, torch.randn(6, 9, generator=g, dtype=F), 0.0)
    w = torch.where(m & (torch.rand(6, 9, generator=g) > 0.3), 1.3, 0.0).to(F)
    hp = Hyperparams(cliprange=1.0 if loss == "cispo" else 0.2, cliprange_high=0.28)
    conv = Convention.of(policy_loss=loss, clipfrac_counts=counts.value)
    stage = BY_NAME["policy"]
    q = {"logprobs": lp, "old_logprobs": lp_old, "advantages": adv, "mask": m, "is_weights": w}
    got = stage.run(q, conv, hp, Evaluation())["pg_clipfrac"]
    twin = stage.run(q, conv, hp, Evaluation(), naive=True)["pg_clipfrac"]
    assert float(got) == pytest.approx(float(twin), abs=1e-12)
    base = stage.run(q, Convention.of(policy_loss=loss), hp, Evaluation())["pg_clipfrac"]
    if counts is ALL or (counts is BY_ADV and loss != "cispo"):
        assert torch.equal(got, base)  # the surrogate's L2 > L1 is already on the advantage's side
    else:
        assert float(got) < float(base)  # rejected tokens (kept), the other sign (by_advantage) leave
