"""The policy step's solver (``--detect``): clip ranges and the dual-clip constant read off ``pg_loss``.

Under a policy loss ``P`` (:class:`refppo.conventions.PolicyLoss`) the per-token loss is
``ℓ_t = max(−A_t·r_t, −A_t·clip(r_t, 1 − ε_low, 1 + ε_high))`` with ``r_t`` the policy stage's
``ratio`` (``vanilla``: the token ratio ``ρ_t`` after the log-ratio clamp; ``gspo``: the row's
sequence ratio ``s_b`` on each of its tokens) and, under ``vanilla`` only, ``min(ℓ_t, c·|A_t|)``
where ``A_t < 0`` (the dual clip ``c``). ``pg_loss = Σ_t w_t·ℓ_t`` with ``w = ∂pg_loss/∂ℓ`` of the
policy_agg stage (``[B, T]``): a hinge sum in each constant, solved exactly by
:mod:`refppo.oracle.detect.solve`. The ratio, ``ℓ`` and ``w`` are stage outputs; a proposal is
walked through the stages like any named value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from refppo.agg_conventions import MASK_AGGS
from refppo.conventions import LossAgg, PolicyLoss
from refppo.oracle.check.settings import Setup
from refppo.oracle.detect.grad_solve import propose_policy_grad
from refppo.oracle.detect.groups import Group
from refppo.oracle.detect.search import SOLVE_GROUPS, Search
from refppo.oracle.detect.solve import (
    PolicyTerms,
    clipfrac_of,
    loss_weights,
    nice,
    solve_clip_ranges,
    solve_dual_clip,
)
from refppo.oracle.detect.states import AdvState
from refppo.pipeline.blocks import Evaluation, Normalisers

Clip = tuple[float, float | None]
GSPO_LOG_RATIO_MAX = 10.0
"""κ, the upper clamp of GSPO's log sequence ratio that verl 0.9.1 hard-codes
(``verl/trainer/ppo/core_algos.py::compute_policy_loss_gspo``:
``torch.clamp(log_seq_importance_ratio, max=10.0)``; validated by ``tools/peers gspo``)."""
VANILLA_LOG_RATIO_CLAMP = 20.0
"""verl 0.9.1 / OpenRLHF 0.11.2's clamp of the token log-ratio
(:data:`refppo.oracle.check.alternatives.NAMED`)."""


def log_ratio_clamps(loss: PolicyLoss, own: float | None) -> list[float | None]:
    """The ``log_ratio_clamp`` values walked under ``loss``: none, the peers' (verl's κ = 10 for
    ``gspo``, 20 for ``vanilla``) and the checked setting's ``own``."""
    named = GSPO_LOG_RATIO_MAX if loss is PolicyLoss.GSPO else VANILLA_LOG_RATIO_CLAMP
    return list(dict.fromkeys([None, named, own]))


def propose_policy(
    s: Search, groups: list[Group[AdvState]], losses: list[PolicyLoss]
) -> dict[str, list[Any]]:
    """Dual-clip constants and clip ranges under which ``pg_loss`` is reproduced, and the policy
    losses ``losses`` to walk with them (``{"losses": …}`` even when nothing is solved: the second
    walk tries every policy loss).

    Solved per advantage variant (the first :data:`SOLVE_GROUPS` groups), per policy loss, per
    aggregation mode and per log-ratio clamp, on the policy stage's ratio and per-token loss without
    a dual clip and the policy_agg stage's weights; clip-range pairs must also give the dump's
    ``pg_clipfrac``. Without ``pg_loss``, read off ``grad_logprobs`` where the dump has it
    (:func:`refppo.oracle.detect.grad_solve.propose_policy_grad`).
    """
    t, m, hp = s.t, s.m, s.hp
    out: dict[str, list[Any]] = {"losses": list(losses)}
    if "logprobs" in t and "pg_loss" not in t:  # a v2 dump without the scalar: the gradient's
        return propose_policy_grad(s, groups, losses)
    if "pg_loss" not in t or "logprobs" not in t:
        return out
    target = float(t["pg_loss"])
    duals: list[float] = []
    clips: list[Clip] = []
    seen_adv: set[bytes] = set()  # by content: a replayed state's tensors are new objects
    with_ratio = replace(s.ev, keep_ratio=True)
    weight = agg_weights(s)
    own_lrc = s.base.conv.policy.log_ratio_clamp
    for g in groups[:SOLVE_GROUPS]:
        st = g.state
        if st.adv_key + st.is_key in seen_adv:
            continue
        seen_adv.add(st.adv_key + st.is_key)
        is_w = None if st.is_weights is None else st.is_weights[m].double()
        q = {"logprobs": t["logprobs"], "old_logprobs": t["old_logprobs"], "advantages": st.adv, "mask": m}
        for loss in losses:
            # the vanilla order (none, own, 20) as before; gspo: none, own, verl's κ
            lrcs = list(dict.fromkeys([None, own_lrc, *log_ratio_clamps(loss, own_lrc)]))
            for lrc in lrcs:
                st_p = s.setting(policy_loss=loss.value, dual_clip=None, log_ratio_clamp=lrc)
                res = s.evaluate("policy", q, st_p, with_ratio)
                ratio, plain = res["ratio"], res["pg_per_token"][m]
                for agg in MASK_AGGS:
                    w = weight(agg, st.adv.dtype)[m].double()
                    w = w if is_w is None else w * is_w  # the correction's w' scales each ℓ_t
                    terms = PolicyTerms(st.adv[m].double(), ratio[m].double(), w)
                    _solve_on(s, terms, plain, target, duals, clips, loss is PolicyLoss.VANILLA)
    duals = [d for d in dict.fromkeys(duals) if d > 1.0][:8]
    base_clip = (hp.cliprange, hp.cliprange_high)
    clips = [c for c in dict.fromkeys(clips) if c != base_clip][:8]
    for dc in duals:
        s.propose_value("dual_clip", dc)
    for lo_c, hi_c in clips:
        s.propose_value("cliprange", lo_c)
        s.propose_value("cliprange_high", hi_c)
    return {**out, "duals": duals, "clips": clips}


