"""The classes of the policy step's logged-only keys: ``clipfrac_agg``/``clipfrac_counts``
(:mod:`refppo.oracle.detect.policy_clipfrac`) and the KL loss's own ``kl_loss_estimator`` and clamps
(:mod:`refppo.oracle.detect.policy_kl`).

Each of these keys changes one output of the policy step (``pg_clipfrac``, ``kl_loss``) and nothing
the later steps read but that output, and many of their members give it bit for bit (every
``clipfrac_counts`` member without a correction or ``cispo``; every member on a dump that does not
hold the output). Walking each member as its own option multiplies the step's options (28 KL-loss
members × 4 clip-fraction members: minutes on a small dump), so the step walks one option per
distinct value (its first member) and records, by the option's digest, the other members with its
value (its *class*, :class:`Classes`). After the last step, :func:`list_classes` walks each final
group once more, through the same expansion (:meth:`refppo.oracle.detect.search.Search.expand`, no
check: the values are the group's), by the members of its class: they merge into the group as any
bit-identical options do. A member's class is the one recorded for its policy digest (the first
option that made it; its other members share its values); a group lists the members common to
its listed members' classes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from refppo.oracle.detect.groups import Group, Marks, Option
from refppo.oracle.detect.search import Search

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


def _policy_key(marks: Marks) -> bytes | None:
    """The policy step's digest in a member's ``marks`` (None: it did not go through the step)."""
    return next((k for st, k in marks if st == "policy"), None)


def _common(g: Group[Any], classes: Classes) -> tuple[Members, Members]:
    """The class members valid for every listed member of ``g``: those in each member's class (the
    members of a final group can come from several policy groups; most share one class)."""
    kl: Members | None = None
    cf: Members | None = None
    for marks in g.marks:
        key = _policy_key(marks)
        got = classes.by_key.get(key, ((), ())) if key is not None else ((), ())
        kl = got[0] if kl is None else tuple(m for m in kl if m in got[0])
        cf = got[1] if cf is None else tuple(m for m in cf if m in got[1])
    return kl or (), cf or ()


def list_classes(s: Search, groups: list[Group[Any]], classes: Classes) -> list[Group[Any]]:
    """The search's final ``groups`` with the members of their classes merged in (module docstring):
    the groups, their order and states unchanged. After the last step, so that a group's members
    from the walk come first among the :data:`refppo.oracle.detect.search.MAX_EQUIV` it lists."""
    common = [_common(g, classes) for g in groups]
    if not any(kl or cf for kl, cf in common):
        return groups
    by_id = {id(g): c for g, c in zip(groups, common, strict=True)}

    def opts(g: Group[Any]) -> Iterable[Option[Any]]:
        key = g.marks[0][-1][1] if g.marks and g.marks[0] else b""  # the last step's digest
        st = g.state
        yield {}, st, key
        kl, cf = by_id[id(g)]
        for klm in ({}, *kl):
            for cfm in ({}, *cf):
                if klm or cfm:
                    yield {**klm, **cfm}, st, key

    return s.expand(groups, opts, lambda _: [], "policy")


__all__ = ["Classes", "Members", "list_classes"]
