"""Pruning the ``--detect`` walk's returns by the value loss, before the whitening.

On a dump without the rollout intermediates (no ``returns``) nothing checks the rollout steps, so
every reward × GAE × whitening variant reaches the policy step (6156 advantage variants on a
B=64, T=512 dump), and each costs a pass over the B·T tokens there. The value loss

    vf_loss = agg_{t ∈ M}( ½·max((V_t − R_t)², (V^clip_t − R_t)²) ),  ``[B, T]`` → scalar,

reads the rollout only through the returns ``R`` and the value mask, not through the advantage
whitening. So the returns step can drop an option whose ``(R, value mask)`` gives no ``vf_loss``
within tolerance under *any* option of the value step's first walk (every value loss kind and clip
form, both ``vf_mask`` values, every aggregation, the setting's ``ε_v``): no whitening, policy or
value option built on it can pass the value step. The ``vf_loss`` values are the value and
value_agg stages' (:class:`refppo.oracle.detect.value.ValueEval`, as the value step evaluates
them), compared by :meth:`refppo.oracle.detect.search.Search.ratio`'s own
:func:`refppo.oracle.check.compare.compare` at the same tolerance.

Dropping them changes what the walk returns only when the value step would keep a group that
fails it: when no group passes the value step (its nearest groups are then returned), or when a
step after the returns step is unmatched (nearest groups, solver walks). :func:`prune_held`
checks afterwards, from the walks' log (:attr:`Search.walks`), that neither happened: the first walk
of the whitening and policy steps passed some group (or checked nothing: a dump without their
quantities), and the value step's first walk passed some group. Then every dropped candidate would
have failed the value step's ``vf_loss`` check while others passed, so the report is the one of the
unpruned walk; else :func:`refppo.oracle.detect.detection.detect` runs the walk again without pruning.
"""

from __future__ import annotations

from torch import Tensor

from refppo.agg_conventions import MASK_AGGS
from refppo.conventions import KLPlacement, VfMask
from refppo.errors import RefPPOError
from refppo.oracle.check.compare import compare
from refppo.oracle.detect.estimator import needs_estimator_stage
from refppo.oracle.detect.search import CHECKED_AFTER, Search
from refppo.oracle.detect.states import Carried
from refppo.oracle.detect.value import ValueEval, value_kinds


class ValuePrune:
    """Which ``(returns, value mask)`` can reproduce ``vf_loss`` (memoised by the returns' digest)."""

    def __init__(self, search: Search) -> None:
        self.search = search
        self.memo: dict[bytes, bool] = {}
        self.ve = ValueEval(search, memoise=False)  # its own memo holds one bool per returns
        self.dropped = 0
        """Returns options dropped (counted again when a dropped option is replayed)."""

    def keeps(self, ret_key: bytes, returns: Tensor, vm: Tensor) -> bool:
        """False only when no option of the value step's first walk gives ``vf_loss`` within tolerance."""
        if ret_key not in self.memo:
            self.memo[ret_key] = self._can_match(
                Carried(ret_key, {}, KLPlacement.REWARD, vm, returns, ret_key)
            )
        if not self.memo[ret_key]:
            self.dropped += 1
        return self.memo[ret_key]

    def _can_match(self, ca: Carried) -> bool:
        s = self.search
        modes = [a.value for a in MASK_AGGS]
        for vl, form in value_kinds(s):
            for vfm in VfMask:
                try:
                    _, vfs = self.ve.losses(ca, vl, form, vfm, s.hp.cliprange_value, modes)
                except RefPPOError:
                    return True  # the value step raises the same error: nothing to prune on
                if any(compare("vf_loss", s.t["vf_loss"], vfs[a], None, s.tol).ok for a in modes):
                    return True
        return False


def value_prune_for(search: Search) -> ValuePrune | None:
    """A :class:`ValuePrune` when the walk runs GAE without dumped returns and checks ``vf_loss``."""
    t = search.t
    needed = ("vf_loss", "values", "old_values")
    if "returns" in t or not all(search.dump.has(k) for k in needed) or needs_estimator_stage(search):
        return None
    return ValuePrune(search)


def prune_held(search: Search) -> bool:
    """True when the pruned walk returned what the unpruned one returns (module docstring):
    the first walk of each of :data:`CHECKED_AFTER` passed a group or checked nothing, and the value
    step's first walk passed a group."""
    first: dict[str, tuple[bool, bool]] = {}
    for stage, ok_seen, any_check in search.walks:
        first.setdefault(stage, (ok_seen, any_check))
    if "value" not in first or not first["value"][0]:
        return False
    return all(st in first and (first[st][0] or not first[st][1]) for st in CHECKED_AFTER)


__all__ = ["ValuePrune", "prune_held", "value_prune_for"]
