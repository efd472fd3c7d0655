"""Masks with interior holes (multi-turn tool-output tokens; issue #11): every GAE hole convention
against its naive twin and against the recursion it claims, right-padded invariance (bit for bit),
and the whitening, KL, score slot, loss aggregation and whole rollout step over holed masks
against their naive twins."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from strategies import Ragged, assert_twin_close, ragged_batches
from torch import Tensor

from refppo.agg_conventions import MASK_AGGS
from refppo.conventions import GaeHoles
from refppo.core.aggregate import aggregate_loss, aggregate_loss_naive
from refppo.core.gae import envelope, gae, gae_naive
from refppo.core.kl import token_kl, token_kl_naive
from refppo.core.normalize import normalize, normalize_naive
from refppo.core.rewards import score_positions
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import rollout_quantities, rollout_quantities_naive

pytestmark = pytest.mark.property

HOLES = tuple(h.value for h in GaeHoles)
unit = st.floats(0.0, 1.0)


def holed_mask(b: Ragged, share: float = 0.35) -> Tensor:
    """``b.mask`` with random interior holes: never a row's last valid token (so rows stay non-empty
    and the envelope is the right-padded mask)."""
    T = b.T
    last = torch.where(b.mask, torch.arange(T), -1).amax(dim=1, keepdim=True)
    punch = (torch.rand(b.B, T, generator=b.gen) < share) & (torch.arange(T) < last)
    return b.mask & ~punch


def tool_values(b: Ragged, m: Tensor, x: Tensor) -> Tensor:
    """``x`` with finite values on the holes (tool tokens are real tokens) and its junk on the padding."""
    real = b.valid(-2.0, 2.0)
    return torch.where(b.mask & ~m, real, x)


@given(ragged_batches(max_B=8, max_T=32), st.sampled_from(HOLES), unit, unit)
def test_every_hole_convention_matches_its_naive_twin(
    b: Ragged, holes: str, gamma: float, lam: float
) -> None:
    m = holed_mask(b)
    r, v = tool_values(b, m, b.floats(-1.0, 1.0)), tool_values(b, m, b.floats(-2.0, 2.0))
    if holes != "through":  # skip and zero never read the holes: junk there must not leak
        r, v = torch.where(m | ~b.mask, r, float("nan")), torch.where(m | ~b.mask, v, float("inf"))
    adv, ret = gae(r, v, m, gamma=gamma, lam=lam, holes=holes)
    adv_n, ret_n = gae_naive(r, v, m, gamma=gamma, lam=lam, holes=holes)
    assert_twin_close(adv, adv_n, b.dtype, f"advantages ({holes})")
    assert_twin_close(ret, ret_n, b.dtype, f"returns ({holes})")
    assert bool((adv[~envelope(m)] == 0).all()) and bool((ret[~envelope(m)] == 0).all())
    if holes == "skip":
        assert bool((adv[~m] == 0).all())


@given(ragged_batches(max_B=8, max_T=32, dtypes=(torch.float64,)), unit, unit)
def test_hole_conventions_satisfy_their_recursions(b: Ragged, gamma: float, lam: float) -> None:
    """The stated equations (spec/ppo.md, "Masks with holes"), checked on the outputs position by
    position: skip ``Â_t = r_t + γV_u − V_t + γλÂ_u`` (u the next valid position), zero
    ``Â_t = r_t − V_t + (γλ)^h·(γV_u + γλÂ_u)`` (h holes in between), through the plain recursion
    over every position of the envelope."""
    m = holed_mask(b)
    r, v = tool_values(b, m, b.floats(-1.0, 1.0)), tool_values(b, m, b.floats(-2.0, 2.0))
    gl = gamma * lam
    out = {h: gae(r, v, m, gamma=gamma, lam=lam, holes=h)[0].tolist() for h in HOLES}
    R, V, M = r.tolist(), v.tolist(), m.tolist()
    for i in range(b.B):
        valid = [t for t in range(b.T) if M[i][t]]
        for k, t in enumerate(valid):
            u = valid[k + 1] if k + 1 < len(valid) else None
            v_u = V[i][u] if u is not None else 0.0
            a_skip = out["skip"][i][u] if u is not None else 0.0
            a_zero = out["zero"][i][u] if u is not None else 0.0
            exp_skip = R[i][t] + gamma * v_u - V[i][t] + gl * a_skip
            if u is None or u == t + 1:
                exp_zero = R[i][t] + gamma * v_u - V[i][t] + gl * a_zero
            else:
                exp_zero = R[i][t] - V[i][t] + gl ** (u - t - 1) * (gamma * v_u + gl * a_zero)
            assert abs(out["skip"][i][t] - exp_skip) <= 1e-9 * (1 + abs(exp_skip))
            assert abs(out["zero"][i][t] - exp_zero) <= 1e-9 * (1 + abs(exp_zero))
        last = valid[-1]
        for t in range(last + 1):
            nxt = V[i][t + 1] if t < last else 0.0
            a_next = out["through"][i][t + 1] if t < last else 0.0
            exp = R[i][t] + gamma * nxt - V[i][t] + gl * a_next
            assert abs(out["through"][i][t] - exp) <= 1e-9 * (1 + abs(exp))


@given(ragged_batches(max_B=8, max_T=32), st.sampled_from(HOLES), unit, unit)
def test_right_padded_masks_are_unchanged_by_every_hole_convention(
    b: Ragged, holes: str, gamma: float, lam: float
) -> None:
    """Without holes every convention is today's GAE, bit for bit (junk on the padding included)."""
    r, v = b.floats(-1.0, 1.0), b.floats(-2.0, 2.0)
    base = gae(r, v, b.mask, gamma=gamma, lam=lam)
    got = gae(r, v, b.mask, gamma=gamma, lam=lam, holes=holes)
    assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1])
    assert torch.equal(envelope(b.mask), b.mask)


