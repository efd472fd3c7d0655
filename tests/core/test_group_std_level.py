"""Properties of ``grpo``'s std level (``group_std_level``, refppo/core/group.py; issue #13): the mean
stays the group's, the std is the group's (``group``), the whole batch's around the batch mean
(``batch``: TRL ``scale_rewards="batch"``) or the batch's centred scores' (``batch-centred``: AReaL
``mean_level: group``, ``std_level: batch``).

Scores on a grid of quarters in [−5, 5], as tests/core/test_group_properties.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from strategies import Ragged, assert_twin_close
from test_group_properties import grouped, quarter_scores

from refppo.core.group import group_advantages, group_scalar_advantages
from refppo.core.group_naive import group_advantages_naive
from refppo.errors import ConventionError, RefPPOError
from refppo.pipeline.settings import Convention

pytestmark = pytest.mark.property

BATCH_LEVELS = ("batch", "batch-centred")
levels = st.sampled_from(("group", *BATCH_LEVELS))
singletons = st.sampled_from(["score", "zero"])


@given(
    grouped(), levels, st.booleans(), st.sampled_from([1e-4, 0.1]), singletons, st.booleans(), st.booleans()
)
def test_std_levels_match_naive(
    bg: tuple[Ragged, torch.Tensor],
    level: str,
    unbiased: bool,
    eps: float,
    singleton: str,
    with_penalty: bool,
    passk: bool,
) -> None:
    b, g = bg
    s = quarter_scores(b)
    pen = b.floats(-0.5, 0.5) if with_penalty else None
    est = "grpo-passk" if passk else "grpo"
    if passk and singleton == "score":
        singleton = "zero"  # grpo-passk has no second-best in a group of one
    kw = dict(estimator=est, unbiased_std=unbiased, eps=eps, singleton=singleton, token_penalty=pen)
    got = group_advantages(s, g, b.mask, std_level=level, **kw)
    want = group_advantages_naive(s, g, b.mask, std_level=level, **kw)
    assert_twin_close(got, want, b.dtype, f"{est} {level}")


@given(grouped(), levels, st.integers(-8, 8), singletons)
def test_std_levels_invariant_to_one_constant_added_to_every_score(
    bg: tuple[Ragged, torch.Tensor], level: str, shift: int, singleton: str
) -> None:
    """Every mean moves with the shift and no std does: the advantages are unchanged (``zero``
    singletons; ``score`` singletons read the raw score, so only the grouped rows are compared)."""
    b, g = bg
    s = quarter_scores(b).double()
    a = group_scalar_advantages(s, g, std_level=level, singleton=singleton, eps=1e-4)
    moved = group_scalar_advantages(s + shift, g, std_level=level, singleton=singleton, eps=1e-4)
    grouped_rows = torch.bincount(g)[g] > 1
    torch.testing.assert_close(moved[grouped_rows], a[grouped_rows], rtol=1e-9, atol=1e-9)


@given(grouped(), st.sampled_from(BATCH_LEVELS), st.booleans())
def test_batch_levels_equal_grpo_when_the_batch_is_one_group(
    bg: tuple[Ragged, torch.Tensor], level: str, unbiased: bool
) -> None:
    """One prompt: the batch is the group, μ_B = μ_G, so both batch stds are the group std."""
    b, _ = bg
    assume(b.B >= 2)
    s = quarter_scores(b).double()
    one = torch.zeros(b.B, dtype=torch.long)
    want = group_scalar_advantages(s, one, unbiased_std=unbiased)
    got = group_scalar_advantages(s, one, std_level=level, unbiased_std=unbiased)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_std_levels_by_hand() -> None:
    """Scores 0, 1 | 2, 3 (two prompts): every row is ±0.5 from its group mean; σ_G = √(1/2),
    σ_B = √((2.25 + 0.25 + 0.25 + 2.25)/3) = √(5/3) around μ_B = 1.5, σ_C = √(4·0.25/3) = √(1/3)."""
    s = torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=torch.float64)
    g = torch.tensor([7, 7, 9, 9])
    sign = torch.tensor([-0.5, 0.5, -0.5, 0.5], dtype=torch.float64)
    for level, sigma in (("group", 0.5**0.5), ("batch", (5 / 3) ** 0.5), ("batch-centred", (1 / 3) ** 0.5)):
        got = group_scalar_advantages(s, g, std_level=level, eps=1e-4)
        torch.testing.assert_close(got, sign / (sigma + 1e-4), rtol=1e-14, atol=0.0, msg=level)
    pop = group_scalar_advantages(s, g, std_level="batch", eps=0.0, unbiased_std=False)
    torch.testing.assert_close(pop, sign / 1.25**0.5, rtol=1e-14, atol=0.0)  # σ² = 5/4
    # the smallest batch with a std: two rows, one prompt; B − 1 = 1, σ² = (0.25 + 0.25)/1
    two = torch.tensor([0.0, 1.0], dtype=torch.float64)
    for level in ("batch", "batch-centred"):
        got = group_scalar_advantages(two, torch.tensor([3, 3]), std_level=level, eps=0.0)
        torch.testing.assert_close(got, torch.tensor([-0.5, 0.5], dtype=torch.float64) / 0.5**0.5, msg=level)


class _TwoRanks:
    """A SUM all-reduce between two threads (two simulated ranks): each waits for the other's sums."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=60)  # a hang guard, not a timing assertion
        self.slots: list[torch.Tensor | None] = [None, None]

    def for_rank(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def reduce(x: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = x.clone()
            self.barrier.wait()
            a, b = self.slots
            assert a is not None and b is not None
            total = a + b
            self.barrier.wait()  # both have read the slots before either writes the next sums
            return total

        return reduce


@given(grouped(), st.sampled_from(BATCH_LEVELS), st.integers(1, 15), st.booleans())
def test_batch_std_all_reduced_equals_one_process(
    bg: tuple[Ragged, torch.Tensor], level: str, cut: int, unbiased: bool
) -> None:
    """The batch std is a batch statistic: rows split over two ranks (whole groups each), the sums
    all-reduced, each rank's advantages are its rows of the naive twin on the whole batch."""
    b, g = bg
    s = quarter_scores(b).double()
    order = torch.argsort(g, stable=True)
    s, g, m = s[order], g[order], b.mask[order]
    cut = min(cut, b.B - 1)
    assume(cut >= 1 and int(g[cut - 1]) != int(g[cut]))
    halves = (slice(0, cut), slice(cut, b.B))
    kw = dict(estimator="grpo", singleton="zero", std_level=level, unbiased_std=unbiased)
    want = group_advantages_naive(s, g, m, **kw)
    ranks = _TwoRanks()
    got: list[torch.Tensor | None] = [None, None]
    errors: list[BaseException] = []

    def run(r: int) -> None:
        h = halves[r]
        try:
            got[r] = group_advantages(s[h], g[h], m[h], all_reduce=ranks.for_rank(r), **kw)
        except BaseException as exc:  # re-raised in the main thread below
            errors.append(exc)
            ranks.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for r, h in enumerate(halves):
        out = got[r]
        assert out is not None
        assert_twin_close(out, want[h], torch.float64, level)


def test_convention_key_round_trips_and_refuses_a_bad_value() -> None:
    c = Convention.of(group_std_level="batch")  # type: ignore[arg-type]  # parsed from a string, as a CLI does
    assert c.to_dict()["group_std_level"] == "batch"
    assert Convention.from_dict(c.to_dict()) == c
    assert "group_std_level" not in Convention().to_dict()  # the golden cases' stored dicts stay exact
    with pytest.raises((ConventionError, RefPPOError), match="group_std_level"):
        Convention.of(group_std_level="global")  # type: ignore[arg-type]  # a wrong string on purpose
