"""The classes of listed conventions that a dump cannot tell apart (``--detect``, issue #23 item 2).

Two conventions that ``--detect`` lists are in one class when they give bit-identical values on
every dumped quantity. The classes are read off what the walk already evaluated — never from a
tolerance, never by running the pipeline again per pair:

* **The walk's digests.** Each step of the walk (:data:`refppo.oracle.detect.steps.STEPS`) merges
  its options by a digest of their stage outputs (:func:`refppo.oracle.detect.states.digest`: equal
  digests, bit-identical tensors), and each member of a group carries the digest of every step it
  went through (:attr:`refppo.oracle.detect.groups.Group.marks`). A step's digest covers the
  quantities :attr:`~refppo.oracle.detect.steps.Step.checks` names, so two members whose digests are
  equal at every step that checks a dumped quantity give bit-identical values of every dumped
  quantity. (A later step may merge members whose earlier outputs differ — the loss step merges by
  the scalars alone —: the earlier step's digest still tells them apart.)
* **The stage table.** A key that no dumped quantity can read
  (:func:`refppo.oracle.detect.evidence.pinned_by`: the value loss's keys on a dump without
  ``vf_loss``, ``vf_clipfrac``, ``loss`` and ``grad_values``) changes no dumped value: two members
  that differ only on such keys fall together.

The classes are the closure of the two relations (union-find over the listed members). They are never
coarser than bit-identity on the dumped quantities; they can be finer (two members whose dumped
values agree bit for bit through different undumped intermediates and different read keys stay
apart). The walk evaluates no gradient (the re-check through the pipeline compares them): with a
gradient dumped, members with different ``kl_estimator`` are kept apart (a straight-through ``k3+``
has ``k3``'s values and another gradient).

Within a class, the keys whose values differ are what the dump cannot tell apart; the first undumped
output each can change (:func:`refppo.oracle.detect.evidence.first_undumped`, from the stage table)
is what to dump to separate them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from refppo.oracle.detect.evidence import first_undumped, pinned_by
from refppo.oracle.detect.groups import Marks
from refppo.oracle.detect.steps import STEPS

CHECKS: dict[str, frozenset[str]] = {st.name: frozenset(st.checks) for st in STEPS}
"""The dumped quantities each step's digest covers (what it checks)."""
GRADIENTS = ("grad_logprobs", "grad_values")


@dataclass(frozen=True)
class ConvClass:
    """Listed conventions that give bit-identical values on every dumped quantity."""

    members: tuple[int, ...]
    """Indices into the detection's conventions (nearest first): ``members[0]`` represents it."""
    representative: dict[str, Any]
    """The convention ``members[0]``: its nearest member."""
    size: int
    """Conventions the walk counted in it: its listed members and, for a group of the walk wholly in
    it, the members beyond :data:`refppo.oracle.detect.search.MAX_EQUIV` it counted, not listed."""
    differing: dict[str, list[Any]] = field(default_factory=dict)
    """The keys whose values differ among its listed members, each with those values (first seen
    first): what the dump cannot tell apart."""
    separate: dict[str, str | None] = field(default_factory=dict)
    """For each differing key, the first undumped output that can change it with the dumped ones
    held fixed (what to dump to separate the members); None: every output it can change is dumped
    and agrees (on these inputs its values give the same step)."""


@dataclass(frozen=True)
class Classes:
    """The classes of a detection and the members the walk counted whose class is not known."""

    classes: list[ConvClass]
    unassigned: int = 0
    """Members counted beyond :data:`~refppo.oracle.detect.search.MAX_EQUIV` in a group of the walk
    whose listed members fall in more than one class (or that lost every listed member to the
    refused settings): counted in ``detected_count``, in no class."""


class _Union:
    def __init__(self, n: int) -> None:
        self.up = list(range(n))

    def find(self, i: int) -> int:
        while self.up[i] != i:
            self.up[i] = self.up[self.up[i]]
            i = self.up[i]
        return i

    def join(self, i: int, j: int) -> None:
        a, b = self.find(i), self.find(j)
        if a != b:
            self.up[max(a, b)] = min(a, b)


def unread_keys(keys: Sequence[str], dumped: frozenset[str]) -> frozenset[str]:
    """The keys (flat convention keys, hyperparameters) that no dumped quantity can read."""
    return frozenset(k for k in keys if not dumped.intersection(pinned_by(k)))


