"""The groups of the ``--detect`` search and the walk that expands them, in bounded memory.

A stage expands every group by its options (``(convention update, new state, digest)``) and merges
the options whose digests are equal (bit-identical outputs) into one group. A group's state holds
``[B, T]`` tensors (:mod:`refppo.oracle.detect.states`: KL, rewards, advantages, returns, …). On a
dump without the rollout's intermediates nothing prunes the rollout stages, and the number of
groups grows as the product of their options (6156 advantage variants on a B=64, T=512 dump):
holding every state is what ran out of memory. So:

* **Held or replayed.** A stage holds the states of at most :data:`HOLD` of the groups that
  reproduce it (a failing group's state is read again only when it is among the nearest).
  Every other group keeps only its *source*: the group it was expanded from, the stage's option
  walk and the option's index. Its state is rebuilt on demand by running the walk again
  (:class:`Replayer`; the walks are deterministic, so the rebuilt state is bit-identical to the
  first). A stage walks its input groups in order, and the groups of one source are consecutive,
  so each source's walk is replayed once per pass.
* **Scored when made.** Each new group is checked as soon as it is made (the order of the checks,
  and so of their side effects, is the order of the old walk: the groups' creation order). A
  group that cannot be returned is dropped at once, its digest kept so that later options
  merge into it as before: every group that does not reproduce the stage once one does, and,
  before that, every one that :data:`~refppo.oracle.detect.search.NEAREST` others must precede in the
  nearest-first order.

What the stage returns (the groups, their conventions, counts, ``worst`` and order) is the same as a
walk that held every state and scored after merging. Each member of a group carries the digest of
every step it went through (:attr:`Group.marks`): the classes of the listed conventions are read off
them (:mod:`refppo.oracle.detect.classes`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, Protocol, TypeVar

from refppo.oracle.detect.nearest import dead_among, floor_of

S = TypeVar("S")
"""A step's state type (:mod:`refppo.oracle.detect.states`)."""
P = TypeVar("P")
"""The parent step's state type."""

HOLD = 4
"""States a stage holds (the rest are replayed when read)."""
SCREEN = True
"""Whether :func:`expand_groups` screens a :class:`Deferred` option before making it (False: every
option is made and checked in full; the tests compare the two walks' reports)."""
LAZY = True
"""Whether :class:`Lazy` options are made when read (False: as yielded; the tests compare reports)."""

Option = tuple[dict[str, Any], S, bytes]
"""``(convention update, new state, digest)``: one option of a step's walk."""
Marks = tuple[tuple[str, bytes], ...]
"""``((step, digest), ...)``: the digest of each step a group member went through, in order."""


class Deferred(Generic[S]):
    """An option whose state is made only when its screen cannot rule it out.

    ``screen()`` gives ``(lower, key)``: ``lower`` a lower bound of the largest check ratio the
    made state would get (0: the screen cannot tell), ``key`` a digest of the option's outputs on
    the screened rows (options with bit-identical full outputs have equal keys). ``make()`` gives
    the state and the option's digest, as an eager option would. Both are evaluated through the
    stages (the screen on a few rows of the batch: :meth:`refppo.oracle.detect.search.Search.screen_ratio`).
    """

    def __init__(
        self, screen: Callable[[], tuple[float, bytes]], make: Callable[[], tuple[S, bytes]]
    ) -> None:
        self.screen = screen
        self.make = make


class Lazy(Generic[S]):
    """An eager option made when read: at once by :func:`expand_groups`, by a :class:`Replayer`
    only when it is the option rebuilt (the skipped ones are not normalised and digested again).
    ``make()`` gives the state, ``key(state)`` its digest: what an eager walk would yield."""

    def __init__(self, make: Callable[[], S], key: Callable[[S], bytes]) -> None:
        self.make, self.key = make, key

    def made(self) -> tuple[S, bytes]:
        st = self.make()
        return st, self.key(st)


def lazy_option(upd: dict[str, Any], opt: Lazy[S]) -> tuple[dict[str, Any], S | Lazy[S], bytes]:
    """``(upd, opt, b"")`` when :data:`LAZY`, else ``opt`` made at once: ``(upd, state, digest)``."""
    return (upd, opt, b"") if LAZY else (upd, *opt.made())


