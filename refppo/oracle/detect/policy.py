"""The policy step of ``--detect``: the policy, policy_agg, approx_kl, entropy and kl_loss stages.

Walks ``dual_clip`` (none / verl's ``c = 3`` / the checked setting's), ``log_ratio_clamp`` (none /
20 / the checked setting's), every :class:`LossAgg` member as ``loss_agg``, every :class:`ApproxKL`
member, ``entropy_agg`` (like ``loss_agg``, or any other mode when the dump holds ``entropy_loss``)
and the checked clip ranges. When none reproduces ``pg_loss`` and ``pg_clipfrac``,
:func:`propose_policy` solves the dual-clip constant and the clip ranges from the data and the step is
walked again with them.

The per-token loss is made once per ``(advantages, clip ranges, dual clip, clamp)`` by the policy
stage and aggregated under every mode by the policy_agg stage; a clamp that binds on no token, or a
dual clip that caps no token, leaves the stage's output as it is without them, so the walk reuses
that evaluation (:func:`_dual_caps`; the clamp: ``max|l − l^old|`` over the valid tokens).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from refppo.conventions import ApproxKL, KLPlacement, LossAgg, PolicyLoss
from refppo.oracle.check.settings import Setup
from refppo.oracle.check.ties import pg_tie_share
from refppo.oracle.detect.groups import Group, Option
from refppo.oracle.detect.search import SOLVE_GROUPS, Search
from refppo.oracle.detect.solve import (
    PolicyTerms,
    clipfrac_of,
    loss_weights,
    nice,
    solve_clip_ranges,
    solve_dual_clip,
)
from refppo.oracle.detect.states import AdvState, PolicyState, digest
from refppo.pipeline.blocks import Evaluation

MEMO_MAX = 16384
"""Entries of the policy step's per-advantages loss memo (scalars) before it is cleared."""
Clip = tuple[float, float | None]


def row_slices(B: int, rows: int) -> Iterator[slice]:
    """Blocks of ``rows`` rows covering ``0 … B−1``."""
    for i in range(0, B, rows):
        yield slice(i, min(i + rows, B))


def max_abs_log_ratio(rows: int, logp: Tensor, logp_old: Tensor, m: Tensor) -> float:
    """``max |l − l^old|`` over the valid tokens, by blocks of ``rows`` rows (no ``[B, T]``
    temporary): a ``log_ratio_clamp`` κ at or above it binds on no token."""
    zero = torch.zeros((), dtype=logp.dtype)
    return max(
        float(torch.where(m[r], logp[r] - logp_old[r], zero).abs().max())
        for r in row_slices(m.shape[0], rows)
    )


def _dual_caps(rows: int, per_token: Tensor, adv: Tensor, m: Tensor, dual: float) -> bool:
    """Whether the policy stage's dual clip ``c`` caps some token of the loss ``per_token`` made
    without it: its cap is ``ℓ ≤ −c·A`` on the valid tokens with ``A < 0``; where no ``ℓ`` exceeds it
    the stage's output under ``c`` is the one without, bit for bit. By blocks of ``rows`` rows."""
    for r in row_slices(m.shape[0], rows):
        neg = -adv[r]
        if bool((m[r] & (neg > 0) & (per_token[r] > neg * dual)).any()):
            return True
    return False


class _Aggregated:
    """A policy stage's output without its ``[B, T]`` tensors: ``pg_loss`` under each aggregation."""

    def __init__(self, pg: dict[str, Tensor], clipfrac: Tensor, approx_kl: Tensor) -> None:
        self.pg, self.clipfrac, self.approx_kl = pg, clipfrac, approx_kl


