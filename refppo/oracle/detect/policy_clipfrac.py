"""The logged clip fraction's options in the policy step of ``--detect``: ``clipfrac_agg`` and
``clipfrac_counts``.

Both change ``pg_clipfrac`` alone (no loss, no gradient). The members walked, per policy loss:
``token-mean`` with every :class:`ClipFracCounts` member and ``row-mean`` with ``all`` under
``vanilla`` (the convention refuses the other pairs: oat-llm 0.2.4 ``PPOLearner.learning_step`` logs
the mean of per-row means of every clipped token, vanilla only). A member is evaluated through the
policy stage only where the dump holds ``pg_clipfrac`` and the member can change it:
``row-mean``; ``kept`` under a rollout correction and ``by_advantage`` under ``cispo``
(:func:`refppo.pipeline.update.recounts`). Every other member has the core's token-mean
``c = Σ m·[ℓ2 > ℓ1] / Σ m`` by definition (the policy stage returns it unchanged): such members are
one function there, so only the first is walked (``kept`` is ``all`` without a correction, whatever
the dump holds: listing it would name a difference no dump can show). On a dump without
``pg_clipfrac`` the walked members merge into one class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from refppo.agg_conventions import ClipfracAgg, ClipFracCounts
from refppo.conventions import PolicyLoss
from refppo.oracle.check.settings import Setup
from refppo.oracle.detect.search import Search
from refppo.oracle.detect.states import AdvState, digest
from refppo.pipeline.update import recounts

CORE = (ClipfracAgg.TOKEN_MEAN.value, ClipFracCounts.ALL.value)
"""The members whose ``pg_clipfrac`` is the core's token-mean: what the policy step evaluates."""
MEMO_MAX = 16384
"""Evaluated clip fractions (scalars) memoised before the memo is cleared."""
Member = tuple[ClipfracAgg, ClipFracCounts]
ClipfracVariant = tuple[dict[str, Any], Tensor, tuple[dict[str, Any], ...]]
"""``(convention update, pg_clipfrac, class)``: one clip fraction option (:meth:`ClipfracWalk.variants`)."""


def members(loss: PolicyLoss, own: Member) -> list[Member]:
    """The ``(clipfrac_agg, clipfrac_counts)`` pairs walked under ``loss``, the checked ``own`` first
    (where the convention allows it: the first member of a merged class is the one listed first)."""
    out: list[Member] = [(ClipfracAgg.TOKEN_MEAN, c) for c in ClipFracCounts]
    if loss is PolicyLoss.VANILLA:
        out.append((ClipfracAgg.ROW_MEAN, ClipFracCounts.ALL))
    return sorted(out, key=lambda m: m != own)


