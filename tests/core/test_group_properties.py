"""Properties of the critic-free advantage estimators (refppo/core/group.py).

Scores are drawn on a grid of quarters in [−5, 5] (exact in float32, so a group mean of equal
scores is exact and a group's std, when not 0, is at least ~0.1: float32 rounding is not amplified
by a near-zero std); one test uses continuous float64 scores.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from strategies import Ragged, assert_exactly_equal, assert_twin_close, ragged_batches

from refppo.core.gae import gae
from refppo.core.group import group_advantages, group_scalar_advantages, reinforce_pp_advantages
from refppo.core.group_naive import group_advantages_naive, reinforce_pp_advantages_naive

pytestmark = pytest.mark.property

GROUP_ESTIMATORS = ("grpo", "dr-grpo", "rloo", "reinforce++-baseline")
estimators = st.sampled_from(GROUP_ESTIMATORS)
singletons = st.sampled_from(["score", "zero"])
epsilons = st.sampled_from([1e-6, 1e-9, 0.1])


@st.composite
def grouped(draw: st.DrawFn, min_total_valid: int = 2) -> tuple[Ragged, torch.Tensor]:
    """A ragged batch and a ``group_index`` [B] with up to 5 prompts (singletons happen)."""
    b = draw(ragged_batches(min_total_valid=min_total_valid))
    ids = draw(st.lists(st.integers(0, 4), min_size=b.B, max_size=b.B), label="group_index")
    return b, torch.tensor(ids)


def quarter_scores(b: Ragged) -> torch.Tensor:
    return (torch.randint(-20, 21, (b.B,), generator=b.gen).to(torch.float64) / 4).to(b.dtype)


def _spread_ok(adv: torch.Tensor, b: Ragged) -> bool:
    """The whitened quantity's spread is 0 or not tiny (float32 whitening amplifies rounding by 1/std)."""
    std = float(adv[b.mask].double().std(unbiased=False)) if b.n_valid > 1 else 0.0
    return std == 0.0 or std >= (1e-9 if b.dtype == torch.float64 else 5e-2)


@given(
    grouped(), estimators, st.booleans(), st.booleans(), epsilons, singletons, st.booleans(), st.booleans()
)
def test_group_advantages_match_naive(
    bg: tuple[Ragged, torch.Tensor],
    est: str,
    scale: bool,
    unbiased: bool,
    eps: float,
    singleton: str,
    with_penalty: bool,
    whiten_unbiased: bool,
) -> None:
    b, g = bg
    s = quarter_scores(b)
    pen = b.floats(-0.5, 0.5) if with_penalty else None
    kw = dict(estimator=est, scale_by_std=scale, unbiased_std=unbiased, eps=eps, singleton=singleton)
    kw.update(token_penalty=pen, whiten_unbiased=whiten_unbiased)
    if est == "reinforce++-baseline":
        pre = group_advantages(s, g, b.mask, **{**kw, "estimator": "dr-grpo"})
        assume(_spread_ok(pre, b))
    got = group_advantages(s, g, b.mask, **kw)
    want = group_advantages_naive(s, g, b.mask, **kw)
    assert_twin_close(got, want, b.dtype, est)


@given(grouped(), estimators, singletons)
def test_group_advantages_match_naive_continuous_float64(
    bg: tuple[Ragged, torch.Tensor], est: str, singleton: str
) -> None:
    b, g = bg
    s = (torch.rand(b.B, generator=b.gen, dtype=torch.float64) - 0.5) * 10
    got = group_advantages(s, g, b.mask.clone(), estimator=est, singleton=singleton)
    want = group_advantages_naive(s, g, b.mask, estimator=est, singleton=singleton)
    assert_twin_close(got, want, torch.float64, est)


@given(grouped(), st.sampled_from([0.0, 0.5, 0.9, 1.0]), st.booleans(), st.sampled_from(["add", "clamp"]))
def test_reinforce_pp_matches_naive(
    bg: tuple[Ragged, torch.Tensor], gamma: float, unbiased: bool, form: str
) -> None:
    b, _ = bg
    r = b.floats(-1.0, 1.0)
    returns = gae(r, torch.zeros_like(r), b.mask, gamma=gamma, lam=1.0)[0]
    assume(_spread_ok(returns, b) and float(returns[b.mask].double().std(unbiased=False)) > 0)
    got = reinforce_pp_advantages(r, b.mask, gamma=gamma, whiten_unbiased=unbiased, whiten_eps_form=form)
    want = reinforce_pp_advantages_naive(
        r, b.mask, gamma=gamma, whiten_unbiased=unbiased, whiten_eps_form=form
    )
    assert_twin_close(got, want, b.dtype, "reinforce++")


