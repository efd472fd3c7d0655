"""The policy step of ``--detect``: the policy, policy_agg, approx_kl, entropy and kl_loss stages.

Walks ``policy_loss`` (the checked setting's first; every :class:`PolicyLoss` member when nothing
reproduces the dump), ``dual_clip`` (none / verl's ``c = 3`` / the checked setting's; ``vanilla``
only), ``log_ratio_clamp`` (:func:`refppo.oracle.detect.policy_solve.log_ratio_clamps`: none, the
checked setting's, 20 for ``vanilla`` and verl's κ = 10 for ``gspo``), every :class:`LossAgg` member
as ``loss_agg``, every :class:`ApproxKL` member, ``entropy_agg`` (like ``loss_agg``, or any other
mode when the dump holds ``entropy_loss``) and the checked clip ranges. When none reproduces
``pg_loss`` and ``pg_clipfrac``, :func:`refppo.oracle.detect.policy_solve.propose_policy` solves the
dual-clip constant and the clip ranges from the data and the step is walked again with them and
with every policy loss.

The logged-only keys (``clipfrac_agg``, ``clipfrac_counts``:
:mod:`refppo.oracle.detect.policy_clipfrac`; the KL loss's own ``kl_loss_estimator`` and clamps under
``kl_in=both``: :mod:`refppo.oracle.detect.policy_kl`) are walked one option per distinct value; the
members with an option's value are merged into the groups the step keeps
(:mod:`refppo.oracle.detect.policy_members`).

The per-token loss is made once per ``(advantages, policy loss, clip ranges, dual clip, clamp)`` by
the policy stage and aggregated under every mode by the policy_agg stage; a clamp that binds on no
token, or a dual clip that caps no token, leaves the stage's output as it is without them, so the
walk reuses that evaluation (:func:`_dual_caps`; the clamp under ``vanilla``: ``max|l − l^old|``
over the valid tokens; under ``gspo``, an upper clamp of ``S_b = mean_t(l − l^old)``: ``max_b S_b``,
:func:`max_seq_log_ratio`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any

import torch
from torch import Tensor

from refppo.agg_conventions import MASK_AGGS
from refppo.conventions import ApproxKL, PolicyLoss
from refppo.core.checks import count_true
from refppo.oracle.check.ties import pg_tie_share
from refppo.oracle.detect.grad_fit import GradFit, explain_policy
from refppo.oracle.detect.groups import Group, Option
from refppo.oracle.detect.policy_clipfrac import CORE, ClipfracWalk
from refppo.oracle.detect.policy_kl import KLLossWalk, KLVariant, kl_loss_stage
from refppo.oracle.detect.policy_solve import log_ratio_clamps, propose_policy
from refppo.oracle.detect.search import Search
from refppo.oracle.detect.states import AdvState, PolicyState, digest

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


def max_seq_log_ratio(rows: int, logp: Tensor, logp_old: Tensor, m: Tensor) -> float:
    """``max_b S_b``, ``S_b = Σ_t m·(l − l^old) / L_b`` (GSPO's log sequence ratio, the policy
    stage's own expression; every row has a valid token), by blocks of ``rows`` rows (no ``[B, T]``
    temporary): GSPO's upper clamp κ at or above it binds on no row (``min(S_b, κ) = S_b``)."""
    zero = torch.zeros((), dtype=logp.dtype)
    best = float("-inf")
    for r in row_slices(m.shape[0], rows):
        d = torch.where(m[r], torch.where(m[r], logp[r], zero) - logp_old[r], zero)
        best = max(best, float((d.sum(dim=1) / count_true(m[r], 1).to(d.dtype)).max()))
    return best


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
        self.max_abs_d = max_abs_log_ratio(self.block, self.logprobs, t["old_logprobs"], m)
        self._max_seq: float | None = None
        self.ev_tok = s.ev_counts(m)
        q_ent = {"entropy": t.get("entropy"), "mask": m, "logprobs": self.logprobs}
        # entropy_agg None reads loss_agg: each mode's entropy term once, under entropy_agg = loss_agg
        self.ent: dict[str, Tensor] = {}
        if t.get("entropy") is not None:
            for a in MASK_AGGS:
                st = s.setting(loss_agg=a.value, entropy_agg=None)
                self.ent[a.value] = s.evaluate("entropy", q_ent, st, self.ev_tok)["entropy_loss"]
        self.klw = KLLossWalk(s, self.has_lp)
        self.cfw = ClipfracWalk(s, self.logprobs)
        self.akl: dict[tuple[str, float, float | None], Tensor] = {}
        self.acts: dict[tuple[Any, ...], bool] = {}
        self.computed: dict[tuple[Any, ...], _Aggregated] = {}

    def pg_ok(self, pg: dict[str, Tensor]) -> bool:
        """Whether some aggregation of a policy stage's loss reproduces ``pg_loss`` (or it is not dumped)."""
        return "pg_loss" not in self.s.t or any(self.s.ratio("pg_loss", v, None) == 0.0 for v in pg.values())

    def max_seq(self) -> float:
        """:func:`max_seq_log_ratio` of the dump (once, when a ``gspo`` option is walked)."""
        if self._max_seq is None:
            self._max_seq = max_seq_log_ratio(self.block, self.logprobs, self.s.t["old_logprobs"], self.s.m)
        return self._max_seq

    def effective(
        self, adv: Tensor, adv_key: bytes, clip: Clip, loss: PolicyLoss, dual: float | None, lrc: float | None
    ) -> tuple[float | None, float | None]:
        """``(dual, clamp)`` that give the stage's output under ``(loss, dual, lrc)``: a clamp that
        binds on no token (no row under ``gspo``), or a dual clip that caps no token, is left out
        (the same output bit for bit)."""
        if loss is PolicyLoss.GSPO:
            return dual, (lrc if (lrc is not None and self.max_seq() > lrc) else None)
        eff_lrc = lrc if (lrc is not None and self.max_abs_d > lrc) else None
        lo, hi = clip
        if dual is not None and dual > 1.0 + (hi if hi is not None else lo):
            dk = (adv_key, clip, dual, eff_lrc)
            if dk not in self.acts:  # made with the loss without a dual clip (:meth:`entry`)
                self.entry(adv, adv_key, clip, loss, None, eff_lrc, (dual,), force=True)
            if not self.acts[dk]:
                return None, eff_lrc
        return dual, eff_lrc

    def entry(
        self,
        adv: Tensor,
        adv_key: bytes,
        clip: Clip,
        loss: PolicyLoss,
        dual: float | None,
        lrc: float | None,
        duals: tuple[float, ...] = (),
        *,
        force: bool = False,
        weight: tuple[bytes, Tensor | None] = (b"", None),
    ) -> _Aggregated:
        """The policy stage's loss under ``(loss, clip, dual, lrc)`` times the correction's
        ``weight`` (``(digest, w')``; None: off), aggregated by the policy_agg stage under every mode
        (memoised: scalars only); the vanilla loss made without a dual clip and without a weight
        also records which of ``duals`` would cap a token (:func:`_dual_caps`)."""
        ck = (adv_key, weight[0], loss, clip, dual, lrc)
        hit = self.computed.get(ck)
        if hit is not None and not force:
            return hit
        s = self.s
        q: dict[str, Tensor | None] = {"logprobs": self.logprobs, "old_logprobs": s.t["old_logprobs"]}
        q.update(advantages=adv, mask=s.m, is_weights=weight[1])  # w': the group's correction
        st = s.setting(
            policy_loss=loss.value,
            dual_clip=dual,
            log_ratio_clamp=lrc,
            cliprange=clip[0],
            cliprange_high=clip[1],
            clipfrac_agg=CORE[0],
            clipfrac_counts=CORE[1],
        )
        out = s.evaluate("policy", q, st)
        if dual is None and loss is PolicyLoss.VANILLA and weight[1] is None:
            for d in duals:
                self.acts[(adv_key, clip, d, lrc)] = _dual_caps(self.block, out["pg_per_token"], adv, s.m, d)
        qa = {"pg_per_token": out["pg_per_token"], "mask": s.m}
        pg = {
            a.value: s.evaluate("policy_agg", qa, s.setting(loss_agg=a.value), self.ev_tok)[
                "pg_loss"
            ].detach()
            for a in MASK_AGGS
        }
        agg = _Aggregated(pg, out["pg_clipfrac"], out["pg_approx_kl"])
        del out, qa
        if hit is None:
            if len(self.computed) >= MEMO_MAX:  # a cache: bounded, values recomputed
                self.computed.clear()
            self.computed[ck] = agg
        return agg

    def approx_kl(self, ak: str, k1: Tensor, lrc: float | None = None) -> Tensor:
        """The approx_kl stage under metric ``ak`` on the policy stage's masked ``mean(l^old − l)``
        ``k1`` (memoised by its value: every policy loss of the walk has the same) and the walked
        log-ratio clamp ``lrc`` (read by ``k1_clamped`` only)."""
        key = (ak, float(k1), lrc if ak == ApproxKL.K1_CLAMPED.value else None)
        if key not in self.akl:
            s = self.s
            q = {
                "pg_approx_kl": k1,
                "logprobs": self.logprobs,
                "old_logprobs": s.t["old_logprobs"],
                "mask": s.m,
            }
            setting = s.setting(approx_kl=ak, log_ratio_clamp=key[2])
            self.akl[key] = s.evaluate("approx_kl", q, setting)["approx_kl"]
        return self.akl[key]

    def kl_loss(self, st: AdvState, agg: str) -> Tensor | None:
        """The kl_loss stage under ``kl_in=loss`` with the group's KL keys and ``loss_agg = agg``
        (``kl_loss_agg`` None); None unless the KL is in the loss and the dump has current log-probs."""
        ca = st.carried
        if not ca.kl_in.in_loss or not self.has_lp:
            return None
        return self.klw.kl_loss_as(ca.kl_key, ca.kl_setting, agg, None)

    def kl_variants(self, st: AdvState, agg: str) -> list[KLVariant]:
        """:meth:`refppo.oracle.detect.policy_kl.KLLossWalk.variants` of ``st``'s KL loss."""
        return self.klw.variants(st.carried, self.kl_loss(st, agg), agg)


