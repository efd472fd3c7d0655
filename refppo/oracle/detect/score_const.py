"""``--detect``'s score map when every row holds the same score (:mod:`refppo.oracle.detect.rollout`).

With one score ``s₀`` on every row the slot reward ``y = k·(s₀ + b)`` pins only the product of the
score scale ``k`` and ``s₀ + b``: the reward stage walks the class's two one-key members (scale
only, bias only) and :attr:`Search.notes` names, as examples, only the members its walk confirmed.
"""

from __future__ import annotations

from collections.abc import Callable

from refppo.oracle.detect.groups import Group
from refppo.oracle.detect.search import SOLVE_GROUPS, Search
from refppo.oracle.detect.solve import nice


def propose_constant_score_map(s: Search, groups: list[Group]) -> list[tuple[float, float]]:
    """Every row holds the same score ``s₀``: the slot reward ``y = k·(s₀ + b)`` pins only the
    product, so the map is proposed as its two one-key members, ``(0, y/s₀)`` (scale only, when
    ``s₀ ≠ 0``) and ``(y − s₀, 1)`` (bias only), each the roundest number that still gives ``y``
    (:func:`_roundest`: 2.69 for 3.5/1.3 misses the slots by 3e-3, the exact quotient does not).
    ``y`` must be one number on every row (within tolerance) for some KL placement and slot.
    Which members the walk confirmed is said afterwards by :func:`constant_score_notes`."""
    from refppo.oracle.detect.rollout import _slot_targets  # (it imports this module)

    s0 = float(s.t["scores"].double().flatten()[0])
    tol = s.tol.of(float(s.t["token_rewards"].abs().max()))
    out: list[tuple[float, float]] = []
    for g in groups[:SOLVE_GROUPS]:
        for _, y in _slot_targets(s, g):
            if float(y.max() - y.min()) > tol:
                continue
            y0 = float(y.mean())
            if s0 != 0.0 and y0 != 0.0:
                out.append((0.0, _roundest(y0 / s0, lambda k: k * s0, y0, tol)))
            out.append((_roundest(y0 - s0, lambda b: s0 + b, y0, tol), 1.0))
    out = list(dict.fromkeys(out))[:8]
    for b, k in out:
        s.propose_value("score_bias", b)
        s.propose_value("score_scale", k)
    return out


def _roundest(x: float, slot: Callable[[float], float], y0: float, tol: float) -> float:
    """The first of :func:`nice`'s roundings of ``x`` whose slot value is within ``tol/4`` of
    ``y0``, else ``x`` itself (2.69 for 3.5/1.3 gives 3.497: the exact quotient is proposed)."""
    return next((r for r in nice(x) if abs(slot(r) - y0) <= tol / 4), x)


def constant_score_notes(s: Search, out: list[Group]) -> list[str]:
    """One :attr:`Search.notes` line per KL placement and score slot for a constant-score dump
    whose score map was solved: the class ``k·(s₀ + b) = y`` and, as examples, only the maps
    the walk confirmed (those in the matching groups' conventions), printed so they reproduce."""
    if "token_rewards" in s.unmatched:
        return []
    s0 = float(s.t["scores"].double().flatten()[0])
    found: dict[str, list[tuple[float, float]]] = {}
    for g in out:
        for c in g.convs:
            if c.get("whiten_rewards", "none") != "none":  # the slot value is not k·(s₀ + b) there
                continue
            label = f"kl_in={c['kl_in']} score_at={c['score_at']}"
            mp = (float(c["score_bias"]), float(c["score_scale"]))
            if mp not in found.setdefault(label, []):
                found[label].append(mp)
    notes = []
    for label, maps in found.items():
        y0 = maps[0][1] * (s0 + maps[0][0])
        notes.append(
            f"token_rewards: every score is {s0:g}, so score_bias b and score_scale k cannot be told "
            f"apart: every map with k·({s0:g} + b) = {y0:.6g} reproduces the score slots ({label}), "
            "e.g. " + " or ".join(f"score_bias={_exact(b)} score_scale={_exact(k)}" for b, k in maps)
        )
    return notes


def _exact(v: float) -> str:
    """``v`` in the fewest digits that read back as ``v`` (``2.8``, ``0``, ``2.692307692307692``)."""
    return f"{v:g}" if float(f"{v:g}") == v else repr(v)