class _PolicyEval:
    """The policy step's evaluations through the stages, memoised by what determines each."""

    def __init__(self, s: Search) -> None:
        self.s = s
        t, m = s.t, s.m
        self.has_lp = "logprobs" in t
        self.logprobs = t.get("logprobs", t["old_logprobs"])
        self.block = m.shape[0] if s.ev.rows is None else s.ev.rows
        self.vanilla = s.base.conv.policy.loss is PolicyLoss.VANILLA
        self.max_abs_d = max_abs_log_ratio(self.block, self.logprobs, t["old_logprobs"], m)
        self.ev_tok = s.ev_counts(m)
        q_ent = {"entropy": t.get("entropy"), "mask": m, "logprobs": self.logprobs}
        # entropy_agg None reads loss_agg: each mode's entropy term once, under entropy_agg = loss_agg
        self.ent: dict[str, Tensor] = {}
        if t.get("entropy") is not None:
            for a in LossAgg:
                st = s.setting(loss_agg=a.value, entropy_agg=None)
                self.ent[a.value] = s.evaluate("entropy", q_ent, st, self.ev_tok)["entropy_loss"]
        self.kll: dict[tuple[bytes, str | None, str], Tensor] = {}
        self.akl: dict[tuple[str, float], Tensor] = {}
        self.acts: dict[tuple[Any, ...], bool] = {}
        self.computed: dict[tuple[Any, ...], _Aggregated] = {}

    def effective(
        self, adv: Tensor, adv_key: bytes, clip: Clip, dual: float | None, lrc: float | None
    ) -> tuple[float | None, float | None]:
        """``(dual, clamp)`` that give the stage's output under ``(dual, lrc)``: a clamp that binds
        on no token, or a dual clip that caps no token, is left out (the same output bit for bit)."""
        if not self.vanilla:
            return dual, lrc
        eff_lrc = lrc if (lrc is not None and self.max_abs_d > lrc) else None
        lo, hi = clip
        if dual is not None and dual > 1.0 + (hi if hi is not None else lo):
            dk = (adv_key, clip, dual, eff_lrc)
            if dk not in self.acts:  # made with the loss without a dual clip (:meth:`entry`)
                self.entry(adv, adv_key, clip, None, eff_lrc, (dual,), force=True)
            if not self.acts[dk]:
                return None, eff_lrc
        return dual, eff_lrc

    def entry(
        self,
        adv: Tensor,
        adv_key: bytes,
        clip: Clip,
        dual: float | None,
        lrc: float | None,
        duals: tuple[float, ...] = (),
        *,
        force: bool = False,
    ) -> _Aggregated:
        """The policy stage's loss under ``(clip, dual, lrc)``, aggregated by the policy_agg stage
        under every mode (memoised: scalars only); made without a dual clip, it also records which
        of ``duals`` would cap a token (:func:`_dual_caps`)."""
        ck = (adv_key, clip, dual, lrc)
        hit = self.computed.get(ck)
        if hit is not None and not force:
            return hit
        s = self.s
        q: dict[str, Tensor | None] = {"logprobs": self.logprobs, "old_logprobs": s.t["old_logprobs"]}
        q.update(advantages=adv, mask=s.m, is_weights=s.is_weights)  # w': the checked setting's
        st = s.setting(dual_clip=dual, log_ratio_clamp=lrc, cliprange=clip[0], cliprange_high=clip[1])
        out = s.evaluate("policy", q, st)
        if dual is None and self.vanilla:
            for d in duals:
                self.acts[(adv_key, clip, d, lrc)] = _dual_caps(self.block, out["pg_per_token"], adv, s.m, d)
        qa = {"pg_per_token": out["pg_per_token"], "mask": s.m}
        pg = {
            a.value: s.evaluate("policy_agg", qa, s.setting(loss_agg=a.value), self.ev_tok)[
                "pg_loss"
            ].detach()
            for a in LossAgg
        }
        agg = _Aggregated(pg, out["pg_clipfrac"], out["pg_approx_kl"])
        del out, qa
        if hit is None:
            if len(self.computed) >= MEMO_MAX:  # a cache: bounded, values recomputed
                self.computed.clear()
            self.computed[ck] = agg
        return agg

    def approx_kl(self, ak: str, k1: Tensor) -> Tensor:
        """The approx_kl stage under metric ``ak`` on the policy stage's masked ``mean(l^old − l)``
        ``k1`` (memoised by its value: every policy loss of the walk has the same)."""
        key = (ak, float(k1))
        if key not in self.akl:
            s = self.s
            q = {
                "pg_approx_kl": k1,
                "logprobs": self.logprobs,
                "old_logprobs": s.t["old_logprobs"],
                "mask": s.m,
            }
            self.akl[key] = s.evaluate("approx_kl", q, s.setting(approx_kl=ak))["approx_kl"]
        return self.akl[key]

    def kl_loss(self, st: AdvState, agg: str) -> Tensor | None:
        """The kl_loss stage under ``kl_in=loss`` with the group's KL keys and ``loss_agg = agg``
        (``kl_loss_agg`` None); None unless the KL is in the loss and the dump has current log-probs."""
        ca = st.carried
        if ca.kl_in is not KLPlacement.LOSS or not self.has_lp:
            return None
        return self.kl_loss_as(ca.kl_key, ca.kl_setting, agg, None)

    def kl_loss_as(self, kl_key: bytes, kl_setting: Any, agg: str, kagg: str | None) -> Tensor:
        """:func:`kl_loss_stage` memoised by the KL's digest ``kl_key``."""
        key = (kl_key, kagg, agg)
        if key not in self.kll:
            self.kll[key] = kl_loss_stage(self.s, kl_setting, agg, kagg)
        return self.kll[key]