Walked = tuple[PolicyLoss, Clip, float | None, float | None]
"""``(policy loss, clip ranges, dual clip, log-ratio clamp)``: one policy stage setting of the walk."""


def _walked(
    losses: list[PolicyLoss], clips: list[Clip], duals: list[float | None], own_lrc: float | None
) -> list[Walked]:
    """The policy stage settings walked: per policy loss (in order, each once), the clip ranges ×
    the dual clips (none only under ``gspo``, which has none) × its log-ratio clamps
    (:func:`refppo.oracle.detect.policy_solve.log_ratio_clamps` with the checked ``own_lrc``)."""
    out: list[Walked] = []
    for loss in dict.fromkeys(losses):
        ds = duals if loss is PolicyLoss.VANILLA else [None]
        lrcs = log_ratio_clamps(loss, own_lrc)
        out += [(loss, c, d, lr) for c, d, lr in itertools.product(clips, ds, lrcs)]
    return out


def _policy_options(
    pe: _PolicyEval, settings: list[Walked], by_weight: bool = False
) -> Callable[[Group[AdvState]], Iterable[Option[PolicyState]]]:
    """The policy step's options; ``by_weight`` (a dump with ``grad_logprobs``): options merge only
    under the same correction weight too (two weights can give one float32 ``pg_loss`` bit for
    bit, a cap solved to it does, and another gradient)."""
    s = pe.s
    base_clip = (s.hp.cliprange, s.hp.cliprange_high)
    own_loss = s.base.conv.policy.loss
    own_eagg: dict[str, Any] = {} if s.base.conv.agg.entropy is None else {"entropy_agg": None}
    tests = tuple(dict.fromkeys(d for _, _, d, _ in settings if d is not None))
    ents_all = "entropy_loss" in s.t

    def opts(g: Group[AdvState]) -> Iterable[Option[PolicyState]]:
        st = g.state
        for loss, clip, dual, lrc in settings:
            if loss is PolicyLoss.GSPO and st.is_weights is not None:
                continue  # a corrected surrogate is refused with GSPO (the convention's check)
            eff_dual, eff_lrc = pe.effective(st.adv, st.adv_key, clip, loss, dual, lrc)
            w = (st.is_key, st.is_weights)
            out = pe.entry(st.adv, st.adv_key, clip, loss, eff_dual, eff_lrc, tests, weight=w)
            cfs = pe.cfw.variants(st, loss, clip, eff_lrc, out.clipfrac, partial(pe.pg_ok, out.pg))
            upd_clip = {} if clip == base_clip else {"cliprange": clip[0], "cliprange_high": clip[1]}
            upd_loss = {} if loss is own_loss else {"policy_loss": loss.value}
            setting = {
                "policy_loss": loss.value,
                "dual_clip": eff_dual,
                "log_ratio_clamp": eff_lrc,
                "cliprange": clip[0],
                "cliprange_high": clip[1],
            }
            for agg in MASK_AGGS:
                a = agg.value
                ents: list[tuple[dict[str, Any], Tensor | None]] = [(own_eagg, pe.ent.get(a))]
                if ents_all:  # SkyRL's entropy is token-mean whatever loss_agg (skyrl_train ppo_utils)
                    ents += [({"entropy_agg": e}, v) for e, v in pe.ent.items() if e != a]
                for kupd, kll, kgrad, kcls in pe.kl_variants(st, a):
                    kset = {**setting, **kupd}
                    # a KL-loss key only the gradient shows: its own option where the gradient is dumped
                    kk = kgrad if by_weight else b""
                    for (eupd, ent), ak, (cupd, cf, ccls) in itertools.product(ents, ApproxKL, cfs):
                        if ak is ApproxKL.K1_CLAMPED and eff_lrc is None:
                            continue  # k1 itself here: the clamp is off or binds on no token
                        akl = pe.approx_kl(ak.value, out.approx_kl, eff_lrc)
                        ps = PolicyState(
                            st.carried, st.adv, st.adv_key, kset, agg, out.pg[a], cf, akl, ent, kll,
                            st.is_weights, st.is_key, (kcls, ccls),
                        )  # fmt: skip
                        wk = st.is_key if by_weight else b""
                        key = digest(st.carried.ret_key, out.pg[a], cf, akl, ent, kll, a, wk, kk)
                        upd = {
                            "dual_clip": dual,
                            "log_ratio_clamp": lrc,
                            "loss_agg": a,
                            "approx_kl": ak.value,
                        }
                        yield {**upd_loss, **upd, **eupd, **upd_clip, **kupd, **cupd}, ps, key

    return opts


