"""The walk's early drop of failing groups (:func:`refppo.oracle.detect.groups.expand_groups`) with
the key floor of :func:`refppo.oracle.detect.nearest.floor_of` (every group a walk makes ends with a
``worst`` at least the least ``worst`` of its inputs) keeps exactly the groups of the rule as
stated: every option made and merged by digest, every group scored, the ``nearest`` by
``max(ratio, worst)`` in a stable sort (restated below), on random walks with ties, merges and
inputs that already failed earlier steps (the case of a dump whose earlier stages all mismatch)."""

from __future__ import annotations

from typing import Any, ClassVar

from hypothesis import given, settings
from hypothesis import strategies as st

import refppo.oracle.detect.groups as groups_mod
from refppo.oracle.detect.groups import Group
from refppo.oracle.detect.nearest import floor_of

RATIOS = st.sampled_from([0.0, 0.5, 1.0, 1.0, 2.0, 3.0, 7.5])
WORSTS = st.sampled_from([0.0, 1.0, 2.0, 2.0, 4.0])


class _Walker:
    replayer = groups_mod.Replayer()
    unmatched: ClassVar[list[str]] = []
    walks: ClassVar[list[tuple[str, bool, bool]]] = []
    prune = None

    def release_compared(self) -> None:
        pass

    def note_walk(self, stage: str, ok_seen: bool, any_check: bool) -> None:
        pass

    def note_unmatched(self, stage: str) -> None:
        pass


def _stated(src: list[Group[Any]], opts: list[list[tuple[bytes, float]]], nearest: int) -> list[Any]:
    """The rule as stated: merge by digest, score each group, keep the passes or the nearest."""
    merged: dict[bytes, list[Any]] = {}  # key -> [convs, n_equiv, worst, ratio]
    for g, row in zip(src, opts, strict=True):
        for j, (key, r) in enumerate(row):
            convs = [{**c, "o": j} for c in g.convs]
            if key in merged:
                merged[key][0].extend(convs)
                merged[key][1] += g.n_equiv
                merged[key][2] = min(merged[key][2], g.worst)
            else:
                merged[key] = [convs, g.n_equiv, g.worst, r]
    out = list(merged.values())
    if any(e[3] == 0.0 for e in out):
        return [(e[0], e[1], e[2]) for e in out if e[3] == 0.0]
    out.sort(key=lambda e: max(e[3], e[2]))
    return [(e[0], e[1], max(e[2], e[3])) for e in out[:nearest]]


@st.composite
def walks(draw: st.DrawFn) -> tuple[list[Group[Any]], list[list[tuple[bytes, float]]]]:
    n = draw(st.integers(1, 5))
    src: list[Group[Any]] = [Group([{"g": i}], 1, {"i": i}, draw(WORSTS)) for i in range(n)]
    ratio_of: dict[bytes, float] = {}  # one digest, one state, one ratio
    opts = []
    for _ in range(n):
        row = []
        for _ in range(draw(st.integers(0, 8))):
            key = bytes([draw(st.integers(0, 12))])
            row.append((key, ratio_of.setdefault(key, draw(RATIOS))))
        opts.append(row)
    return src, opts


@settings(max_examples=300, deadline=None)
@given(walks(), st.integers(1, 4))
def test_the_floored_walk_keeps_the_stated_nearest(
    walk: tuple[list[Group[Any]], list[list[tuple[bytes, float]]]], nearest: int
) -> None:
    src, opts = walk
    ratio = {k: r for row in opts for k, r in row}
    rows = {id(g): row for g, row in zip(src, opts, strict=True)}

    def options(g: Group[Any]) -> Any:
        for j, (key, _) in enumerate(rows[id(g)]):
            yield {"o": j}, {"key": key}, key

    def checks(state: dict[str, Any]) -> list[float | None]:
        return [ratio[state["key"]]]

    want = _stated(src, opts, nearest)
    got = groups_mod.expand_groups(_Walker(), src, options, checks, "st", nearest, 10**6)
    assert [(h.convs, h.n_equiv, h.worst) for h in got] == want


def test_the_floor_is_the_least_input_worst() -> None:
    assert floor_of([2.0, 0.5, 4.0]) == 0.5
    assert floor_of([2.0, float("nan")]) == 0.0
    assert floor_of([]) == 0.0
