"""The distinct advantage states the correction step's solvers run on, and their per-token loss terms.

The rollout correction's solvers (:mod:`refppo.oracle.detect.correction` for the caps,
:mod:`refppo.oracle.detect.gates` for the gates' thresholds, and the gradient's readings of
:mod:`refppo.oracle.detect.correction_grad`) each read the advantage states of the first
:data:`~refppo.oracle.detect.search.SOLVE_GROUPS` groups, once per distinct advantage tensor (two
groups with bit-identical advantages give the same equations); :func:`distinct_states` yields them,
in the groups' order.

:func:`loss_terms` then gives, per state, dual clip and ``loss_agg``, the coefficients ``c_t =
a_t·ℓ_t`` on the valid tokens (1-D, the mask's order, float64) that every solver multiplies by a
weight: ``ℓ_t`` the policy stage's unweighted per-token loss ``pg_per_token`` [B, T] under the
checked policy setting with that dual clip, ``a_t = ∂pg_loss/∂ℓ_t`` the policy_agg stage's weights
under that aggregation (:func:`refppo.oracle.detect.policy_solve.agg_weights`: every aggregation is
linear), so that a weight ``w`` gives ``pg_loss = Σ_t c_t·w_t``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch import Tensor

from refppo.agg_conventions import MASK_AGGS
from refppo.conventions import LossAgg
from refppo.oracle.detect.groups import Group
from refppo.oracle.detect.policy_solve import agg_weights
from refppo.oracle.detect.search import SOLVE_GROUPS, Search
from refppo.oracle.detect.states import AdvState


def distinct_states(groups: list[Group[AdvState]], with_kl: bool = False) -> Iterator[AdvState]:
    """The states of the first :data:`SOLVE_GROUPS` groups, each distinct advantage tensor once (the
    first group's state); ``with_kl``: distinct by advantages and KL identity together (a reading
    of the gradient also depends on the KL term)."""
    seen: set[bytes] = set()
    for g in groups[:SOLVE_GROUPS]:
        st = g.state
        key = st.adv_key + st.carried.kl_key if with_kl else st.adv_key
        if key in seen:
            continue
        seen.add(key)
        yield st


DualClip = float | None


def loss_terms(
    s: Search, groups: list[Group[AdvState]], duals: Iterable[DualClip] | None = None
) -> Iterator[tuple[AdvState, DualClip, LossAgg, Tensor]]:
    """``(state, dual_clip, loss_agg, c)`` per state of :func:`distinct_states`, dual clip of
    ``duals`` (None: the checked setting's only) and aggregation of :class:`LossAgg`, in that
    nesting order; ``c`` = ``a_t·ℓ_t`` on the valid tokens (module docstring)."""
    t, m = s.t, s.m
    agg_w = agg_weights(s)
    for st in distinct_states(groups):
        q = {"logprobs": t["logprobs"], "old_logprobs": t["old_logprobs"], "advantages": st.adv, "mask": m}
        for dual in [s.base.conv.policy.dual_clip] if duals is None else list(duals):
            plain = s.evaluate("policy", q, s.setting(dual_clip=dual))["pg_per_token"][m].double()
            for agg_mode in MASK_AGGS:
                yield st, dual, agg_mode, agg_w(agg_mode, st.adv.dtype)[m].double() * plain


__all__ = ["distinct_states", "loss_terms"]