def agg_weights(s: Search) -> Callable[[LossAgg, torch.dtype], Tensor]:
    """``(agg, dtype) ↦ ∂pg_loss/∂ℓ`` of the policy_agg stage under ``agg`` (``[B, T]``), with
    autograd (no row blocks), memoised."""
    weights: dict[tuple[LossAgg, torch.dtype], Tensor] = {}

    def weight(agg: LossAgg, dtype: torch.dtype) -> Tensor:
        if (agg, dtype) not in weights:
            st = s.setting(loss_agg=agg.value)

            def fn(x: Tensor, st: Setup = st) -> Tensor:
                out: Tensor = s.evaluate(
                    "policy_agg",
                    {"pg_per_token": x, "mask": s.m},
                    st,
                    Evaluation(norm=Normalisers(seq_count=s.ev.norm.seq_count)),
                )["pg_loss"]
                return out

            weights[(agg, dtype)] = loss_weights(fn, s.m, dtype)
        return weights[(agg, dtype)]

    return weight


def _solve_on(
    s: Search,
    terms: PolicyTerms,
    plain: Tensor,
    target: float,
    duals: list[float],
    clips: list[Clip],
    dual_clip: bool,
) -> None:
    """Appends the dual-clip constants ``c`` (when ``dual_clip``: the vanilla loss) and the clip-range
    pairs ``(lo, hi)`` (those giving the dump's ``pg_clipfrac`` too) that reproduce ``target`` on
    ``terms``, rounded by :func:`nice`."""
    hp = s.hp
    if dual_clip:
        for c in solve_dual_clip(terms, plain, target):
            duals += nice(c)
    own = s.base.conv.policy.dual_clip if dual_clip else None
    for dual in dict.fromkeys([own, None]):
        known = tuple(dict.fromkeys([hp.cliprange, hp.clip_high]))
        for lo, hi in solve_clip_ranges(terms, target, dual=dual, known=known):
            if not _clipfrac_ok(s, terms, lo, hi):
                continue
            lo_n, hi_n = nice(lo)[0], nice(hi)[0]
            if 0.0 <= lo_n < 1.0:
                clips.append((lo_n, None if hi_n == lo_n else hi_n))


def _clipfrac_ok(s: Search, terms: PolicyTerms, lo: float, hi: float) -> bool:
    if "pg_clipfrac" not in s.t:
        return True
    got = float(s.t["pg_clipfrac"])
    # ties at the boundary and rounding of a float32 trainer: a few tokens either way
    slack = s.tol.of(abs(got)) + 4.0 / max(terms.adv.numel(), 1)
    return abs(clipfrac_of(terms, lo, hi) - got) <= slack + s.tol.rtol


__all__ = [
    "GSPO_LOG_RATIO_MAX",
    "VANILLA_LOG_RATIO_CLAMP",
    "log_ratio_clamps",
    "propose_policy",
]
