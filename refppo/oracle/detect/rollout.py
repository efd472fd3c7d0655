"""The rollout steps of the ``--detect`` walk: kl, token_rewards and advantages (the whitening).

======== ============================================== ===============================================
step     stages it evaluates, the keys it walks           solver (when nothing reproduces the dump)
======== ============================================== ===============================================
kl       kl: ``kl_estimator`` (every member), the peers'   the KL clamps read off the dumped ``kl``
         clamp bundles and the checked setting's           (:func:`refppo.oracle.detect.solve.read_kl_clamps`)
rewards  score_map, value_mask, rewards: ``kl_in``,        the score map ``(s + b)·k`` (and its clip)
         ``score_at`` (every member), ``score_clip``;      read off the score slots
         then reward_whitening: ``whiten_rewards`` (with   (:mod:`refppo.oracle.detect.solve_score`)
         ``whiten_variance`` and ``whiten_eps_at``, which
         the advantage whitening shares)
whiten   whitening: ``whiten_advantages``,                 (a fitted map, named)
         ``whiten_variance`` (and ``whiten_holes`` when
         the mask has holes); then ``whiten_eps_at``
======== ============================================== ===============================================

Each step first walks the checked setting's own value of the keys after "then" and adds the others
only when nothing reproduces it (or when the dump lacks the step's quantity, so nothing can be
checked there). Every value is the stage's own output (:meth:`Search.evaluate`). When nothing
reproduces ``returns`` or ``advantages``, the steps after it read the dump's own tensor
(:func:`carry_dumped`), so the policy and value conventions are still identified.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import replace
from itertools import product
from typing import Any

import torch
from torch import Tensor

import refppo.oracle.detect.groups as groups_mod
from refppo.conventions import (
    KLEstimator,
    KLPlacement,
    ScorePosition,
    ScoreSlotKL,
    Variance,
    WhitenEps,
    WhitenHoles,
    Whitening,
)
from refppo.errors import RefPPOError
from refppo.oracle.check.alternatives import CLAMP_BUNDLES
from refppo.oracle.detect.fit import fit_normalisation
from refppo.oracle.detect.groups import Deferrable, Group, Lazy, Option, lazy_option
from refppo.oracle.detect.reward_options import RawRewards, reward_key, shared_digest
from refppo.oracle.detect.search import Search, nearest_note
from refppo.oracle.detect.solve import read_kl_clamps
from refppo.oracle.detect.solve_score import (
    constant_score_notes,
    propose_score_map,
    solve_group_score_clip,
)
from refppo.oracle.detect.states import AdvState, Carried, KLState, ReturnsState, RewardState, digest
from refppo.pipeline.rollout import same_slots_as_after_last_valid

WhitenKey = tuple[str, str, str]
"""``(whiten_rewards, whiten_variance, whiten_eps_at)``."""


def kl_candidates(own: KLEstimator, has_grad: bool) -> tuple[KLEstimator, ...]:
    """The KL estimators the kl step tries: every member of :class:`KLEstimator`.

    A straight-through ``k3+`` has ``k3``'s value (only its gradient differs), so both give identical
    stage outputs and merge into one group; with ``grad_logprobs`` in the dump every estimator is kept
    and the pipeline re-check keeps whichever fits the gradient. Without gradients the pair is a genuine
    equivalence: one of them is kept, the base's own where it is one of the pair (else the plain one).
    """
    if has_grad:
        return tuple(KLEstimator)
    return tuple(e for e in KLEstimator if e == own or (not e.straight_through and e != own.base))


def kl_step(s: Search, groups: list[Group[Any]]) -> list[Group[KLState]]:
    """``kl``: the kl stage on the old log-probs for each estimator and clamp bundle; the same stage
    on the current log-probs (what the kl_loss stage reads) enters the merge digest only."""
    t, m = s.t, s.m
    clamp_opts = list(CLAMP_BUNDLES.values())
    own = {"kl_log_ratio_clamp": s.base.conv.kl.log_ratio_clamp, "kl_value_clamp": s.base.conv.kl.value_clamp}
    if own not in clamp_opts:
        clamp_opts.append(own)
    # without ref_logprobs (β = 0: nothing reads the KL) the stage gives None for every estimator,
    # so the options share one digest and the estimator stays open (not read)
    q_old = {"old_logprobs": t["old_logprobs"], "ref_logprobs": t.get("ref_logprobs"), "mask": m}
    q_cur = {**q_old, "old_logprobs": t["logprobs"]} if "logprobs" in t else None
    kl_values = kl_candidates(s.base.conv.kl.estimator, s.dump.has("grad_logprobs"))

    def make(
        extra: list[tuple[str, dict[str, Any]]] | None,
    ) -> Callable[[Group[Any]], Iterable[Option[KLState]]]:
        pairs = [(e.value, cl) for e in kl_values for cl in clamp_opts] + list(extra or [])

        def opts(g: Group[Any]) -> Iterable[Option[KLState]]:
            for est, cl in pairs:
                upd = {"kl_estimator": est, **cl}
                try:
                    st = s.setting(**upd)
                    kl_old = s.evaluate("kl", q_old, st)["kl"]
                    kl_cur = s.evaluate("kl", q_cur, st)["kl"] if q_cur is not None else None
                except RefPPOError:
                    continue
                key = digest(kl_old, kl_cur)
                yield upd, KLState(upd, kl_old, key), key

        return opts

    def propose(_: list[Group[Any]]) -> list[tuple[str, dict[str, Any]]]:
        if "kl" not in t or "ref_logprobs" not in t:
            return []
        tol = s.tol.of(float(t["kl"].abs().max()))
        out = []
        for est in kl_values:

            def estimate(old: Tensor, ref: Tensor, mask: Tensor, e: str = est.value) -> Tensor:
                q = {"old_logprobs": old, "ref_logprobs": ref, "mask": mask}
                kl: Tensor = s.evaluate(
                    "kl", q, s.setting(kl_estimator=e, kl_log_ratio_clamp=None, kl_value_clamp=None)
                )["kl"]
                return kl

            for b in read_kl_clamps(t["kl"], t["old_logprobs"], t["ref_logprobs"], m, estimate, tol):
                if b not in clamp_opts:
                    out.append((est.value, b))
                    s.propose_value("kl_log_ratio_clamp", b["kl_log_ratio_clamp"])
                    s.propose_value("kl_value_clamp", b["kl_value_clamp"])
        return out

    return s.stage(
        groups, make, lambda st: [None if st.kl is None else s.ratio("kl", st.kl, m)], "kl", propose
    )


def _whiten_reward_opts(s: Search, walk_all: bool) -> list[WhitenKey]:
    c = s.base.conv
    own: WhitenKey = (c.reward.whiten.value, c.norm.variance.value, c.norm.eps_at.value)
    if not walk_all:
        return [own]
    kinds = [w.value for w in Whitening if w is not Whitening.NONE]
    every = [(w, v.value, e.value) for w in kinds for v in Variance for e in WhitenEps]
    return list(dict.fromkeys([own, ("none", own[1], own[2]), *every]))


def _reward_options(
    s: Search, maps: list[tuple[float, float]], clips: list[float | None], wr_opts: list[WhitenKey]
) -> Callable[[Group[KLState]], Iterable[Deferrable[RewardState]]]:
    """The rewards step's walk: ``kl_in`` × ``score_at`` × score map × ``score_clip`` × reward
    whitening, each through the score_map, value_mask and rewards stages (:class:`Lazy` options:
    a replay makes only the one it rebuilds)."""
    t = s.t
    # kl_in=both differs from reward only by the KL loss: walked on a dump that logs a KL loss
    # (a trainer with the KL in the reward alone logs none; verl with both on logs its kl_loss)
    shows_loss = "logprobs" in t and "kl_loss" in t
    placements = [p for p in KLPlacement if p is not KLPlacement.BOTH or shows_loss]
    slots = [w for w in ScorePosition if not same_slots_as_after_last_valid(s.m, w)]  # one of two alike

    def opts(g: Group[KLState]) -> Iterable[Deferrable[RewardState]]:
        kl = g.state
        walk = product(placements, slots, maps, clips, list(ScoreSlotKL))
        for kl_in, score_at, (bias, scale), sc, slot in walk:
            if slot is ScoreSlotKL.KL and not _slot_kl_shows(s, kl, kl_in, score_at):
                continue
            base = {"kl_in": kl_in.value, "score_at": score_at.value, "score_clip": sc}
            base.update(score_bias=bias, score_scale=scale)
            if slot is ScoreSlotKL.KL:
                base["score_slot_kl"] = slot.value
            # the raw rewards of this (kl_in, score_at, map, clip, slot), made once when the first
            # of its whitening options is read (a replay reads some of them, or none)
            args = (s, kl, kl_in, score_at, (bias, scale, sc), slot)
            raw = RawRewards(*args)
            for wr, var, eps_at in wr_opts:
                upd: dict[str, Any] = {**base, "whiten_rewards": wr}
                if wr != "none":  # the advantage whitening shares the two keys
                    upd.update(whiten_variance=var, whiten_eps_at=eps_at)
                own = raw if groups_mod.LAZY else RawRewards(*args)  # off: nothing shared, as before
                yield lazy_option(upd, Lazy(own.whitened(wr, var, eps_at), reward_key))

    return opts


def _slot_kl_shows(s: Search, kl: KLState, kl_in: KLPlacement, score_at: ScorePosition) -> bool:
    """``score_slot_kl=kl`` can change the rewards: the KL is in the reward with β > 0, the slot is
    outside the mask and the dump has the reference log-probs."""
    outside = score_at is not ScorePosition.LAST_VALID
    return kl_in.in_reward and s.hp.kl_coef > 0 and outside and kl.kl is not None


def reward_step(s: Search, groups: list[Group[KLState]]) -> list[Group[RewardState]]:
    """``token_rewards``: KL placement, score slot, score clip and map, reward whitening."""
    t = s.t
    ex = s.base.conv.score
    clip_opts: list[float | None] = list(dict.fromkeys([None, 5.0, 10.0, ex.clip]))
    checkable = "token_rewards" in t
    extra_maps: list[tuple[float, float]] = []
    if not checkable:  # a group estimator's dump: the clip read off ``returns`` (scale cancels in σ)
        for k, c in solve_group_score_clip(s, groups):
            s.propose_value("score_clip", c)
            clip_opts.append(c)
            extra_maps.append((ex.bias, k))

    def make(
        extra: list[tuple[float, float]] | None,
    ) -> Callable[[Group[KLState]], Iterable[Deferrable[RewardState]]]:
        """``extra``: None on the first walk, then the solved score maps (maybe none)."""
        maps = list(dict.fromkeys([(ex.bias, ex.scale), *extra_maps, *(extra or [])]))
        wr_opts = _whiten_reward_opts(s, walk_all=extra is not None or not checkable)
        return _reward_options(s, maps, list(clip_opts), wr_opts)  # a replay walks the same options

    solved: list[tuple[float, float]] = []

    def propose(gs: list[Group[KLState]]) -> list[tuple[float, float]]:
        solved.extend(propose_score_map(s, gs, clip_opts))  # a solved score clip joins clip_opts
        # an empty proposal still walks the reward whitening: return a list that is truthy
        return solved or [(ex.bias, ex.scale)]

    out = s.stage(
        groups, make, lambda st: [s.ratio("token_rewards", st.rewards, st.vm)], "token_rewards", propose
    )
    if solved and float(t["scores"].max() - t["scores"].min()) == 0.0:
        s.notes += constant_score_notes(s, out)
    if "token_rewards" in s.unmatched and out:
        st = out[0].state
        tol = s.tol.of(float(t["token_rewards"].abs().max()))
        fit = fit_normalisation("token_rewards", t["token_rewards"], st.rewards, st.vm, tol)
        s.fitted.append(fit.text + nearest_note(out[0].convs))
    return out


def with_raw_advantages(
    g: Group[RewardState] | RewardState,
    upd: dict[str, Any],
    adv_raw: Tensor,
    ret: Tensor,
    ret_key: bytes | None = None,
) -> Option[ReturnsState]:
    """The option of the returns step (GAE or a critic-free estimator) of the rewards group ``g``
    (or its state): its raw advantages and returns (``ret_key``: their digest with the value mask,
    when the caller has it)."""
    rs = g.state if isinstance(g, Group) else g
    ret_key = digest(ret, shared_digest(rs.vm)) if ret_key is None else ret_key
    kl_in = rs.kl_in
    carried = Carried(rs.kl.key, rs.kl.setting, kl_in, rs.vm, ret, ret_key)
    key = digest(rs.kl.key, kl_in.value, ret_key, adv_raw, rs.fixed_whiten)
    return upd, ReturnsState(carried, adv_raw, rs.fixed_whiten), key


def _whiten_options(
    s: Search, eps_ats: list[str], holes: list[str | None]
) -> Callable[[Group[ReturnsState]], Iterable[Option[AdvState]]]:
    c, m = s.base.conv, s.m

    def opts(g: Group[ReturnsState]) -> Iterable[Option[AdvState]]:
        rs = g.state
        # a replayed group read the earlier steps' dumped inputs again: only these two are read here
        s.dump.release_except(("advantages", "response_mask"))
        fixed = rs.fixed_whiten
        for w, wh in product(Whitening, holes):
            for v in Variance:
                for e in eps_ats if fixed is None else [fixed[1]]:
                    if fixed is not None and v.value != fixed[0]:
                        continue
                    if (
                        w is Whitening.NONE
                        and (v is not c.norm.variance or e != eps_ats[0])
                        and fixed is None
                    ):
                        continue  # unwhitened advantages do not depend on the two keys
                    upd = {"whiten_advantages": w.value, "whiten_variance": v.value, "whiten_eps_at": e}
                    if wh is not None:
                        upd["whiten_holes"] = wh
                    try:
                        q = {"advantages_raw": rs.adv_raw, "mask": m}
                        adv = s.evaluate("whitening", q, s.setting(**upd))["advantages"]
                    except RefPPOError:
                        continue
                    adv_key = digest(adv)
                    ca = rs.carried
                    key = digest(ca.kl_key, ca.kl_in.value, ca.ret_key, adv_key, fixed)
                    yield upd, AdvState(ca, rs.adv_raw, adv, adv_key), key

    return opts


def whiten_step(s: Search, groups: list[Group[ReturnsState]]) -> list[Group[AdvState]]:
    """``advantages``: the advantage whitening, its variance and where its eps sits."""
    t, m = s.t, s.m
    c = s.base.conv
    # the whitening stage takes the envelope under whiten_holes=include: only holes tell them apart
    holes: list[str | None] = [h.value for h in WhitenHoles] if s.holes else [None]

    def make(extra: bool | None) -> Callable[[Group[ReturnsState]], Iterable[Option[AdvState]]]:
        eps_ats = [c.norm.eps_at.value]
        if extra is not None or "advantages" not in t:
            eps_ats = list(dict.fromkeys([*eps_ats, *(e.value for e in WhitenEps)]))
        return _whiten_options(s, eps_ats, holes)

    out = s.stage(groups, make, lambda st: [s.ratio("advantages", st.adv, m)], "advantages", lambda _: True)
    if "advantages" in s.unmatched and out:
        st = out[0].state
        tol = s.tol.of(float(t["advantages"].abs().max()))
        assert st.adv_raw is not None  # held until the policy step
        fit = fit_normalisation("advantages", t["advantages"], st.adv_raw, m, tol, s.hp.whiten_eps)
        s.fitted.append(fit.text + nearest_note(out[0].convs))
        carry_dumped_advantages(out, t["advantages"], m)
    return out


def carry_dumped_returns(groups: list[Group[ReturnsState]], dumped: Tensor) -> None:
    """After a returns step nothing reproduces, the later steps read the dump's own returns (on each
    group's value mask, where the step compares them): the loss conventions can then still be
    identified (the nearest convention names them); the step stays unmatched, so nothing is
    reported as detected.

    Groups on equal value masks share one copy (``made``: the copy while any state holds it, keyed
    by the mask's digest): a replayed group's read does not make another ``[B, T]`` tensor next to
    the ones the other groups' states hold (the whitening step's peak on the mismatching dump)."""
    zero = torch.zeros((), dtype=dumped.dtype)
    made: weakref.WeakValueDictionary[bytes, Tensor] = weakref.WeakValueDictionary()

    def given(st: ReturnsState) -> ReturnsState:
        ca = st.carried
        vm_key = shared_digest(ca.vm)
        ret = made.get(vm_key)
        if ret is None:
            ret = torch.where(ca.vm, dumped, zero)
            made[vm_key] = ret
        return replace(st, carried=replace(ca, returns=ret))

    for g in groups:
        g.patch(given)


def carry_dumped_advantages(groups: list[Group[AdvState]], dumped: Tensor, mask: Tensor) -> None:
    """:func:`carry_dumped_returns` for the advantages (on the response mask)."""
    adv = torch.where(mask, dumped, torch.zeros((), dtype=dumped.dtype))
    key = digest(adv)
    for g in groups:
        g.patch(lambda st: replace(st, adv=adv, adv_key=key))


__all__ = [
    "carry_dumped_advantages",
    "carry_dumped_returns",
    "kl_candidates",
    "kl_step",
    "reward_step",
    "whiten_step",
    "with_raw_advantages",
]
