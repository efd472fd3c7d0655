"""The rejection gate under ``rollout_rs_effect=drop_mask`` in ``--detect``'s returns step (#22 item 6).

verl 0.9.1 writes the gate's kept tokens into ``response_mask`` before ``compute_advantage``
(``ray_trainer.py``, ``compute_rollout_correction_and_add_to_batch``): GAE, the whitening and every
loss then read ``m' = m ∧ keep`` (and ``value_mask' = value_mask ∧ keep``); the KL and the token
rewards read the original mask. The gate reads only ``old_logprobs`` and ``rollout_logprobs``, so
its mask is known before GAE. The returns step (stages ``rollout_gate``, ``advantages``) therefore

- under a checked ``drop_mask`` gate (``--set``): applies it (:func:`returns_walk`), and
- from a setting without one, when nothing reproduces ``returns`` on a dump with
  ``rollout_logprobs`` and a critic: reads the gate off ``returns`` (:func:`solve_dropped`) and walks
  the returns step again under its mask, each listed entry naming the gate
  (``rollout_rs_effect=drop_mask``, its level, statistic, order, reduction and thresholds).

Either way the search then holds the gated mask (:func:`regate`): rows the gate empties leave the
batch (as :mod:`refppo.pipeline.row_subset` takes them out of the pipeline's walk), so the later
steps (whitening, correction, policy, value, loss) read ``m'`` and the value mask ``vm ∧ keep``.

The solver (exact, on stage outputs). GAE reads each row alone, so row ``i``'s returns depend on its
kept tokens only. For a gate family (:data:`refppo.oracle.detect.gates.GATE_FAMILIES`) with the
statistic ``u`` (:func:`refppo.pipeline.correction.gate_statistic_of`), a band ``[L, H]`` keeps on
row ``i`` the tokens whose ``u`` lies in it: a contiguous run ``w_a ≤ … ≤ w_b`` of the row's sorted
distinct values (all or none at sequence level). Each run is evaluated through the advantages stage
(one call per row, the runs stacked as rows) and kept when its returns equal the dumped ones on its
value mask; a consistent run fixes ``(L, H)`` to the box ``(w_{a−1}, w_a] × [w_b, w_{b+1})``, an
emptied row to ``L > max w`` or ``H < min w``. The boxes are intersected over the rows; a surviving box
keeps the same tokens everywhere in it, so its thresholds are fixed only to that interval (the value
with the fewest significant digits in it is proposed:
:func:`refppo.oracle.detect.correction.nicest_in`). The box keeping the most tokens is confirmed on
the whole batch through the ``rollout_gate`` and ``advantages`` stages; every family whose box gives
the same mask is an equivalent entry. Rows beyond :data:`MAX_ROWS` and runs of rows with more than
:data:`MAX_RUN_VALUES` distinct values are left to that confirmation (one-sided runs only there).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, TypeVar

import torch
from torch import Tensor

from refppo.conventions import GaeHoles
from refppo.errors import RefPPOError
from refppo.oracle.check.compare import compare
from refppo.oracle.detect.correction import nicest_in
from refppo.oracle.detect.gates import DROPPED, GATE_FAMILIES, Dropped, GateFamily, gate_keys, nicest_signed
from refppo.oracle.detect.groups import Deferrable, Deferred, Group, Lazy, Options
from refppo.oracle.detect.search import SOLVE_GROUPS, Search
from refppo.oracle.detect.states import KLState, ReturnsState, RewardState
from refppo.pipeline.blocks import Evaluation, update_rows
from refppo.pipeline.correction import gate_statistic_of
from refppo.pipeline.row_subset import kept_rows, take_rows
from refppo.pipeline.settings import Convention
from refppo.rollout_conventions import ISLevel

MAX_ROWS = 32
"""Rows the solver reads (evenly spread); the confirmation reads every row."""
MAX_RUN_VALUES = 24
"""Distinct statistic values of a row above which only one-sided runs are tried on it."""
MAX_BOXES = 64
"""Boxes kept while intersecting over the rows."""
MAX_LISTED = 32
"""Equivalent gate settings listed per group."""
_ROLLOUT = Evaluation()
Box = tuple[float, float, float, float]
"""``(La, Lb, Ha, Hb)``: ``L ∈ (La, Lb]``, ``H ∈ [Ha, Hb)``."""
Bounds = tuple[float | None, float | None]
Make = Callable[[Any], Options]
T = TypeVar("T")


def _walkable(s: Search) -> bool:
    t = s.t
    return all(k in t for k in ("rollout_logprobs", "old_values", "returns")) and "group_index" not in t


def returns_walk(
    s: Search,
    groups: list[Group[RewardState]],
    make: Make,
    checks: Callable[[ReturnsState], list[float | None]],
    propose: Callable[[list[Group[RewardState]]], Any],
) -> list[Group[ReturnsState]]:
    """The returns step's walk (``s.stage(groups, make, checks, "returns", propose)``) under the
    drop_mask gate (module docstring): the checked one, or the one read off ``returns`` when the walk
    reproduces nothing (its options then name the gate's equivalent settings); else as it is."""
    if s.base.conv.gate.drops:
        q = _gate_q(s, groups[0].state) if groups else None
        if q is not None:
            m2 = s.evaluate("rollout_gate", q, s.setting(stage="rollout_gate"), _ROLLOUT)["mask"]
            groups = regate(s, groups, Dropped(m2, ()))
        return s.stage(groups, make, checks, "returns", propose)
    out = s.stage(groups, make, checks, "returns", propose)
    if "returns" not in s.unmatched or not groups or not _walkable(s):
        return out
    found = solve_dropped(s, groups)
    if found is None:
        return out
    s.unmatched.remove("returns")
    keys = found.keys
    return s.stage(regate(s, groups, found), lambda e: _named(make(e), keys), checks, "returns", propose)


def _named(opts: Options, keys: tuple[dict[str, Any], ...]) -> Options:
    """``opts`` with each option once per equivalent gate setting ``keys`` (its state made once)."""

    def out(g: Group[Any]) -> Iterable[Deferrable[Any]]:
        for upd, st, key in opts(g):
            shared: Any = st
            if isinstance(st, Deferred):
                shared = Deferred(_once(st.screen), _once(st.make))
            elif isinstance(st, Lazy):
                shared = Lazy(_once(st.make), st.key)
            for k in keys:
                yield {**upd, **k}, shared, key

    return out


def _once(fn: Callable[[], T]) -> Callable[[], T]:
    got: list[T] = []

    def call() -> T:
        if not got:
            got.append(fn())
        return got[0]

    return call


def _gate_q(s: Search, rs: RewardState) -> dict[str, Any] | None:
    if "rollout_logprobs" not in s.t:
        return None
    return {
        "old_logprobs": s.t["old_logprobs"], "rollout_logprobs": s.t["rollout_logprobs"], "mask": s.m,
        "value_mask": rs.vm,
    }  # fmt: skip


def regate(s: Search, groups: list[Group[RewardState]], found: Dropped) -> list[Group[RewardState]]:
    """Put ``s`` under the gate's mask from here on: ``s.m = m'`` and ``s.t`` on the rows it leaves
    a valid token, the reward states' value masks ``vm ∧ keep`` on those rows (held: a replay would
    read the new mask)."""
    m2 = found.mask
    rows = kept_rows({"mask": m2})
    states = [(g, g.state) for g in groups]
    if rows is not None:
        s.t = take_rows(dict(s.t.items()), rows)
    s.m = m2 if rows is None else m2[rows]
    s.ev = Evaluation(rows=update_rows(s.m), keep_ratio=False)
    s.holes = bool((s.m[:, 1:] & ~s.m[:, :-1]).any())
    B = s.m.shape[0]
    k = min(8, B // 4)
    s.screen_rows = torch.unique(torch.linspace(0, B - 1, k).round().long()) if k > 0 else None
    s._dump_scale.clear()  # the search's caches, on the new rows
    s._vms.clear()
    DROPPED[s] = found
    out = []
    for g, st in states:
        cut = _cut_state(st, m2, rows)
        out.append(Group(list(g.convs), g.n_equiv, cut, g.worst, list(g.unmatched), None, list(g.marks)))
    return out


def _cut_state(rs: RewardState, m2: Tensor, rows: Tensor | None) -> RewardState:
    def cut(x: Tensor) -> Tensor:
        return x if rows is None else x[rows]

    kl = rs.kl if rs.kl.kl is None else KLState(rs.kl.setting, cut(rs.kl.kl), rs.kl.key)
    return replace(rs, kl=kl, vm=cut(rs.vm & m2), scores=cut(rs.scores), rewards=cut(rs.rewards))


# ----- the solver ---------------------------------------------------------------------------------


def solve_dropped(s: Search, groups: list[Group[RewardState]]) -> Dropped | None:
    """The drop_mask gate whose mask reproduces the dumped ``returns`` under GAE (module docstring),
    with its equivalent settings; None when no family's does."""
    for g in groups[:SOLVE_GROUPS]:
        rs = g.state
        for holes in [
            s.base.conv.adv.gae_holes,
            *(h for h in GaeHoles if h is not s.base.conv.adv.gae_holes),
        ]:
            upd = {"advantage": "gae", "gae_holes": holes.value, "kl_in": rs.kl_in.value}
            got = _solve_under(s, rs, upd)
            if got is not None:
                return got
    return None


def _row_eval(s: Search, rs: RewardState, upd: dict[str, Any]) -> Callable[[int, Tensor], Tensor]:
    """``ok(i, masks [C, T])``: whether each candidate mask of row ``i`` reproduces its returns."""
    t, st = s.t, s.setting(**upd)
    d = t["returns"]
    tol = s.tol.of(float(d.abs().max()))
    memo: dict[tuple[int, bytes], bool] = {}

    def ok(i: int, masks: Tensor) -> Tensor:
        res = torch.zeros(masks.shape[0], dtype=torch.bool)
        todo = [c for c in range(masks.shape[0]) if (i, bytes(masks[c].numpy())) not in memo]
        if todo:
            cm = masks[todo]
            C = cm.shape[0]

            def rep(x: Tensor | None) -> Tensor | None:
                return None if x is None else x[i : i + 1].expand(C, *x.shape[1:]).clone()

            vm = rs.vm[i : i + 1] & cm
            q = {
                "token_rewards": rep(rs.rewards), "old_values": rep(t["old_values"]),
                "value_mask": vm, "mask": cm, "mapped_scores": rep(rs.scores),
                "kl": rep(rs.kl.kl), "group_index": None, "bootstrap_values": rep(t.get("bootstrap_values")),
                "truncated": rep(t.get("truncated")),
            }  # fmt: skip
            try:
                ret = s.evaluate("advantages", q, st, _ROLLOUT)["returns"]
            except RefPPOError:
                return res
            err = torch.where(vm, (ret.double() - d[i].double()).abs(), 0.0).amax(dim=1)
            for j, c in enumerate(todo):
                memo[(i, bytes(masks[c].numpy()))] = bool(err[j] <= tol)
        for c in range(masks.shape[0]):
            res[c] = memo[(i, bytes(masks[c].numpy()))]
        return res

    return ok


def _solve_under(s: Search, rs: RewardState, upd: dict[str, Any]) -> Dropped | None:
    m = s.m
    q = {"old_logprobs": s.t["old_logprobs"], "rollout_logprobs": s.t["rollout_logprobs"], "mask": m}
    B = m.shape[0]
    rows = [int(r) for r in torch.unique(torch.linspace(0, B - 1, min(B, MAX_ROWS)).round().long())]
    ok = _row_eval(s, rs, upd)
    found: list[tuple[int, GateFamily, Bounds, Tensor]] = []
    for fam in GATE_FAMILIES:
        u = _stat(q, fam)
        boxes: list[Box] = [(-math.inf, math.inf, -math.inf, math.inf)]
        for i in rows:
            boxes = _intersect(boxes, _row_regions(u[i], m[i], fam[0], ok, i))[:MAX_BOXES]
            if not boxes:
                break
        for box in boxes:
            b = _bounds(box)
            if b is None:
                continue
            keep = _kept(u, m, b)
            n = int(keep.sum())
            if 0 < n < int(m.sum()):
                found.append((n, fam, b, keep))
    found.sort(key=lambda f: -f[0])
    tried: set[bytes] = set()
    for _n, _fam, _b, keep in found:
        key = bytes(keep.numpy())
        if key in tried:
            continue
        tried.add(key)
        if _confirms(s, rs, upd, keep):
            same = [(f, b) for _, f, b, k in found if bytes(k.numpy()) == key]
            return Dropped(keep, _settings(s, same, {f: _stat(q, f)[m] for f, _ in same}))
    return None


def _stat(q: dict[str, Any], fam: GateFamily) -> Tensor:
    return gate_statistic_of(q, Convention.of(**gate_keys(fam, None, None))).double()


def _row_regions(
    u: Tensor, m: Tensor, level: ISLevel, ok: Callable[[int, Tensor], Tensor], i: int
) -> list[Box]:
    """The boxes of ``(L, H)`` under which row ``i`` reproduces its returns (emptied: always)."""
    w = torch.unique(u[m])  # sorted
    n = w.numel()
    if n == 0:
        return [(-math.inf, math.inf, -math.inf, math.inf)]
    out: list[Box] = []
    if level is ISLevel.SEQUENCE:
        runs = [(0, n - 1)]
    elif n <= MAX_RUN_VALUES:
        runs = [(a, b) for a in range(n) for b in range(a, n)]
    else:
        runs = [(0, b) for b in range(n)] + [(a, n - 1) for a in range(1, n)]
    masks = torch.stack([m & (u >= w[a]) & (u <= w[b]) for a, b in runs])
    good = ok(i, masks)
    for (a, b), g in zip(runs, good.tolist(), strict=True):
        if g:
            la = -math.inf if a == 0 else float(w[a - 1])
            hb = math.inf if b == n - 1 else float(w[b + 1])
            out.append((la, float(w[a]), float(w[b]), hb))
    # the row emptied last (the band between two consecutive values, or beyond them all): the boxes
    # keeping some of it come first
    ends = [-math.inf, *w.tolist(), math.inf]
    return [*out, *((ends[k], math.inf, -math.inf, ends[k + 1]) for k in range(n + 1))]


def _intersect(boxes: list[Box], regions: list[Box]) -> list[Box]:
    out: list[Box] = []
    for a in boxes:
        for r in regions:
            la, lb = max(a[0], r[0]), min(a[1], r[1])
            ha, hb = max(a[2], r[2]), min(a[3], r[3])
            if la < lb and ha < hb:
                out.append((la, lb, ha, hb))
    return list(dict.fromkeys(out))


def _bounds(box: Box) -> Bounds | None:
    """The roundest ``(L, H)`` in ``box`` (None on a side it leaves unbounded; None: a box that
    bounds neither side, or one a row's emptying leaves open above)."""
    la, lb, ha, hb = box
    if math.isinf(lb) or math.isinf(ha):
        return None
    low = None if math.isinf(la) else _inside(la, lb)
    high = None if math.isinf(hb) else _inside(ha, hb)
    return None if low is None and high is None else (low, high)


def _inside(a: float, b: float) -> float:
    """The value with the fewest significant digits strictly inside ``(a, b)`` (``b`` itself when
    none is)."""
    got = nicest_signed(nicest_in, a, b)
    return got if a < got < b else b


def _kept(u: Tensor, m: Tensor, b: Bounds) -> Tensor:
    low = -math.inf if b[0] is None else b[0]
    high = math.inf if b[1] is None else b[1]
    return m & (u >= low) & (u <= high)


def _confirms(s: Search, rs: RewardState, upd: dict[str, Any], keep: Tensor) -> bool:
    """GAE under ``keep`` on the rows it leaves a token reproduces ``returns`` (compared on ``vm ∧ keep``)."""
    t = s.t
    rows = keep.any(dim=1)
    q = {
        "token_rewards": rs.rewards, "old_values": t["old_values"], "value_mask": rs.vm & keep, "mask": keep,
        "mapped_scores": rs.scores, "kl": rs.kl.kl, "group_index": None,
        "bootstrap_values": t.get("bootstrap_values"), "truncated": t.get("truncated"),
    }  # fmt: skip
    q = take_rows(q, rows)
    try:
        ret = s.evaluate("advantages", q, s.setting(**upd), _ROLLOUT)["returns"]
    except RefPPOError:
        return False
    return compare("returns", t["returns"][rows], ret, q["value_mask"], s.tol).ok


def _settings(
    s: Search, same: Iterable[tuple[GateFamily, Bounds]], stats: dict[GateFamily, Tensor]
) -> tuple[dict[str, Any], ...]:
    """The gate settings giving the confirmed mask, each threshold proposed and its interval (the
    observed statistics around it) noted."""
    out: list[dict[str, Any]] = []
    for fam, (low, high) in same:
        keys = {**gate_keys(fam, low, high), "rollout_rs_effect": "drop_mask"}
        if keys in out:
            continue
        out.append(keys)
        u = stats[fam]
        what = f"rollout_rs={fam[0].value}, {fam[1].value}, {fam[2].value}, drop_mask"
        for key, val in (("rollout_rs_low", low), ("rollout_rs_high", high)):
            s.propose_value(key, val)
            if val is not None and len(out) <= 4:
                below, above = u[u < val], u[u > val]
                if below.numel() and above.numel():
                    s.notes.append(
                        f"{key}={val} ({what}): read off returns: fixed only to an interval: every value "
                        f"between the observed statistics {float(below.max()):.6g} and "
                        f"{float(above.min()):.6g} keeps the same tokens, so the dump cannot tell them apart"
                    )
    return tuple(out[:MAX_LISTED])


__all__ = ["regate", "returns_walk", "solve_dropped"]
