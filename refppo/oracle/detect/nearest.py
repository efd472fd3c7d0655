"""Which failing groups ``--detect`` may drop while it keeps the ``nearest`` (:func:`dead_among`).

Group ``i`` (ratio ``r_i``, key bound ``b_i = max(r_i, worst_i) ≥ r_i``) is preceded for sure by a
live ``k`` when ``(b_k, k) < (r_i, i)`` lexicographically (``b_k < r_i``, or equal with ``k``
made earlier); it is dropped when ``nearest`` live groups precede it, in order of ``i``, a dropped
group no longer counting for the later ones. Counted with a Fenwick tree over the sorted
``(b_k, k)``: ``O(F log F)`` for ``F`` failing groups (``_dead_direct`` states the rule directly,
``O(F²)``: the tests' reference).
"""

from __future__ import annotations

import math
from bisect import bisect_left


def dead_among(failing: list[tuple[int, float, float]], nearest: int) -> set[int]:
    """The indices ``i`` of ``failing`` = ``[(i, r_i, b_i), ...]`` (in order of ``i``) that ``nearest``
    live others precede for sure (module docstring)."""
    if any(math.isnan(r) or math.isnan(b) for _, r, b in failing):
        return _dead_direct(failing, nearest)  # NaN does not sort: the direct count
    keys = sorted((b, k) for k, _, b in failing)
    pos = {k: j for j, (_, k) in enumerate(keys)}
    tree = [0] * (len(keys) + 1)
    for j in range(1, len(keys) + 1):  # every group alive: a Fenwick tree of ones
        tree[j] += 1
        up = j + (j & -j)
        if up <= len(keys):
            tree[up] += tree[j]
    dead: set[int] = set()
    for i, r, _ in failing:
        n, j = 0, bisect_left(keys, (r, i))  # the live keys below (r_i, i)
        while j > 0:
            n += tree[j]
            j -= j & -j
        if n >= nearest:
            dead.add(i)
            j = pos[i] + 1
            while j <= len(keys):
                tree[j] -= 1
                j += j & -j
    return dead


def floor_of(worsts: list[float]) -> float:
    """The least ``worst`` of a walk's input groups: a group the walk makes starts with its input's
    ``worst``, which merges only lower, to another input's; so its final sort key
    ``max(ratio, worst)`` is at least ``max(ratio, floor)`` (0.0, no bound, when one is NaN)."""
    return 0.0 if not worsts or any(math.isnan(w) for w in worsts) else min(worsts)


def _dead_direct(failing: list[tuple[int, float, float]], nearest: int) -> set[int]:
    """:func:`dead_among` by the direct count (the rule as stated; ``O(F²)``)."""
    dead: set[int] = set()
    for i, r, _ in failing:
        n = sum(1 for k, _, b in failing if k != i and k not in dead and (b < r or (b == r and k < i)))
        if n >= nearest:
            dead.add(i)
    return dead


__all__ = ["dead_among", "floor_of"]