@given(grouped(), st.sampled_from(["grpo", "dr-grpo", "rloo"]), st.integers(-8, 8), singletons)
def test_group_shift_invariance(
    bg: tuple[Ragged, torch.Tensor], est: str, shift: int, singleton: str
) -> None:
    """Adding a constant c to every score of ONE group leaves every advantage unchanged.

    (Singletons excluded: their ``score`` fallback has no baseline, so the shift passes through.)
    """
    b, g = bg
    sizes = torch.bincount(g)
    assume(bool((sizes[g] > 1).all()))
    s = quarter_scores(b).double()
    target = int(g[0])
    shifted = torch.where(g == target, s + shift, s)
    a1 = group_scalar_advantages(s, g, estimator=est, singleton=singleton)
    a2 = group_scalar_advantages(shifted, g, estimator=est, singleton=singleton)
    torch.testing.assert_close(a1, a2, atol=1e-9, rtol=1e-9)


@given(grouped(), st.sampled_from([0.5, 2.0, 8.0]), st.booleans())
def test_grpo_scale_invariance(bg: tuple[Ragged, torch.Tensor], k: float, unbiased: bool) -> None:
    """Std-normalised GRPO: scaling a group's scores by k > 0 leaves its advantages unchanged (ε → 0)."""
    b, g = bg
    assume(bool((torch.bincount(g)[g] > 1).all()))
    s = quarter_scores(b).double()
    a1 = group_scalar_advantages(s, g, eps=1e-300, unbiased_std=unbiased)
    a2 = group_scalar_advantages(s * k, g, eps=1e-300, unbiased_std=unbiased)
    # an equal-score group gives 0/ε = 0 on both sides; the others (s−μ)/σ, scale-free
    torch.testing.assert_close(a1, a2, atol=1e-9, rtol=1e-9)
    # and Dr. GRPO is NOT scale-free: its advantages scale by k
    d1 = group_scalar_advantages(s, g, estimator="dr-grpo")
    d2 = group_scalar_advantages(s * k, g, estimator="dr-grpo")
    torch.testing.assert_close(d2, k * d1, atol=1e-9, rtol=1e-9)


@given(grouped(), st.integers(0, 2**31 - 1))
def test_rloo_baseline_excludes_own_score(bg: tuple[Ragged, torch.Tensor], seed: int) -> None:
    """RLOO: changing response i's score by δ changes a_i by exactly δ (its baseline excludes it)
    and every other a_j of its group by −δ/(n−1)."""
    b, g = bg
    assume(bool((torch.bincount(g)[g] > 1).all()))
    s = quarter_scores(b).double()
    i = seed % b.B
    delta = 1.25
    s2 = s.clone()
    s2[i] += delta
    a1 = group_scalar_advantages(s, g, estimator="rloo")
    a2 = group_scalar_advantages(s2, g, estimator="rloo")
    n = int((g == g[i]).sum())
    expected = torch.where(g == g[i], torch.full_like(s, -delta / (n - 1)), torch.zeros_like(s))
    expected[i] = delta
    torch.testing.assert_close(a2 - a1, expected, atol=1e-9, rtol=0.0)


@given(grouped(), estimators, st.booleans(), epsilons)
def test_group_of_one(bg: tuple[Ragged, torch.Tensor], est: str, scale: bool, eps: float) -> None:
    """A response alone in its group: 0 with ``zero``; its raw score (÷(1+ε) for std-scaled GRPO)
    with ``score`` (verl); an error by default."""
    b, _ = bg
    g = torch.arange(b.B)  # every row its own prompt
    s = quarter_scores(b).double()
    zero = group_scalar_advantages(s, g, estimator=est, scale_by_std=scale, eps=eps, singleton="zero")
    assert torch.equal(zero, torch.zeros_like(s))
    raw = group_scalar_advantages(s, g, estimator=est, scale_by_std=scale, eps=eps, singleton="score")
    divisor = 1.0 + eps if (est == "grpo" and scale) else 1.0
    torch.testing.assert_close(raw, s / divisor, atol=0.0, rtol=1e-15)
    try:
        group_scalar_advantages(s, g, estimator=est)
    except ValueError as exc:
        assert "group_index" in str(exc) and "one response" in str(exc)
    else:
        raise AssertionError("a group of one must raise by default")


@given(grouped(), estimators, epsilons, st.integers(-20, 20), st.booleans())
def test_equal_scores_give_zero(
    bg: tuple[Ragged, torch.Tensor], est: str, eps: float, q: int, unbiased: bool
) -> None:
    """Equal scores in every group (σ = 0): finite and exactly 0 (ε keeps GRPO's division finite)."""
    b, g = bg
    s = torch.full((b.B,), q / 4, dtype=b.dtype)
    a = group_advantages(s, g, b.mask, estimator=est, eps=eps, unbiased_std=unbiased, singleton="zero")
    assert torch.equal(a, torch.zeros_like(a))