@given(ragged_batches(max_B=8, max_T=32, min_total_valid=2), st.sampled_from(("masked", "center", "scale")))
def test_whitening_over_a_holed_mask_uses_the_valid_tokens_only(b: Ragged, kind: str) -> None:
    m = holed_mask(b)
    assume(int(m.sum()) >= 2)
    x = b.floats(-3.0, 3.0)
    assume(float(x[m].double().std(unbiased=False)) >= (1e-9 if b.dtype == torch.float64 else 5e-2))
    got = normalize(x, m, kind, eps=1e-6)
    assert_twin_close(got, normalize_naive(x, m, kind, eps=1e-6), b.dtype, "whitening")
    junk = torch.where(m, x, torch.full((), 1e30, dtype=x.dtype))  # huge values on the holes
    assert torch.equal(normalize(junk, m, kind, eps=1e-6), got)


@given(ragged_batches(max_B=8, max_T=32), st.sampled_from(tuple(a.value for a in MASK_AGGS)))
def test_loss_aggregation_over_a_holed_mask_matches_naive(b: Ragged, agg: str) -> None:
    m = holed_mask(b)
    x = torch.where(m, b.floats(-2.0, 2.0), float("nan"))  # NaN on every hole and pad
    assert_twin_close(aggregate_loss(x, m, agg), aggregate_loss_naive(x, m, agg), b.dtype, agg)


@given(ragged_batches(max_B=8, max_T=32), st.sampled_from(("k1", "k2", "k3", "abs")))
def test_kl_is_zero_on_holes_and_matches_naive(b: Ragged, est: str) -> None:
    m = holed_mask(b)
    lp, ref = b.floats(-3.0, -0.1), b.floats(-3.0, -0.1)
    got = token_kl(lp, ref, m, est)
    assert_twin_close(got, token_kl_naive(lp, ref, m, est), b.dtype, "kl")
    assert bool((got[~m] == 0).all())


@given(ragged_batches(max_B=8, max_T=32))
def test_last_valid_is_the_last_one_of_a_holed_row(b: Ragged) -> None:
    m = holed_mask(b)
    expected = [max(t for t in range(b.T) if row[t]) for row in m.tolist()]
    assert score_positions(m, "last_valid").tolist() == expected


@given(
    ragged_batches(max_B=6, max_T=16, min_total_valid=2, dtypes=(torch.float64,)),
    st.sampled_from(HOLES),
    st.sampled_from(("exclude", "include")),
    st.sampled_from(("masked", "through")),
    st.sampled_from(("last_valid", "after_last_valid")),
)
def test_rollout_step_with_holes_matches_the_naive_pipeline(
    b: Ragged, holes: str, wh: str, padding: str, score_at: str
) -> None:
    m = holed_mask(b)
    assume(int(m.sum()) >= 2)
    old = tool_values(b, m, b.floats(-3.0, -0.1))
    ref = tool_values(b, m, b.floats(-3.0, -0.1))
    vals = tool_values(b, m, b.floats(-2.0, 2.0))
    if padding == "through":  # the recursion reads the padding: real values there
        vals = torch.where(b.mask, vals, b.valid(-2.0, 2.0))
    conv = Convention.of(gae_holes=holes, whiten_holes=wh, gae_padding=padding, score_at=score_at)
    hp = Hyperparams(gamma=0.95, lam=0.9, kl_coef=0.1)
    s = b.scores()
    got = rollout_quantities(
        scores=s, old_logprobs=old, ref_logprobs=ref, old_values=vals, mask=m, hp=hp, conv=conv
    )
    exp = rollout_quantities_naive(
        scores=s, old_logprobs=old, ref_logprobs=ref, old_values=vals, mask=m, hp=hp, conv=conv
    )
    for name in ("kl", "token_rewards", "advantages_raw", "returns"):
        assert_twin_close(getattr(got, name), getattr(exp, name), b.dtype, name)
    assume(float(got.advantages_raw[m].std()) > 1e-6)
    assert_twin_close(got.advantages[m], exp.advantages[m], b.dtype, "advantages")


