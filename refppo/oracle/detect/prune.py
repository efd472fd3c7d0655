"""Pruning the ``--detect`` search's rollout candidates by the value loss, before the whitening.

On a dump without the rollout intermediates (no ``returns``; issue #9, "Scale") nothing checks the
rollout stages, so every reward × GAE × whitening variant reaches the policy stage (6156 advantage
variants on a B=64, T=512 dump), and each costs a pass over the B·T tokens there. The value loss

    vf_loss = agg_{t ∈ M}( ½·max((V_t − R_t)², (V^clip_t − R_t)²) ),  ``[B, T]`` → scalar,

reads the rollout only through the returns ``R`` and the value mask
(:func:`refppo.pipeline.rollout.value_mask`),
not through the advantage whitening. So the GAE stage can drop an option whose ``(R, value mask)``
gives no ``vf_loss`` within tolerance under *any* option of the value stage's first walk (every value
loss kind and clip form, both ``vf_mask`` values, every aggregation, the setting's ``ε_v``): no
whitening, policy or value option built on it can pass the value stage. The ``vf_loss`` values are
computed by the same core calls as the value stage's (:func:`refppo.core.value.value_loss` or
:func:`refppo.core.by_rows.value_loss_by_rows`, then :func:`refppo.core.aggregate.aggregate_masked`),
so they are the same bits, and compared by :meth:`refppo.oracle.detect.search.Search.ratio`'s own
:func:`refppo.oracle.check.compare.compare` at the same tolerance.

Dropping them changes what the search returns only when the value stage would keep a group that
fails it: when no group passes the value stage (its nearest groups are then returned), or when an
earlier stage after the GAE stage is unmatched (nearest groups, solver walks). :func:`prune_held`
checks afterwards, from the walks' log (:attr:`Search.walks`), that neither happened: the first walk
of the whitening and policy stages passed some group (or checked nothing: a dump without their
quantities), and the value stage's first walk passed some group. Then every dropped candidate would
have failed the value stage's ``vf_loss`` check while others passed, so the report is the one of the
unpruned walk; else :func:`refppo.oracle.detect.detection.detect` runs the search again without pruning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from refppo.conventions import LossAgg, ValueClipForm
from refppo.core.aggregate import aggregate_masked
from refppo.core.by_rows import value_loss_by_rows
from refppo.core.value import value_loss
from refppo.errors import RefPPOError
from refppo.oracle.check.compare import compare
from refppo.pipeline.blocks import update_rows

if TYPE_CHECKING:
    from refppo.oracle.detect.search import Search

CHECKED_AFTER = ("advantages", "policy")
"""Stages after the GAE stage whose first walk must pass some group (or check nothing)."""


class PruneLostError(Exception):
    """Raised by :func:`note_walk` in a pruned search as soon as a first walk shows that
    :func:`prune_held` will be False: the rest of the pruned walk would be thrown away."""


class ValuePrune:
    """Which ``(returns, value mask)`` can reproduce ``vf_loss`` (memoised by the returns' digest)."""

    def __init__(self, search: Search) -> None:
        self.search = search
        self.memo: dict[bytes, bool] = {}
        self.dropped = 0
        """GAE options dropped (counted again when a dropped option is replayed)."""

    def keeps(self, ret_key: bytes, returns: Tensor, vm: Tensor) -> bool:
        """False only when no option of the value stage's first walk gives ``vf_loss`` within tolerance."""
        if ret_key not in self.memo:
            self.memo[ret_key] = self._can_match(returns, vm)
        if not self.memo[ret_key]:
            self.dropped += 1
        return self.memo[ret_key]

    def _can_match(self, returns: Tensor, vm: Tensor) -> bool:
        s = self.search
        t, m, norm = s.t, s.m, s.norm
        values = t.get("values", t["old_values"])
        rows = update_rows(m)
        own_form = s.base.conv.value.clip_form.value
        kinds = [("clipped", f.value) for f in ValueClipForm] + [("unclipped", own_form)]
        for vl, form in kinds:  # the value stage's value_kinds
            for mask in (vm, m):  # vf_mask: value, response
                kw: dict[str, Any] = {"clip": s.hp.cliprange_value, "kind": vl, "clip_form": form, **norm}
                vin = (values, t["old_values"], returns, mask)
                try:
                    out = value_loss(*vin, **kw) if rows is None else value_loss_by_rows(rows, *vin, **kw)
                except RefPPOError:
                    return True  # the value stage raises the same error: nothing to prune on
                # value_loss aggregates per_token by aggregate_masked(per_token, mask, agg, **norm);
                # the stage's other value_loss_agg modes pass the same token count it computes itself
                for agg in LossAgg:
                    vf = aggregate_masked(out.per_token, mask, agg, **norm)
                    if compare("vf_loss", t["vf_loss"], vf, None, s.tol).ok:
                        return True
        return False


def value_prune_for(search: Search) -> ValuePrune | None:
    """A :class:`ValuePrune` when the search walks GAE without dumped returns and checks ``vf_loss``."""
    from refppo.oracle.detect.estimator import needs_estimator_stage

    t = search.t
    needed = ("vf_loss", "values", "old_values")
    if "returns" in t or not all(search.dump.has(k) for k in needed) or needs_estimator_stage(search):
        return None
    return ValuePrune(search)


def note_walk(search: Search, stage: str, ok_seen: bool, any_check: bool) -> None:
    """Log a stage's walk in :attr:`Search.walks`; in a pruned search, raise :class:`PruneLostError` when
    this first walk of the stage already makes :func:`prune_held` False (the value stage passed no
    group, or a stage of :data:`CHECKED_AFTER` checked something and passed no group)."""
    first = all(st != stage for st, _, _ in search.walks)
    search.walks.append((stage, ok_seen, any_check))
    if search.prune is None or not first or ok_seen:
        return
    if stage == "value" or (stage in CHECKED_AFTER and any_check):
        raise PruneLostError(stage)


def prune_held(search: Search) -> bool:
    """True when the pruned search returned what the unpruned one returns (module docstring):
    the first walk of each of :data:`CHECKED_AFTER` passed a group or checked nothing, and the value
    stage's first walk passed a group."""
    first: dict[str, tuple[bool, bool]] = {}
    for stage, ok_seen, any_check in search.walks:
        first.setdefault(stage, (ok_seen, any_check))
    if "value" not in first or not first["value"][0]:
        return False
    return all(st in first and (first[st][0] or not first[st][1]) for st in CHECKED_AFTER)