Deferrable = tuple[dict[str, Any], S | Deferred[S] | Lazy[S], bytes]
"""An option whose state may be :class:`Deferred` (the walks :func:`expand_groups` takes)."""
Options = Callable[["Group[Any]"], Iterable[Deferrable[Any]]]


def made(st: Any) -> Any:
    """``st``, or the state a :class:`Deferred` or a :class:`Lazy` makes."""
    if isinstance(st, Deferred):
        return st.make()[0]
    return st.make() if isinstance(st, Lazy) else st


class Walker(Protocol):
    """What :func:`expand_groups` needs of the search (:class:`refppo.oracle.detect.search.Search`)."""

    replayer: Replayer

    def release_compared(self) -> None: ...

    def note_walk(self, stage: str, ok_seen: bool, any_check: bool) -> None: ...

    def note_unmatched(self, stage: str) -> None: ...


class Replayer:
    """Rebuilds a group's state by replaying its stage's option walk up to the option's index.

    One live walk per stage walk (``options``): a request for a later option of the same source
    advances it; any other request restarts it. Only the last option's state is kept.
    """

    def __init__(self) -> None:
        self.slots: dict[int, tuple[Options, Group[Any], Iterator[Option[Any]], int, Any]] = {}
        self.replayed = 0
        """Options replayed so far (for tests and profiles)."""

    def state(self, parent: Group[Any], options: Options, idx: int) -> Any:
        slot = self.slots.get(id(options))  # the slot holds ``options``: its id is not reused
        if slot is not None and slot[1] is parent and slot[3] == idx:
            return slot[4]
        if slot is None or slot[1] is not parent or slot[3] > idx:
            slot = (options, parent, iter(options(parent)), -1, None)
        _, _, it, pos, st = slot
        while pos < idx:
            _, st, _ = next(it)
            pos += 1
            self.replayed += 1
        st = made(st)  # the deferred and lazy options skipped on the way are not made
        self.slots[id(options)] = (options, parent, it, pos, st)
        return st

    def clear(self) -> None:
        """Drop the live walks (and the tensors their frames hold)."""
        self.slots.clear()


class Group(Generic[S]):
    """Candidates whose outputs so far are identical: their partial conventions and shared state."""

    def __init__(
        self,
        convs: list[dict[str, Any]],
        n_equiv: int,
        state: S | None,
        worst: float = 0.0,
        unmatched: list[str] | None = None,
        source: tuple[Replayer, Group[Any], Options, int] | None = None,
        marks: list[Marks] | None = None,
    ) -> None:
        self.convs = convs
        self.marks: list[Marks] = [()] * len(convs) if marks is None else marks
        """Per member of :attr:`convs`, the digest of each step it went through: members with equal
        digests at a step gave bit-identical outputs there (:mod:`refppo.oracle.detect.classes`)."""
        self.n_equiv = n_equiv
        self.worst = worst
        """Largest err/tol ratio over the quantities checked so far (0 = all matched exactly)."""
        self.unmatched: list[str] = [] if unmatched is None else unmatched
        self._state = state
        self.source = source
        """Where a state that is not held is rebuilt from: (replayer, parent group, walk, index)."""
        self.patches: tuple[Callable[[S], S], ...] = ()
        """Applied, in order, to a replayed state when it is read (:meth:`patch`)."""

    @property
    def held(self) -> bool:
        return self._state is not None

    @property
    def state(self) -> S:
        if self._state is not None:
            return self._state
        if self.source is None:
            raise RuntimeError("search group without a state or a source")
        replayer, parent, options, idx = self.source
        st: S = replayer.state(parent, options, idx)
        for fn in self.patches:
            st = fn(st)
        return st

    def drop_state(self) -> None:
        """Stop holding the state (it is replayed from the source when read)."""
        if self.source is not None:
            self._state = None

    def map_state(self, fn: Callable[[S], Any]) -> Group[Any]:
        """This group with its state replaced by ``fn(state)`` of another type (held or replayed);
        the next step's input."""
        self.patch(fn)
        return self

    def forget(self) -> None:
        """Drop the state and its source (the walk is over: nothing is replayed again)."""
        self._state, self.source, self.patches = None, None, ()

    def patch(self, fn: Callable[[S], S]) -> None:
        """Replace the state by ``fn(state)``, held or replayed (then on every read)."""
        if self._state is not None:
            self._state = fn(self._state)
        else:
            self.patches = (*self.patches, fn)