def kl_loss_stage(s: Search, kl_setting: Any, agg: str, kagg: str | None) -> Tensor:
    """The kl_loss stage under ``kl_in=loss``, the KL keys ``kl_setting``, ``loss_agg = agg`` and
    ``kl_loss_agg = kagg``, on the current log-probs."""
    q = {"logprobs": s.t["logprobs"], "ref_logprobs": s.t["ref_logprobs"], "mask": s.m}
    st = s.setting(**kl_setting, kl_in="loss", loss_agg=agg, kl_loss_agg=kagg)
    out: Tensor = s.evaluate("kl_loss", q, st, s.ev_counts(s.m))["kl_loss"]
    return out


def _policy_options(
    pe: _PolicyEval, clips: list[Clip], duals: list[float | None], lrcs: list[float | None]
) -> Callable[[Group[AdvState]], Iterable[Option[PolicyState]]]:
    s = pe.s
    base_clip = (s.hp.cliprange, s.hp.cliprange_high)
    own_eagg: dict[str, Any] = {} if s.base.conv.agg.entropy is None else {"entropy_agg": None}
    tests = tuple(d for d in duals if d is not None)
    ents_all = "entropy_loss" in s.t

    def opts(g: Group[AdvState]) -> Iterable[Option[PolicyState]]:
        st = g.state
        for clip, dual, lrc in itertools.product(clips, duals, lrcs):
            if dual is not None and not pe.vanilla:
                continue  # GSPO has no dual clip (the policy group refuses it)
            eff_dual, eff_lrc = pe.effective(st.adv, st.adv_key, clip, dual, lrc)
            out = pe.entry(st.adv, st.adv_key, clip, eff_dual, eff_lrc, tests)
            upd_clip = {} if clip == base_clip else {"cliprange": clip[0], "cliprange_high": clip[1]}
            setting = {
                "dual_clip": eff_dual,
                "log_ratio_clamp": eff_lrc,
                "cliprange": clip[0],
                "cliprange_high": clip[1],
            }
            for agg in LossAgg:
                a = agg.value
                ents: list[tuple[dict[str, Any], Tensor | None]] = [(own_eagg, pe.ent.get(a))]
                if ents_all:  # SkyRL's entropy is token-mean whatever loss_agg (skyrl_train ppo_utils)
                    ents += [({"entropy_agg": e}, v) for e, v in pe.ent.items() if e != a]
                kll = pe.kl_loss(st, a)
                for (eupd, ent), ak in itertools.product(ents, ApproxKL):
                    akl = pe.approx_kl(ak.value, out.approx_kl)
                    ps = PolicyState(
                        st.carried, st.adv, st.adv_key, setting, agg, out.pg[a], out.clipfrac, akl, ent, kll
                    )
                    key = digest(st.carried.ret_key, out.pg[a], out.clipfrac, akl, ent, kll, a)
                    upd = {"dual_clip": dual, "log_ratio_clamp": lrc, "loss_agg": a, "approx_kl": ak.value}
                    yield {**upd, **eupd, **upd_clip}, ps, key

    return opts


def _widen(s: Search, st: PolicyState, cache: dict[Any, float]) -> Callable[[], float]:
    """The tie-widening of ``pg_clipfrac`` for a policy state (cached per advantages, clamp, clips)."""
    t, m = s.t, s.m

    def widen() -> float:
        cfg = st.setting
        ck = (st.adv_key, cfg["log_ratio_clamp"], cfg["cliprange"], cfg["cliprange_high"])
        if ck not in cache:
            setup = s.setting(
                log_ratio_clamp=cfg["log_ratio_clamp"],
                cliprange=cfg["cliprange"],
                cliprange_high=cfg["cliprange_high"],
            )
            cache[ck] = float(pg_tie_share(t["logprobs"], t["old_logprobs"], st.adv, m, setup, s.tol.rtol))
        return cache[ck]

    return widen


def policy_step(s: Search, groups: list[Group[AdvState]]) -> list[Group[PolicyState]]:
    """``pg_loss``, ``pg_clipfrac``, ``approx_kl``, ``entropy_loss``: dual clip, clamp, aggregation."""
    pe = _PolicyEval(s)
    c = s.base.conv.policy
    base_duals: list[float | None] = list(dict.fromkeys([None, 3.0, c.dual_clip]))
    lrcs: list[float | None] = list(dict.fromkeys([None, 20.0, c.log_ratio_clamp]))
    base_clip = (s.hp.cliprange, s.hp.cliprange_high)
    widen_cache: dict[Any, float] = {}

    def make(
        extra: dict[str, list[Any]] | None,
    ) -> Callable[[Group[AdvState]], Iterable[Option[PolicyState]]]:
        duals = list(dict.fromkeys(base_duals + list((extra or {}).get("duals", []))))
        clips = [base_clip, *(extra or {}).get("clips", [])]
        return _policy_options(pe, clips, duals, lrcs)

    def checks(st: PolicyState) -> list[float | None]:
        if not pe.has_lp:
            return []
        pg_r = s.ratio("pg_loss", st.pg_loss, None)
        out = [pg_r]
        # only a candidate whose pg_loss matches needs the (costlier) tie-widened clipfrac check
        widen = _widen(s, st, widen_cache) if pg_r is None or pg_r == 0.0 else None
        out.append(s.ratio("pg_clipfrac", st.pg_clipfrac, None, widen))
        out.append(s.ratio("approx_kl", st.approx_kl, None))
        if st.entropy_loss is not None:
            out.append(s.ratio("entropy_loss", st.entropy_loss, None))
        return out

    return s.stage(groups, make, checks, "policy", (lambda gs: propose_policy(s, gs)) if pe.has_lp else None)


