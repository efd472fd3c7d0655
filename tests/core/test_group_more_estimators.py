"""Properties of verl's and OpenRLHF's further critic-free estimators (refppo/core/group.py; issue #13
item 3): ``opo`` (length-weighted group mean), ``gpg`` (``α·(s − μ_G)``, ``α = B/#{s ≠ 0}``),
``grpo-passk`` (the best response's margin over the second) and ``flash-reinforce`` (the batch mean).

Scores on a grid of quarters in [−5, 5], as tests/core/test_group_properties.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from strategies import Ragged, assert_twin_close, ragged_batches
from test_group_properties import grouped, quarter_scores

from refppo.core.group import group_advantages, group_scalar_advantages
from refppo.core.group_naive import group_advantages_naive
from refppo.errors import HyperparameterError

pytestmark = pytest.mark.property

MORE = ("opo", "gpg", "grpo-passk", "flash-reinforce")
singletons = st.sampled_from(["score", "zero"])


def _has_singleton(g: torch.Tensor) -> bool:
    return bool((torch.bincount(g)[g] == 1).any())


@given(
    grouped(), st.sampled_from(MORE), st.booleans(), st.sampled_from([1e-6, 0.1]), singletons, st.booleans()
)
def test_more_estimators_match_naive(
    bg: tuple[Ragged, torch.Tensor], est: str, scale: bool, eps: float, singleton: str, with_penalty: bool
) -> None:
    b, g = bg
    if est == "grpo-passk" and singleton == "score":
        assume(not _has_singleton(g))
    s = quarter_scores(b)
    pen = b.floats(-0.5, 0.5) if with_penalty else None
    kw = dict(estimator=est, scale_by_std=scale, eps=eps, singleton=singleton, token_penalty=pen)
    got = group_advantages(s, g, b.mask, **kw)
    want = group_advantages_naive(s, g, b.mask, **kw)
    assert_twin_close(got, want, b.dtype, est)


@given(grouped(), singletons)
def test_opo_equals_dr_grpo_when_a_groups_lengths_are_equal(
    bg: tuple[Ragged, torch.Tensor], sing: str
) -> None:
    """OPO's baseline is the length-weighted group mean: equal lengths give Dr. GRPO's mean; unequal
    lengths in a group with unequal scores move it towards the longer responses' scores."""
    b, g = bg
    s = quarter_scores(b).double()
    same = torch.full((b.B,), 3.0, dtype=torch.float64)
    a = group_scalar_advantages(s, g, estimator="opo", lengths=same, singleton=sing)
    torch.testing.assert_close(a, group_scalar_advantages(s, g, estimator="dr-grpo", singleton=sing))
    # two responses, lengths 1 and 3, scores 0 and 1: baseline (1·0 + 3·1)/4 = 3/4
    two = group_scalar_advantages(
        torch.tensor([0.0, 1.0], dtype=torch.float64), torch.tensor([5, 5]), estimator="opo",
        lengths=torch.tensor([1.0, 3.0], dtype=torch.float64),
    )  # fmt: skip
    assert two.tolist() == [-0.75, 0.25]


@given(grouped(), singletons)
def test_gpg_is_dr_grpo_times_batch_over_nonzero_scores(bg: tuple[Ragged, torch.Tensor], sing: str) -> None:
    """GPG: no zero score in the batch gives α = 1 (Dr. GRPO exactly); zeroing scores of ANOTHER
    group raises every advantage of a group by ``B/#{s ≠ 0}``."""
    b, g = bg
    s = quarter_scores(b).double()
    nonzero = torch.where(s == 0, torch.full_like(s, 0.25), s)
    a = group_scalar_advantages(nonzero, g, estimator="gpg", singleton=sing)
    torch.testing.assert_close(a, group_scalar_advantages(nonzero, g, estimator="dr-grpo", singleton=sing))
    other = g != g[0]
    assume(bool(other.any()))
    zeroed = torch.where(other, torch.zeros_like(nonzero), nonzero)
    alpha = b.B / int((~other).sum())
    first = g == g[0]
    got = group_scalar_advantages(zeroed, g, estimator="gpg", singleton=sing)[first]
    want = alpha * group_scalar_advantages(zeroed, g, estimator="dr-grpo", singleton=sing)[first]
    torch.testing.assert_close(got, want)