def _widen(s: Search, st: PolicyState, cache: dict[Any, float]) -> Callable[[], float]:
    """The tie-widening of ``pg_clipfrac`` for a policy state (cached per advantages, policy loss,
    clamp, clips)."""
    t, m = s.t, s.m

    def widen() -> float:
        cfg = st.setting
        loss = cfg["policy_loss"]
        ck = (st.adv_key, loss, cfg["log_ratio_clamp"], cfg["cliprange"], cfg["cliprange_high"])
        if ck not in cache:
            # the vanilla loss keeps the checked dual clip's boundary; gspo has none
            no_dual: dict[str, Any] = {} if loss == PolicyLoss.VANILLA.value else {"dual_clip": None}
            setup = s.setting(
                **no_dual,
                policy_loss=loss,
                log_ratio_clamp=cfg["log_ratio_clamp"],
                cliprange=cfg["cliprange"],
                cliprange_high=cfg["cliprange_high"],
                clipfrac_agg=CORE[0],  # the tie share is the token-mean's (row-mean: vanilla only)
                clipfrac_counts=CORE[1],
            )
            cache[ck] = float(pg_tie_share(t["logprobs"], t["old_logprobs"], st.adv, m, setup, s.tol.rtol))
        return cache[ck]

    return widen


def policy_step(s: Search, groups: list[Group[AdvState]]) -> list[Group[PolicyState]]:
    """``pg_loss``, ``pg_clipfrac``, ``approx_kl``, ``entropy_loss``: policy loss, dual clip, clamp,
    aggregation (the checked policy loss first, every other one with the solver's constants)."""
    pe = _PolicyEval(s)
    gf = GradFit(s)
    c = s.base.conv.policy
    base_duals: list[float | None] = list(dict.fromkeys([None, 3.0, c.dual_clip]))
    base_clip = (s.hp.cliprange, s.hp.cliprange_high)
    widen_cache: dict[Any, float] = {}
    others = [p for p in PolicyLoss if p is not c.loss]
    if s.base.conv.rollout.on:  # a corrected surrogate is refused with GSPO (the convention's check)
        others = [p for p in others if p is not PolicyLoss.GSPO]

    def make(
        extra: dict[str, list[Any]] | None,
    ) -> Callable[[Group[AdvState]], Iterable[Option[PolicyState]]]:
        extra = extra or {}
        duals = list(dict.fromkeys(base_duals + list(extra.get("duals", []))))
        clips = [base_clip, *extra.get("clips", [])]
        losses = [c.loss, *extra.get("losses", [])]
        return _policy_options(pe, _walked(losses, clips, duals, c.log_ratio_clamp), gf.lp_on)

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
        if all(r is None or r == 0.0 for r in out):  # the gradient only where every scalar agrees
            out.append(gf.policy_ratio(st))
        return out

    propose = (lambda gs: propose_policy(s, gs, [c.loss, *others])) if pe.has_lp else None
    out = s.stage(groups, make, checks, "policy", propose)
    # the explanation reads the dump's rows: not on a search cut to some of them (detect/in_loss.py)
    whole = s.m.shape[0] == s.dump.mask.shape[0]
    if "policy" in s.unmatched and gf.lp_on and "pg_loss" not in s.t and out and whole:
        s.fitted += explain_policy(gf, [g.state for g in out])  # the nearest groups'
    return out


__all__ = ["MEMO_MAX", "kl_loss_stage", "max_abs_log_ratio", "policy_step", "propose_policy"]