def propose_policy(s: Search, groups: list[Group[AdvState]]) -> dict[str, list[Any]]:
    """Dual-clip constants and clip ranges under which ``pg_loss`` is reproduced.

    Solved per advantage variant (the first :data:`SOLVE_GROUPS` groups), per aggregation mode and
    per log-ratio clamp, on the policy stage's ratio and per-token loss without a dual clip and the
    policy_agg stage's weights; clip-range pairs must also give the dump's ``pg_clipfrac``.
    """
    t, m, hp = s.t, s.m, s.hp
    if "pg_loss" not in t or "logprobs" not in t:
        return {}
    target = float(t["pg_loss"])
    duals: list[float] = []
    clips: list[Clip] = []
    lrcs = list(dict.fromkeys([None, s.base.conv.policy.log_ratio_clamp, 20.0]))
    seen_adv: set[bytes] = set()  # by content: a replayed state's tensors are new objects
    with_ratio = replace(s.ev, keep_ratio=True)
    weight = _agg_weights(s)
    for g in groups[:SOLVE_GROUPS]:
        st = g.state
        if st.adv_key in seen_adv:
            continue
        seen_adv.add(st.adv_key)
        for lrc in lrcs:
            q = {
                "logprobs": t["logprobs"],
                "old_logprobs": t["old_logprobs"],
                "advantages": st.adv,
                "mask": m,
            }
            out = s.evaluate("policy", q, s.setting(dual_clip=None, log_ratio_clamp=lrc), with_ratio)
            ratio, plain = out["ratio"], out["pg_per_token"][m]
            for agg in LossAgg:
                terms = PolicyTerms(
                    st.adv[m].double(), ratio[m].double(), weight(agg, st.adv.dtype)[m].double()
                )
                _solve_on(s, terms, plain, target, duals, clips)
    duals = [d for d in dict.fromkeys(duals) if d > 1.0][:8]
    base_clip = (hp.cliprange, hp.cliprange_high)
    clips = [c for c in dict.fromkeys(clips) if c != base_clip][:8]
    for dc in duals:
        s.propose_value("dual_clip", dc)
    for lo_c, hi_c in clips:
        s.propose_value("cliprange", lo_c)
        s.propose_value("cliprange_high", hi_c)
    return {"duals": duals, "clips": clips} if (duals or clips) else {}


def _agg_weights(s: Search) -> Callable[[LossAgg, torch.dtype], Tensor]:
    """``(agg, dtype) ↦ ∂pg_loss/∂ℓ`` of the policy_agg stage under ``agg`` (``[B, T]``), with
    autograd (no row blocks), memoised."""
    weights: dict[tuple[LossAgg, torch.dtype], Tensor] = {}

    def weight(agg: LossAgg, dtype: torch.dtype) -> Tensor:
        if (agg, dtype) not in weights:
            st = s.setting(loss_agg=agg.value)

            def fn(x: Tensor, st: Setup = st) -> Tensor:
                out: Tensor = s.evaluate("policy_agg", {"pg_per_token": x, "mask": s.m}, st, Evaluation())[
                    "pg_loss"
                ]
                return out

            weights[(agg, dtype)] = loss_weights(fn, s.m, dtype)
        return weights[(agg, dtype)]

    return weight


def _solve_on(
    s: Search, terms: PolicyTerms, plain: Tensor, target: float, duals: list[float], clips: list[Clip]
) -> None:
    """Appends the dual-clip constants ``c`` and the clip-range pairs ``(lo, hi)`` (those giving the
    dump's ``pg_clipfrac`` too) that reproduce ``target`` on ``terms``, rounded by :func:`nice`."""
    hp = s.hp
    for c in solve_dual_clip(terms, plain, target):
        duals += nice(c)
    for dual in dict.fromkeys([s.base.conv.policy.dual_clip, None]):
        known = tuple(dict.fromkeys([hp.cliprange, hp.cliprange_high or hp.cliprange]))
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


__all__ = ["MEMO_MAX", "kl_loss_stage", "max_abs_log_ratio", "policy_step", "propose_policy"]
