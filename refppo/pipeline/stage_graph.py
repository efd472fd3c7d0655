"""Queries on the stage table's dependency graph: which stages a quantity depends on
(:func:`upstream`), what a set of stages changes (:func:`downstream`) and which convention keys can
change a quantity (:func:`keys_upstream`). Read by the diagnosis and the named bugs."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from refppo.pipeline.stages import STAGES, Stage


def upstream(quantity: str, stages: Sequence[Stage] = STAGES) -> tuple[Stage, ...]:
    """The stages ``quantity`` depends on (its maker and, through what it reads for it, theirs), in
    order. A quantity read by a stage comes from the last stage before it that makes it (the
    rejection gate rewrites ``mask``: the stages before it read the input)."""
    need, seen, done = [(quantity, len(stages))], set(), set()
    while need:
        q, before = need.pop()
        at = next((i for i in range(before - 1, -1, -1) if q in stages[i].makes), None)
        if at is None or (q, at) in done:
            continue
        done.add((q, at))
        seen.add(at)
        s = stages[at]
        need.extend((r, at) for r in s.output_reads.get(q, s.reads))
    return tuple(s for i, s in enumerate(stages) if i in seen)


def downstream(names: Collection[str], stages: Sequence[Stage] = STAGES) -> frozenset[str]:
    """Every quantity made by the stages ``names`` or, transitively, from what they make (an output
    with :attr:`Stage.output_reads` only from those reads)."""
    hit: set[str] = set()
    for s in stages:
        for q in s.makes:
            if s.name in names or hit & set(s.output_reads.get(q, s.reads)):
                hit.add(q)
    return frozenset(hit)


def keys_upstream(quantity: str) -> tuple[str, ...]:
    """Every flat convention key that can change ``quantity``: the keys of its :func:`upstream`
    stages, in pipeline order (each once)."""
    return tuple(dict.fromkeys(k for s in upstream(quantity) for k in s.keys))


__all__ = ["downstream", "keys_upstream", "upstream"]