class ClipfracWalk:
    """The clip fraction options of the policy step (module docstring), the evaluated ones memoised."""

    def __init__(self, s: Search, logprobs: Tensor) -> None:
        self.s, self.logprobs = s, logprobs
        self.shown = "pg_clipfrac" in s.t
        p = s.base.conv.policy
        self.own: Member = (p.clipfrac_agg, p.clipfrac_counts)
        self.memo: dict[tuple[Any, ...], Tensor] = {}

    def variants(
        self,
        st: AdvState,
        loss: PolicyLoss,
        clip: tuple[float, float | None],
        lrc: float | None,
        core: Tensor,
        pg_ok: Callable[[], bool],
    ) -> list[ClipfracVariant]:
        """One ``(update, pg_clipfrac, class)`` per distinct clip fraction of the members under the
        policy stage setting ``(loss, clip, lrc)`` on the advantages state ``st``, whose core
        token-mean clip fraction is ``core``: the update names the keys of the first such member
        (the checked one first) that differ from the checked setting's; the class names the other
        members with that value, in full. A member the policy stage must evaluate (its value is not
        the core's) other than the checked one is evaluated only where the checked one does not
        reproduce the dumped ``pg_clipfrac`` and ``pg_ok()`` (some aggregation of the option's loss
        reproduces ``pg_loss``, or it is not dumped), and kept only when it reproduces it exactly
        (a listed one must): each distinct clip fraction multiplies the step's options and each
        evaluation costs a policy stage."""
        out: list[tuple[dict[str, Any], Tensor, bytes]] = []
        classes: dict[bytes, list[dict[str, Any]]] = {}
        core_key = digest(core) if self.shown else b""
        own_v: Tensor | None = None
        core_seen = False
        for i, m in enumerate(members(loss, self.own)):
            if self._is_core(st, loss, clip, lrc, m):
                if core_seen:
                    continue  # the same function as a member already walked here: not a class member
                core_seen = True
            v = self._value(st, loss, clip, lrc, m, evaluate=False) if self.shown else None
            if v is not None:  # the policy stage must evaluate it
                if i > 0 and not self._others(own_v, core, pg_ok):
                    continue
                v = self._value(st, loss, clip, lrc, m, evaluate=True)
            if i == 0:
                own_v = v
            key = core_key if v is None else digest(v)
            full = {"clipfrac_agg": m[0].value, "clipfrac_counts": m[1].value}
            if key in classes:
                classes[key].append(full)
                continue
            classes[key] = []
            upd = {k: x for (k, x), o in zip(full.items(), self.own, strict=True) if x != o.value}
            value = core if v is None else v
            if i > 0 and self.shown and self.s.ratio("pg_clipfrac", value, None) != 0.0:
                continue  # another member's value that does not reproduce the dump
            out.append((upd, value, key))
        return [(upd, cf, tuple(classes[k])) for upd, cf, k in out]

    def _others(self, own_v: Tensor | None, core: Tensor, pg_ok: Callable[[], bool]) -> bool:
        """Whether the members other than the checked one are evaluated (:meth:`variants`)."""
        own = core if own_v is None else own_v
        return self.s.ratio("pg_clipfrac", own, None) != 0.0 and pg_ok()

    def _setting(
        self, loss: PolicyLoss, clip: tuple[float, float | None], lrc: float | None, m: Member
    ) -> Setup:
        """The policy stage's setting under member ``m``."""
        return self.s.setting(
            policy_loss=loss.value, dual_clip=None, log_ratio_clamp=lrc, cliprange=clip[0],
            cliprange_high=clip[1], clipfrac_agg=m[0].value, clipfrac_counts=m[1].value,
        )  # fmt: skip

    def _is_core(
        self, st: AdvState, loss: PolicyLoss, clip: tuple[float, float | None], lrc: float | None, m: Member
    ) -> bool:
        """Whether member ``m`` is the core's token-mean by definition here (``kept`` without a
        correction, ``by_advantage`` off ``cispo``): then it is the same function as every other such
        member, whatever the dump holds."""
        if m[0] is not ClipfracAgg.TOKEN_MEAN:
            return False
        return not recounts(self._setting(loss, clip, lrc, m).conv, st.is_weights)

    def _value(
        self,
        st: AdvState,
        loss: PolicyLoss,
        clip: tuple[float, float | None],
        lrc: float | None,
        m: Member,
        *,
        evaluate: bool,
    ) -> Tensor | None:
        """``pg_clipfrac`` under member ``m`` through the policy stage (``evaluate`` False: ``core``,
        a placeholder, where it must be evaluated); None where it is the core's."""
        s = self.s
        setting = self._setting(loss, clip, lrc, m)
        if m[0] is ClipfracAgg.TOKEN_MEAN and not recounts(setting.conv, st.is_weights):
            return None
        if not evaluate:
            return st.adv  # a placeholder: not None
        key = (st.adv_key, st.is_key, loss, clip, lrc, m)
        if key not in self.memo:
            if len(self.memo) >= MEMO_MAX:  # a cache: bounded, values recomputed
                self.memo.clear()
            q: dict[str, Tensor | None] = {"logprobs": self.logprobs, "old_logprobs": s.t["old_logprobs"]}
            q.update(advantages=st.adv, mask=s.m, is_weights=st.is_weights)
            self.memo[key] = s.evaluate("policy", q, setting)["pg_clipfrac"].detach()
        return self.memo[key]


__all__ = ["CORE", "ClipfracVariant", "ClipfracWalk", "members"]