@given(grouped(), st.booleans(), st.integers(-8, 8))
def test_passk_only_the_unique_best_response_moves(
    bg: tuple[Ragged, torch.Tensor], scale: bool, shift: int
) -> None:
    """Pass@k: per group at most one non-zero advantage, on the unique best score, ≥ 0, equal to the
    margin over the second best (÷(σ+ε) when scaled); adding a constant to a group changes nothing."""
    b, g = bg
    assume(not _has_singleton(g))
    s = quarter_scores(b).double()
    a = group_scalar_advantages(s, g, estimator="grpo-passk", scale_by_std=scale)
    for k in torch.unique(g).tolist():
        rows = (g == k).nonzero().flatten()
        top = sorted(s[rows].tolist(), reverse=True)
        moved = [int(r) for r in rows if a[r] != 0]
        assert len(moved) <= 1 and bool((a[rows] >= 0).all())
        if top[0] > top[1]:
            std = float(s[rows].std()) if scale else 0.0
            margin = (top[0] - top[1]) / (std + 1e-6) if scale else top[0] - top[1]
            assert moved == [int(rows[s[rows].argmax()])]
            assert abs(float(a[moved[0]]) - margin) <= 1e-12 * max(1.0, margin)
        else:
            assert moved == []  # a tie for the best: no winner
    shifted = torch.where(g == g[0], s + shift, s)
    torch.testing.assert_close(
        group_scalar_advantages(shifted, g, estimator="grpo-passk", scale_by_std=scale), a
    )


def test_passk_group_of_one() -> None:
    """verl raises for a group of one; ``zero`` gives 0; ``score`` has no second best: refused."""
    s, g = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64), torch.tensor([0, 0, 1])
    a = group_scalar_advantages(s, g, estimator="grpo-passk", singleton="zero", scale_by_std=False)
    assert a.tolist() == [0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="one response"):
        group_scalar_advantages(s, g, estimator="grpo-passk")
    with pytest.raises(HyperparameterError, match="second-best"):
        group_scalar_advantages(s, g, estimator="grpo-passk", singleton="score")


@given(ragged_batches(min_B=2), st.integers(-8, 8))
def test_flash_reinforce_is_the_batch_mean_baseline(b: Ragged, shift: int) -> None:
    """FlashREINFORCE: no group; the advantages sum to 0 over the batch, equal Dr. GRPO with every
    row one group, and are invariant to a shift of every score."""
    s = quarter_scores(b).double()
    a = group_scalar_advantages(s, None, estimator="flash-reinforce")
    assert abs(float(a.sum())) <= 1e-12 * b.B
    one = torch.zeros(b.B, dtype=torch.long)
    torch.testing.assert_close(a, group_scalar_advantages(s, one, estimator="dr-grpo", singleton="score"))
    torch.testing.assert_close(group_scalar_advantages(s + shift, None, estimator="flash-reinforce"), a)


def _recorded(sums: list[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """An all-reduce of two simulated ranks: records this rank's sums (pass 1) or returns the total."""

    def reduce(x: torch.Tensor) -> torch.Tensor:
        if len(sums) < 2:
            sums.append(x.clone())
            return x
        return sums[0] + sums[1]

    return reduce


@given(grouped(), st.sampled_from(["gpg", "flash-reinforce"]), st.integers(1, 15))
def test_batch_statistics_all_reduced_equal_one_process(
    bg: tuple[Ragged, torch.Tensor], est: str, cut: int
) -> None:
    """``gpg``'s α and ``flash-reinforce``'s mean are batch statistics: split the rows over two
    simulated ranks (whole groups each) with an all-reduce of their sums, each rank's advantages are
    its rows of the naive twin on the whole batch."""
    b, g = bg
    s = quarter_scores(b).double()
    order = torch.argsort(g, stable=True)
    s, g, m = s[order], g[order], b.mask[order]
    cut = min(cut, b.B - 1)
    assume(cut >= 1 and int(g[cut - 1]) != int(g[cut]))  # whole groups on each rank
    halves = (slice(0, cut), slice(cut, b.B))
    want = group_advantages_naive(s, g, m, estimator=est, singleton="score")
    sums: list[torch.Tensor] = []
    reduce = _recorded(sums)
    for h in halves:  # pass 1: each rank's own sums
        group_advantages(s[h], g[h], m[h], estimator=est, singleton="score", all_reduce=reduce)
    for h in halves:  # pass 2: the all-reduced sums
        got = group_advantages(s[h], g[h], m[h], estimator=est, singleton="score", all_reduce=reduce)
        assert_twin_close(got, want[h], torch.float64, est)
