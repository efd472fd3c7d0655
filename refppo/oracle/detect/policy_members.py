"""The classes of the policy step's logged-only keys: ``clipfrac_agg``/``clipfrac_counts``
(:mod:`refppo.oracle.detect.policy_clipfrac`) and the KL loss's own ``kl_loss_estimator`` and clamps
(:mod:`refppo.oracle.detect.policy_kl`).

Each of these keys changes one output of the policy step (``pg_clipfrac``, ``kl_loss``) and nothing
the later steps read but that output, and many of their members give it bit for bit (every
``clipfrac_counts`` member without a correction or ``cispo``; every member on a dump that does not
hold the output). Walking each member as its own option multiplies the step's options (28 KL-loss
members × 4 clip-fraction members: minutes on a small dump), so the step walks one option per
distinct value (its first member) and records, by the option's digest, the other members with its
value (its *class*, :class:`Classes`). After the step, :func:`list_classes` walks each kept group
once more, through the same expansion (:meth:`refppo.oracle.detect.search.Search.expand`, no check:
the values are the group's), by the members of its class: they merge into the group as any
bit-identical options do. A group's class is the one recorded for its digest (the first option
that made it; its other members share its values).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from refppo.oracle.detect.groups import Group, Option
from refppo.oracle.detect.search import Search
from refppo.oracle.detect.states import PolicyState

Members = tuple[dict[str, Any], ...]
"""Members of a class, each a convention update naming its keys in full."""


class Classes:
    """The classes of the policy step's options, by digest (``(KL-loss members, clip-fraction
    members)``, each without the option's own)."""

    def __init__(self) -> None:
        self.by_key: dict[bytes, tuple[Members, Members]] = {}

    def record(self, key: bytes, kl: Members, clipfrac: Members) -> None:
        """The class of the option with digest ``key`` (the first recorded is kept)."""
        if (kl or clipfrac) and key not in self.by_key:
            self.by_key[key] = (kl, clipfrac)


def _key(g: Group[Any]) -> bytes | None:
    """The policy step's digest of ``g`` (the last mark of its members)."""
    marks = g.marks[0] if g.marks else ()
    return marks[-1][1] if marks and marks[-1][0] == "policy" else None


def list_classes(s: Search, groups: list[Group[PolicyState]], classes: Classes) -> list[Group[PolicyState]]:
    """``groups`` with the members of each one's class merged in (module docstring); the groups,
    their order and states unchanged."""
    if not any(_key(g) in classes.by_key for g in groups):
        return groups

    def opts(g: Group[PolicyState]) -> Iterable[Option[PolicyState]]:
        key = _key(g)
        st = g.state
        yield {}, st, key or b""
        if key is None or key not in classes.by_key:
            return
        kl, cf = classes.by_key[key]
        for klm in ({}, *kl):
            for cfm in ({}, *cf):
                if klm or cfm:
                    yield {**klm, **cfm}, st, key

    return s.expand(groups, opts, lambda _: [], "policy")


__all__ = ["Classes", "Members", "list_classes"]