@given(grouped(), estimators, singletons, st.integers(0, 2**31 - 1))
def test_row_permutation_equivariance(
    bg: tuple[Ragged, torch.Tensor], est: str, singleton: str, seed: int
) -> None:
    """Permuting rows (scores, group ids and masks together) permutes the advantages."""
    b, g = bg
    s = quarter_scores(b)
    perm = torch.randperm(b.B, generator=torch.Generator().manual_seed(seed))
    kw = dict(estimator=est, singleton=singleton)
    a = group_advantages(s, g, b.mask, **kw)
    ap = group_advantages(s[perm], g[perm], b.mask[perm], **kw)
    assert_twin_close(ap, a[perm], b.dtype, "permuted")


@given(grouped(), estimators, singletons, st.sampled_from(["nan", "inf", "-inf", "huge", "mixed"]))
def test_padding_zero_and_junk_never_leaks(
    bg: tuple[Ragged, torch.Tensor], est: str, singleton: str, other_junk: str
) -> None:
    b, g = bg
    s = quarter_scores(b)
    pen = b.valid(-0.5, 0.5)
    kw = dict(estimator=est, singleton=singleton)
    a1 = group_advantages(s, g, b.mask, token_penalty=b.with_junk(pen), **kw)
    a2 = group_advantages(s, g, b.mask, token_penalty=b.with_junk(pen, other_junk), **kw)
    assert_exactly_equal(a1, a2, what="junk on padding")
    assert torch.equal(a1[~b.mask], torch.zeros_like(a1[~b.mask]))
    assert bool(torch.isfinite(a1).all())
    r = b.valid(-1.0, 1.0)
    assume(float(r[b.mask].double().std()) > 1e-3 if b.n_valid > 1 else False)
    r1 = reinforce_pp_advantages(b.with_junk(r), b.mask, gamma=0.9)
    r2 = reinforce_pp_advantages(b.with_junk(r, other_junk), b.mask, gamma=0.9)
    assert_exactly_equal(r1, r2, what="reinforce++ junk on padding")
    assert torch.equal(r1[~b.mask], torch.zeros_like(r1[~b.mask]))


@given(
    grouped(), st.sampled_from(["grpo", "dr-grpo", "rloo"]), singletons, st.sampled_from(["fold", "to_go"])
)
def test_pipeline_critic_free_step_matches_naive(
    bg: tuple[Ragged, torch.Tensor], est: str, singleton: str, group_kl: str
) -> None:
    """``refppo.pipeline.step.rollout_quantities`` with a group estimator equals the naive twin fed by
    loops: the folded score ``s − β·Σ_t KL_t`` (``fold``) or the score plus ``−β·KL``'s return-to-go
    (``to_go``), over random ragged batches with junk on the padding (issue #13 item 2)."""
    from refppo.pipeline.settings import Convention, Hyperparams
    from refppo.pipeline.step import rollout_quantities

    b, g = bg
    s = quarter_scores(b)
    old, ref = b.floats(-2.0, -0.1), b.floats(-2.0, -0.1)
    beta = 0.25
    conv = Convention.of(
        advantage=est, whiten_advantages="none", group_singleton=singleton, group_kl=group_kl
    )
    rq = rollout_quantities(
        scores=s, old_logprobs=old, ref_logprobs=ref, old_values=None, mask=b.mask,
        hp=Hyperparams(kl_coef=beta), conv=conv, group_index=g,
    )  # fmt: skip
    m = b.mask.tolist()
    o, r = old.double().tolist(), ref.double().tolist()
    kl = [[(o[i][t] - r[i][t]) if m[i][t] else 0.0 for t in range(b.T)] for i in range(b.B)]
    if group_kl == "fold":
        folded = [float(s[i]) - beta * sum(kl[i]) for i in range(b.B)]
        want = group_advantages_naive(torch.tensor(folded, dtype=b.dtype), g, b.mask, estimator=est,
                                      singleton=singleton)  # fmt: skip
    else:
        pen = torch.tensor([[-beta * v for v in row] for row in kl], dtype=b.dtype)
        want = group_advantages_naive(s, g, b.mask, estimator=est, singleton=singleton, token_penalty=pen)
    if est == "grpo":  # the std of a folded group can be tiny: float32 division amplifies rounding
        assume(b.dtype == torch.float64)
    assert_twin_close(rq.advantages, want, b.dtype, est)