def classify(
    convs: Sequence[dict[str, Any]],
    origin: Sequence[tuple[int, Marks]],
    n_equiv: Sequence[int],
    dumped: frozenset[str],
    *,
    counted: bool = True,
) -> Classes:
    """The classes of ``convs`` (full conventions, nearest first).

    ``origin[i]``: the matched group of the walk that ``convs[i]`` comes from (an index into
    ``n_equiv``, its groups' counts) and its :attr:`~refppo.oracle.detect.groups.Group.marks`.
    ``dumped``: the trainer outputs the dump holds. ``counted``: whether the groups' counts hold
    (False when the re-check dropped members: a class then counts its listed members only).
    """
    n = len(convs)
    u = _Union(n)
    grads = bool(dumped.intersection(GRADIENTS))
    keys = list(convs[0]) if convs else []  # every entry has one schema; any other key is added
    keys += sorted({k for c in convs if len(c) != len(keys) for k in c} - set(keys))
    rows = [tuple(_hashable(v) if isinstance(v, list) else v for v in map(c.get, keys)) for c in convs]
    unread = unread_keys(keys, dumped)
    read = [j for j, k in enumerate(keys) if k not in unread]
    est = keys.index("kl_estimator") if grads and "kl_estimator" in keys else None
    first: dict[Any, int] = {}
    for i, (_, marks) in enumerate(origin):
        sig = tuple(d for st, d in marks if CHECKS.get(st, frozenset()) & dumped)
        u.join(i, first.setdefault(("digests", sig, None if est is None else rows[i][est]), i))
        u.join(i, first.setdefault(("keys", tuple(rows[i][j] for j in read)), i))
    by_root: dict[int, list[int]] = {}
    for i in range(n):
        by_root.setdefault(u.find(i), []).append(i)
    return _counted(convs, rows, keys, origin, n_equiv, list(by_root.values()), dumped, counted)


def _hashable(v: Any) -> Any:
    """``v`` with its lists as tuples (a clamp pair ``[-10.0, None]``)."""
    return tuple(_hashable(x) for x in v) if isinstance(v, list) else v


def _counted(
    convs: Sequence[dict[str, Any]],
    rows: list[tuple[Any, ...]],
    keys: list[str],
    origin: Sequence[tuple[int, Marks]],
    n_equiv: Sequence[int],
    parts: list[list[int]],
    dumped: frozenset[str],
    counted: bool,
) -> Classes:
    """The :class:`Classes` of the member lists ``parts`` (each in order; ``parts`` by first member),
    with the groups' members beyond the listed ones counted in the class that holds the whole group."""
    listed = [0] * len(n_equiv)
    where: dict[int, set[int]] = {}
    for ci, part in enumerate(parts):
        for i in part:
            listed[origin[i][0]] += 1
            where.setdefault(origin[i][0], set()).add(ci)
    extra = [0] * len(parts)
    unassigned = 0
    if counted:
        for gi, n in enumerate(n_equiv):
            more = n - listed[gi]
            home = where.get(gi, set())
            if len(home) == 1:
                extra[next(iter(home))] += more
            else:
                unassigned += more
    out = []
    for ci, part in enumerate(parts):
        diff = _differing(convs, rows, keys, part)
        sep = {k: first_undumped(k, dumped) for k in diff}
        out.append(ConvClass(tuple(part), convs[part[0]], len(part) + extra[ci], diff, sep))
    return Classes(out, unassigned)


def _differing(
    convs: Sequence[dict[str, Any]], rows: list[tuple[Any, ...]], keys: list[str], part: list[int]
) -> dict[str, list[Any]]:
    """The keys whose values differ among the members ``part``, with the values in first-seen order
    (``rows``: each convention's values of ``keys``, hashable)."""
    out: dict[str, list[Any]] = {}
    r0 = rows[part[0]]
    for j, k in enumerate(keys):
        if all(rows[i][j] == r0[j] for i in part):
            continue
        seen: dict[Any, Any] = {}
        for i in part:
            seen.setdefault(rows[i][j], convs[i].get(k))
        out[k] = list(seen.values())
    return out


__all__ = ["CHECKS", "Classes", "ConvClass", "classify", "unread_keys"]
