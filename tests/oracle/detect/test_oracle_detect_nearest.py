"""The nearest-keeping rule of ``--detect`` (:func:`refppo.oracle.detect.nearest.dead_among`) equals
the rule as stated, counted directly (the ``O(F²)`` loop it replaced), on random ratios with ties,
equal bounds and NaN."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from refppo.oracle.detect.nearest import _dead_direct, dead_among

VALUES = st.sampled_from([0.5, 1.0, 1.0, 2.0, 3.0, 7.5, math.inf])


@st.composite
def failing_groups(draw: st.DrawFn) -> list[tuple[int, float, float]]:
    n = draw(st.integers(0, 40))
    out = []
    for i in range(n):
        r = draw(VALUES)
        worst = draw(st.one_of(st.just(0.0), VALUES))
        out.append((i, r, max(r, worst)))
    return out


@settings(max_examples=200)
@given(failing_groups(), st.integers(1, 6))
def test_the_fenwick_count_is_the_direct_count(failing: list[tuple[int, float, float]], nearest: int) -> None:
    assert dead_among(failing, nearest) == _dead_direct(failing, nearest)


def test_a_hand_worked_case_and_nan() -> None:
    # bounds 1, 2, 2, 5: with nearest=2, group 3 (r=3) is preceded by 0, 1, 2 -> dead; group 2 (r=2)
    # by 0 (b=1 < 2) and 1 (b == r, made earlier) -> dead; group 1 (r=2) only by 0 -> alive
    failing = [(0, 1.0, 1.0), (1, 2.0, 2.0), (2, 2.0, 2.0), (3, 3.0, 5.0)]
    assert dead_among(failing, 2) == {2, 3}
    nan = [(0, 1.0, 1.0), (1, math.nan, math.nan), (2, 2.0, 2.0)]
    assert dead_among(nan, 1) == _dead_direct(nan, 1) == {2}