_DEAD = None
"""A digest whose group was dropped: later options with that digest merge into nothing."""

Live = list[tuple[float, "Group[Any]", bytes]]


def expand_groups(
    search: Walker,
    groups: list[Group[P]],
    options: Callable[[Group[P]], Iterable[Deferrable[S]]],
    checks: Callable[[S], list[float | None]],
    stage: str,
    nearest: int,
    max_equiv: int,
) -> list[Group[S]]:
    """Expand each group by ``options``, merge bit-identical outputs, keep what reproduces the stage.

    Returns, in creation order, the groups whose checks all pass (ratio 0; a group no check applies
    to passes); when some group fails and none passes, the ``nearest`` groups by
    ``max(ratio, worst)`` (a stable sort), with the stage recorded as unmatched.
    """
    ex: _Expansion[S] = _Expansion(search.replayer, nearest, max_equiv, stage)
    ex.floor = floor_of([g.worst for g in groups])
    for g in groups:
        for idx, (upd, st, key) in enumerate(options(g)):
            ex.note_kind(isinstance(st, Deferred))
            if isinstance(st, Deferred):
                got = ex.screened(st)
                if got is None:
                    continue
                st, key = got
            elif isinstance(st, Lazy):
                st, key = st.made()
            if key in ex.merged:
                _merge(ex.merged[key], g, upd, max_equiv, (stage, key))
                continue
            ex.offer(g, (options, idx), upd, [r for r in checks(st) if r is not None], st, key)
    ex.replayer.clear()
    search.release_compared()
    search.note_walk(stage, ex.ok_seen, ex.any_check)  # a pruned search that cannot hold stops here
    if ex.ok_seen or not ex.any_check:
        return [h for r, h, _ in ex.live if r == 0.0]
    search.note_unmatched(stage)
    ex.live.sort(key=lambda sg: max(sg[0], sg[1].worst))
    kept: list[Group[S]] = []
    for r, h, _ in ex.live[:nearest]:
        h.worst = max(h.worst, r)
        h.unmatched.append(stage)
        kept.append(h)
    return kept


