"""The classes of the policy step's logged-only keys: ``clipfrac_agg``/``clipfrac_counts``
(:mod:`refppo.oracle.detect.policy_clipfrac`) and the KL loss's own ``kl_loss_estimator`` and clamps
(:mod:`refppo.oracle.detect.policy_kl`).

Each of these keys changes one output of the policy step (``pg_clipfrac``, ``kl_loss``) and nothing
the later steps read but that output, and many of their members give it bit for bit (every
``clipfrac_counts`` member without a correction or ``cispo``; every member on a dump that does not
hold the output). Walking each member as its own option multiplies the step's options (28 KL-loss
members × 4 clip-fraction members: minutes on a small dump), so the step walks one option per
distinct value (its first member) and its state carries the other members with its value
(:attr:`refppo.oracle.detect.states.PolicyState.members`, its *class*). After the last step,
:func:`list_classes` walks each final group once more, through the same expansion
(:meth:`refppo.oracle.detect.search.Search.expand`, no check: the values are the group's), by the
members of its state's class: they merge into the group as any bit-identical options do, after the
walk's own members (which keep their places among the :data:`refppo.oracle.detect.search.MAX_EQUIV`
a group lists). A final group's members that came from other policy groups share its values; the
class is its state's (the same members but where a member's value ties under one aggregation and
not another: the listed head is re-checked through the pipeline).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from refppo.oracle.detect.groups import Group, Option
from refppo.oracle.detect.search import Search
from refppo.oracle.detect.states import LossState

Members = tuple[dict[str, Any], ...]
"""Members of a class, each a convention update naming its keys in full."""


def list_classes(s: Search, groups: list[Group[LossState]]) -> list[Group[LossState]]:
    """The search's final ``groups`` with the members of their classes merged in (module docstring);
    the groups, their order and states unchanged."""

    def opts(g: Group[LossState]) -> Iterable[Option[LossState]]:
        st = g.state
        key = b"members:" + (g.marks[0][-1][1] if g.marks and g.marks[0] else str(id(g)).encode())
        yield {}, st, key
        kl, cf = st.value.policy.members
        for klm in ({}, *kl):
            for cfm in ({}, *cf):
                if klm or cfm:
                    yield {**klm, **cfm}, st, key

    return s.expand(groups, opts, lambda _: [], "policy")


__all__ = ["Members", "list_classes"]