@given(ragged_batches(max_B=8, max_T=32), st.sampled_from(HOLES), unit)
def test_reinforce_pp_returns_over_holes_match_the_equation(b: Ragged, holes: str, gamma: float) -> None:
    """REINFORCE++'s discounted returns cross interior holes by ``gae_holes`` (issue #13): skip = the
    valid positions only (verl), zero = each hole a step with reward 0 (OpenRLHF), through = each
    hole a step with its reward read; against the naive sums of each equation."""
    from refppo.core.group import discounted_returns
    from refppo.core.group_naive import discounted_returns_naive

    m = holed_mask(b)
    r = tool_values(b, m, b.floats(-1.0, 1.0))
    got = discounted_returns(r, m, gamma=gamma, holes=holes)
    assert_twin_close(got, discounted_returns_naive(r, m, gamma=gamma, holes=holes), b.dtype, holes)
    assert bool((got[~envelope(m)] == 0).all())


@given(ragged_batches(max_B=8, max_T=32, dtypes=(torch.float64,)), st.sampled_from(HOLES), unit)
def test_pipeline_reinforce_pp_follows_gae_holes(b: Ragged, holes: str, gamma: float) -> None:
    """``rollout_quantities`` with ``advantage=reinforce++`` on a holed mask uses ``conv.adv.gae_holes``
    (it used ``skip`` whatever the convention): its raw advantages equal the naive returns of the
    token rewards under that convention (the twin is told the convention explicitly). That the rules
    really differ where γ < 1 and a hole binds is pinned by the hand case below and by
    ``test_core_mutation_kills.py::test_reinforce_pp_in_the_pipeline_crosses_holes_by_gae_holes``."""
    from refppo.core.group_naive import discounted_returns_naive

    m = holed_mask(b)
    old, ref = b.floats(-2.0, -0.1), b.floats(-2.0, -0.1)
    s = b.floats(-1.0, 1.0)[:, 0]
    conv = Convention.of(advantage="reinforce++", whiten_advantages="none", gae_holes=holes)
    hp = Hyperparams(kl_coef=0.1, gamma=gamma)
    rq = rollout_quantities(
        scores=s, old_logprobs=old, ref_logprobs=ref, old_values=None, mask=m, hp=hp, conv=conv
    )
    want = discounted_returns_naive(rq.token_rewards, rq.value_mask, gamma=gamma, holes=holes)
    assert_twin_close(rq.advantages_raw, want, b.dtype, holes)


@pytest.mark.parametrize(("holes", "first"), [("skip", 0.5), ("zero", 0.25), ("through", 0.25)])
def test_pipeline_reinforce_pp_hole_by_hand(holes: str, first: float) -> None:
    """One row ``m = [1, 0, 1]``, score 1 at the last token, β = 0, γ = ½: ``R_0`` is γ·1 when the
    hole is transparent (skip, verl) and γ²·1 when it is a time step (zero, OpenRLHF; through)."""
    m = torch.tensor([[True, False, True]])
    lp = torch.full((1, 3), -1.0, dtype=torch.float64)
    conv = Convention.of(advantage="reinforce++", whiten_advantages="none", gae_holes=holes)
    rq = rollout_quantities(
        scores=torch.tensor([1.0], dtype=torch.float64), old_logprobs=lp, ref_logprobs=lp,
        old_values=None, mask=m, hp=Hyperparams(kl_coef=0.0, gamma=0.5), conv=conv,
    )  # fmt: skip
    assert rq.advantages_raw[0, 0].item() == first and rq.advantages_raw[0, 2].item() == 1.0


@given(ragged_batches(max_B=8, max_T=32, dtypes=(torch.float64,)), st.sampled_from(HOLES), unit)
def test_reinforce_pp_advantages_over_holes_match_naive(b: Ragged, holes: str, gamma: float) -> None:
    """The whitened REINFORCE++ advantages (whitening over the holed mask) equal the naive twin."""
    from refppo.core.group import discounted_returns, reinforce_pp_advantages
    from refppo.core.group_naive import reinforce_pp_advantages_naive

    m = holed_mask(b)
    assume(int(m.sum()) >= 2)
    r = tool_values(b, m, b.floats(-1.0, 1.0))
    spread = float(discounted_returns(r, m, gamma=gamma, holes=holes)[m].std())
    assume(spread == 0.0 or spread >= 1e-6)  # whitening divides by it: rounding is amplified below
    got = reinforce_pp_advantages(r, m, gamma=gamma, holes=holes)
    want = reinforce_pp_advantages_naive(r, m, gamma=gamma, holes=holes)
    assert_twin_close(got, want, b.dtype, holes)