class _Expansion(Generic[S]):
    """One :func:`expand_groups`' bookkeeping: the digests seen (``merged``, ``_DEAD`` for a dropped
    group), the live groups in creation order with their worst ratio, and whether a group passed
    (``ok_seen``) and a check applied (``any_check``)."""

    def __init__(self, replayer: Replayer, nearest: int, max_equiv: int, stage: str) -> None:
        self.replayer, self.nearest, self.max_equiv, self.stage = replayer, nearest, max_equiv, stage
        self.merged: dict[bytes, Group[S] | None] = {}
        self.live: Live = []
        self.ok_seen = self.any_check = False
        self.n_held = 0
        self.screen_keys: set[bytes] = set()
        """The screen digests of the deferred options made so far."""
        self.kinds: set[bool] = set()
        self.floor = 0.0  # a lower bound of every new group's final worst (nearest.floor_of)

    def note_kind(self, deferred: bool) -> None:
        """A walk's options are all deferred or all eager: an eager option's outputs have no screen
        digest, so a screened-out option with the same outputs could not be told from it."""
        self.kinds.add(deferred)
        if len(self.kinds) > 1:
            raise RuntimeError(f"{self.stage}: a walk mixes deferred and eager options")

    def screened(self, d: Deferred[S]) -> tuple[S, bytes] | None:
        """``d`` made (its state and digest), or None when its screen shows that the made option
        would be dropped by :meth:`offer` (and merge into no live group).

        Exact: the screen's ``lower`` bounds the option's ratio from below, so it fails its check;
        it is dropped when a group passed (``ok_seen``) or when ``nearest`` groups are sure to sort
        before it even at ``lower`` (:func:`_behind` is monotone in the ratio, and once true stays
        true as the walk goes on). It could only have merged into a live group with bit-identical
        outputs, whose screen digest would be among those made: such an option is made."""
        if SCREEN:
            lower, skey = d.screen()
            new = lower > 0.0 and skey not in self.screen_keys
            if new and (self.ok_seen or _behind(self.live, max(lower, self.floor), self.nearest)):
                self.any_check = True  # the screen is the check, on fewer rows
                return None
            self.screen_keys.add(skey)
        return d.make()

    def offer(
        self,
        g: Group[Any],
        source: tuple[Any, int],
        upd: dict[str, Any],
        ratios: list[float],
        st: S,
        key: bytes,
    ) -> None:
        """A new digest ``key`` of ``g`` under ``upd`` with the checks' ``ratios``: dropped when it
        fails behind a pass or the ``nearest``, else live (its state held if it passes, while fewer
        than :data:`HOLD` are; otherwise replayed from ``source`` = ``(options, idx)``)."""
        self.any_check = self.any_check or bool(ratios)
        s = max(ratios) if ratios else 0.0
        if s != 0.0 and (self.ok_seen or _behind(self.live, max(s, self.floor), self.nearest)):
            self.merged[key] = _DEAD  # never returned: ``s != 0`` means a check applied
            return
        held = s == 0.0 and self.n_held < HOLD  # a failing group is read again only if nearest
        src = None if held else (self.replayer, g, *source)  # a held state needs no source
        mark = (self.stage, key)
        marks = [(*m, mark) for m in g.marks]
        new: Group[S] = Group(
            [{**c, **upd} for c in g.convs],
            g.n_equiv,
            st if held else None,
            g.worst,
            list(g.unmatched),
            src,
            marks,
        )
        self.merged[key] = new
        self.live.append((s, new, key))
        self.n_held += held
        if s == 0.0 and not self.ok_seen:
            self.ok_seen = True
            dead = {i for i, (r, _, _) in enumerate(self.live) if r != 0.0}
        elif s != 0.0:
            dead = _nearest_dead(self.live, self.nearest, self.floor)
        else:
            return
        self.live = _kill(self.live, self.merged, dead)
        self.n_held = sum(1 for _, h, _ in self.live if h.held)


def _merge(
    tgt: Group[Any] | None, g: Group[Any], upd: dict[str, Any], max_equiv: int, mark: tuple[str, bytes]
) -> None:
    """Merge ``g``'s members, updated by ``upd``, into the group ``tgt`` made by the same digest
    (``mark``: the step and that digest)."""
    if tgt is None:
        return
    room = max_equiv - len(tgt.convs)
    if room > 0:
        tgt.convs.extend({**c, **upd} for c in g.convs[:room])
        tgt.marks.extend((*m, mark) for m in g.marks[:room])
    tgt.n_equiv += g.n_equiv
    tgt.worst = min(tgt.worst, g.worst)


def _behind(live: Live, s: float, nearest: int) -> bool:
    """True when ``nearest`` earlier groups are sure to sort before a new group of ratio ``s``.

    A group's final sort key is ``max(ratio, worst)``; ``worst`` only decreases as options merge
    in, so ``max(ratio, worst)`` now bounds it from above, and the new group's key is at least
    ``s``. The sort is stable, so earlier groups with a key ``<= s`` come first.
    """
    n = 0
    for r, g, _ in live:
        if r != 0.0 and max(r, g.worst) <= s:
            n += 1
            if n >= nearest:
                return True
    return False


def _nearest_dead(live: Live, nearest: int, floor: float = 0.0) -> set[int]:
    """The failing groups that ``nearest`` others are sure to precede (see :func:`_behind`).

    Group ``j`` is preceded by ``k`` for sure when ``k``'s key bound is below ``j``'s key's lower
    bound ``max(ratio, floor)`` (``nearest.floor_of``), or equal to it with ``k`` made earlier.
    """
    failing = [(i, max(r, floor), max(r, g.worst)) for i, (r, g, _) in enumerate(live) if r != 0.0]
    if len(failing) <= nearest:
        return set()
    return dead_among(failing, nearest)


def _kill(live: Live, merged: dict[bytes, Any], dead: set[int]) -> Live:
    """``live`` without the entries ``dead``; their digests stay in ``merged`` as dropped."""
    if not dead:
        return live
    for i in dead:
        merged[live[i][2]] = _DEAD
    return [e for i, e in enumerate(live) if i not in dead]
