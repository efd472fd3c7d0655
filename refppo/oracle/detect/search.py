"""The staged search behind ``--detect`` (see :mod:`refppo.oracle.detect.detection` for the stage table).

Each stage first walks its named options (every member of the convention enums, the peers' clamp
bundles, the checked setting's own constants); when none reproduces the dumped quantity of the
stage, the stage's *solver* (:mod:`refppo.oracle.detect.solve`) reads the constants off the data and the
stage is walked again with the proposals added. A stage that still matches nothing keeps its
nearest groups and records a fitted description of what the dump holds (:attr:`_Search.fitted`).

The search composes the core functions itself (for speed); :func:`refppo.oracle.detect.detection.detect`
re-checks what it reports through :mod:`refppo.pipeline`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, cast

import torch
from torch import Tensor

from refppo.conventions import KLEstimator, KLPlacement, LossAgg
from refppo.core.aggregate import aggregate_loss
from refppo.core.kl import token_kl
from refppo.core.objective import total_loss
from refppo.core.policy import approx_kl_k2_all_positions, clipped_policy_loss, policy_ratio
from refppo.dump.load import TOLERANCES, Dump, trim_heap
from refppo.errors import RefPPOError
from refppo.oracle.check.alternatives import ALTERNATIVES, CLAMP_BUNDLES
from refppo.oracle.check.compare import compare
from refppo.oracle.check.settings import Setup
from refppo.oracle.check.ties import pg_tie_share
from refppo.oracle.detect.groups import Group, Replayer, expand_groups
from refppo.oracle.detect.prune import ValuePrune
from refppo.oracle.detect.solve import (
    PolicyTerms,
    clipfrac_of,
    loss_weights,
    nice,
    read_kl_clamps,
    solve_clip_ranges,
    solve_dual_clip,
)
from refppo.pipeline.rollout import value_mask

MAX_EQUIV = 256
"""Equivalent conventions kept per group (the rest are counted)."""
NEAREST = 3
"""Groups kept after a stage that no group reproduces."""
SOLVE_GROUPS = 3
"""Groups (advantage variants) the policy solvers are run on."""

Option = tuple[dict[str, Any], dict[str, Any], bytes]


def kl_candidates(own: KLEstimator, has_grad: bool) -> tuple[KLEstimator, ...]:
    """The KL estimators the KL stage tries.

    A straight-through ``k3+`` has ``k3``'s value (only its gradient differs), so both give identical
    stage outputs and merge into one group; with ``grad_logprobs`` in the dump every estimator is kept
    and the pipeline re-check keeps whichever fits the gradient. Without gradients the pair is a genuine
    equivalence: one of them is kept, the base's own where it is one of the pair (else the plain one).
    """
    if has_grad:
        return tuple(KLEstimator)
    return tuple(e for e in KLEstimator if e == own or (not e.straight_through and e != own.base))


def digest(*parts: Any) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        if isinstance(p, Tensor):
            # the array's own buffer (no bytes copy); numpy's stubs do not declare the buffer protocol
            h.update(cast(Any, p.detach().contiguous().numpy()))
        else:
            h.update(repr(p).encode())
        h.update(b"|")
    return h.digest()


class Search:
    def __init__(self, dump: Dump, base: Setup) -> None:
        self.dump = dump
        self.base = base
        self.t = dump.tensors
        self.m = dump.mask
        self.hp = base.hp
        self.tol = TOLERANCES[dump.dtype]
        self.unmatched: list[str] = []
        self.fitted: list[str] = []
        """One line per stage no convention reproduces: the map fitted between dump and refppo."""
        self.notes: list[str] = []
        """What the data cannot decide, in one line each (e.g. a score map with constant scores)."""
        self.solved: dict[str, list[Any]] = {}
        """Constants the solvers proposed, by key (whether or not the pipeline confirmed them)."""
        self.norm = {"horizon": self.hp.horizon} if self.hp.horizon is not None else {}
        self.compared: set[str] = set()
        """Dumped keys compared since the last :meth:`release_compared` (their pages are resident)."""
        self.replayer = Replayer()
        """Rebuilds the states the stages do not hold (:mod:`refppo.oracle.detect.groups`)."""
        self.walks: list[tuple[str, bool, bool]] = []
        """``(stage, some group passed, some check applied)`` of each walk, in order (search_groups)."""
        self.prune: ValuePrune | None = None
        """Drops GAE options no value loss can match (:mod:`refppo.oracle.detect.prune`), when set."""

    # ----- helpers -------------------------------------------------------------------------
    def ratio(
        self, name: str, ref: Tensor, cmp_mask: Tensor | None, widen: Callable[[], float] | None = None
    ) -> float | None:
        if not self.dump.has(name):
            return None
        self.compared.add(name)
        r = compare(name, self.t[name], ref, cmp_mask, self.tol)
        if not r.ok and widen is not None:
            r = compare(name, self.t[name], ref, cmp_mask, self.tol, widen=widen())
        if r.ok:
            return 0.0
        return r.max_abs_err / r.tol if r.tol > 0 else float("inf")

    def expand(
        self,
        groups: list[Group],
        options: Callable[[Group], Iterable[Option]],
        checks: Callable[[dict[str, Any]], list[float | None]],
        stage: str,
    ) -> list[Group]:
        """Expand each group by ``options`` (``(conv update, new state, digest)``), merge, filter.

        Scored as each group is made, in bounded memory: :func:`refppo.oracle.detect.groups.expand_groups`.
        """
        return expand_groups(self, groups, options, checks, stage, NEAREST, MAX_EQUIV)

    def stage(
        self,
        groups: list[Group],
        make_options: Callable[[Any], Callable[[Group], Iterable[Option]]],
        checks: Callable[[dict[str, Any]], list[float | None]],
        name: str,
        propose: Callable[[list[Group]], Any] | None = None,
    ) -> list[Group]:
        """Walk the named options; when none reproduces (or none applies), walk again with the solver's."""
        trim_heap()  # what the previous stage freed is not resident under this one's peak
        out = self.expand(groups, make_options(None), checks, name)
        # none of the first walk's options applies (say advantage=gae on a dump without a critic):
        # that is no match either, so the solver's walk runs too
        if (name in self.unmatched or (groups and not out)) and propose is not None:
            extra = propose(groups)
            if extra:
                if name in self.unmatched:
                    self.unmatched.remove(name)
                out = self.expand(groups, make_options(extra), checks, name)
        return out

    def release_compared(self) -> None:
        """Hand back the pages of the dumped keys compared by a walk (:meth:`Dump.release`).

        A walk compares one key per candidate group, then the stage moves on to other keys, so
        without this every compared trainer output stays resident for the rest of the search (a
        B=1024, T=8192 float32 key is 33.5 MB). A later read pages the same bytes in again.
        """
        for name in sorted(self.compared):
            self.dump.release(name)
        self.compared.clear()

    def value_mask(self, score_at: Any) -> Tensor:
        """:func:`refppo.pipeline.rollout.value_mask` once per score slot: one tensor each for the whole
        search, so that replayed states share it and caches keyed by its ``id`` stay valid."""
        vms: dict[Any, Tensor] = self.__dict__.setdefault("_vms", {})
        if score_at not in vms:
            vms[score_at] = value_mask(self.m, score_at)
        return vms[score_at]

    def propose_value(self, key: str, value: Any) -> None:
        """Record a solver's proposal for ``key`` (None, "no clamp", is not a proposal)."""
        if value is None:
            return
        v = list(value) if isinstance(value, tuple) else value
        if v not in self.solved.setdefault(key, []):
            self.solved[key].append(v)

    def setup_for(self, **upd: Any) -> Setup:
        """The base setting with some convention keys and the clip hyperparameters replaced."""
        hp_keys = {"cliprange", "cliprange_high", "cliprange_value"}
        hp_up = {k: v for k, v in upd.items() if k in hp_keys}
        s = self.base.with_convention({k: v for k, v in upd.items() if k not in hp_keys})
        return Setup(s.conv, replace(s.hp, **hp_up)) if hp_up else s

    # ----- stages -------------------------------------------------------------------------
    def run(self) -> list[Group]:
        groups = [Group([{}], 1, {})]
        from refppo.oracle.detect.estimator import estimator_stage, needs_estimator_stage
        from refppo.oracle.detect.rollout import gae_stage, reward_stage, whiten_stage

        self.dump.release_mapped()  # the loader's validation read every key
        groups = self._kl(groups)
        self.dump.release_mapped()
        groups = reward_stage(self, groups)
        self.dump.release_mapped()
        # a dump with a critic and no group_index under a gae setting walks GAE alone, as before
        groups = estimator_stage(self, groups) if needs_estimator_stage(self) else gae_stage(self, groups)
        self.dump.release_mapped()
        groups = drop_reward_state(groups)
        groups = whiten_stage(self, groups)
        t = self.t
        if not ("logprobs" in t or "values" in t):
            return groups
        from refppo.oracle.detect.policy import policy_stage
        from refppo.oracle.detect.value import value_stage

        self.dump.release_mapped()
        groups = drop_rollout_state(groups)
        groups = policy_stage(self, groups)
        self.dump.release_mapped()
        if "old_values" in t:
            groups = value_stage(self, groups)
        else:  # no critic: no value loss (refppo.pipeline.step.update_quantities)
            for g in groups:
                g.patch({"vf_loss": torch.zeros((), dtype=t["old_logprobs"].dtype)})
        self.dump.release_mapped()
        return self._loss(groups)

    def _kl(self, groups: list[Group]) -> list[Group]:
        t, m = self.t, self.m
        clamp_opts = list(CLAMP_BUNDLES.values())
        own = {
            "kl_log_ratio_clamp": self.base.conv.kl.log_ratio_clamp,
            "kl_value_clamp": self.base.conv.kl.value_clamp,
        }
        if own not in clamp_opts:
            clamp_opts.append(own)
        has_lp = "logprobs" in t
        kl_values = kl_candidates(KLEstimator(self.base.conv.kl.estimator), self.dump.has("grad_logprobs"))

        def make(extra: list[tuple[str, dict[str, Any]]] | None) -> Callable[[Group], Iterable[Option]]:
            pairs = [(e.value, cl) for e in kl_values for cl in clamp_opts] + list(extra or [])

            def opts(g: Group) -> Iterable[Option]:
                for est, cl in pairs:
                    kw = {"log_ratio_clamp": cl["kl_log_ratio_clamp"], "value_clamp": cl["kl_value_clamp"]}
                    try:
                        kl_old = token_kl(t["old_logprobs"], t["ref_logprobs"], m, est, **kw)
                        kl_cur = token_kl(t["logprobs"], t["ref_logprobs"], m, est, **kw) if has_lp else None
                    except RefPPOError:
                        continue
                    key = digest(kl_old, kl_cur)
                    yield {"kl_estimator": est, **cl}, {"kl": kl_old, "kl_cur": kl_cur, "kl_key": key}, key

            return opts

        def propose(_: list[Group]) -> list[tuple[str, dict[str, Any]]]:
            if "kl" not in t:
                return []
            tol = self.tol.of(float(t["kl"].abs().max()))
            out = []
            for est in kl_values:
                for b in read_kl_clamps(t["kl"], t["old_logprobs"], t["ref_logprobs"], m, est.value, tol):
                    if b not in clamp_opts:
                        out.append((est.value, b))
                        self.propose_value("kl_log_ratio_clamp", b["kl_log_ratio_clamp"])
                        self.propose_value("kl_value_clamp", b["kl_value_clamp"])
            return out

        return self.stage(groups, make, lambda s: [self.ratio("kl", s["kl"], m)], "kl", propose)

    def _loss(self, groups: list[Group]) -> list[Group]:
        hp, t = self.hp, self.t
        has_lp = "logprobs" in t

        own_kagg = {} if self.base.conv.agg.kl is None else {"kl_loss_agg": None}
        separate = self.dump.step.separate_critic

        def opts(g: Group) -> Iterable[Option]:
            s = g.state
            # kl_loss_agg: the policy stage aggregated the KL loss like pg_loss (None); SkyRL's
            # KL loss keeps its own mode (skyrl_train ppo_utils) so every other mode is walked too
            kls: list[tuple[dict[str, Any], Tensor | None]] = [(own_kagg, s["kl_loss"])]
            if s["kl_loss"] is not None and s.get("kl_cur") is not None:
                for a in LossAgg:
                    if a.value != s["agg"]:
                        kll = aggregate_loss(s["kl_cur"], self.m, a.value, **self.norm)
                        kls.append(({"kl_loss_agg": a.value}, kll))
            for upd, kl_loss in kls:
                # the core's objective (step 9), as the pipeline composes it; separate_critic: the
                # dumped ``loss`` is the actor's objective, without the value term (a weight of 0,
                # as recompute's reference: refppo/oracle/check/recompute.py)
                total = total_loss(
                    s["pg_loss"], s["vf_loss"], s["entropy_loss"], kl_loss,
                    vf_coef=0.0 if separate else hp.vf_coef, ent_coef=hp.ent_coef, kl_coef=hp.kl_coef,
                )  # fmt: skip
                st = {**s, "loss": total, "kl_loss": kl_loss}
                yield upd, st, digest(total, s["pg_loss"], s["vf_loss"], kl_loss)

        def checks(s: dict[str, Any]) -> list[float | None]:
            out: list[float | None] = []
            if has_lp and ("values" in t or "old_values" not in t):
                out.append(self.ratio("loss", s["loss"], None))
            if s["kl_loss"] is not None:
                out.append(self.ratio("kl_loss", s["kl_loss"], None))
            return out

        return self.expand(groups, opts, checks, "loss")

    # ----- policy solvers ------------------------------------------------------------------
    def propose_policy(self, groups: list[Group]) -> dict[str, list[Any]]:
        """Dual-clip constants and clip ranges under which ``pg_loss`` is reproduced.

        Solved per advantage variant (the first :data:`SOLVE_GROUPS` groups), per aggregation
        mode and per log-ratio clamp; clip-range pairs must also give the dump's ``pg_clipfrac``.
        """
        t, m, hp = self.t, self.m, self.hp
        if "pg_loss" not in t or "logprobs" not in t:
            return {}
        target = float(t["pg_loss"])
        duals: list[float] = []
        clips: list[tuple[float, float | None]] = []
        lrcs = list(dict.fromkeys([None, self.base.conv.policy.log_ratio_clamp, 20.0]))
        seen_adv: set[bytes] = set()  # by content: a replayed state's tensors are new objects
        for g in groups[:SOLVE_GROUPS]:
            adv, adv_key = g.state["adv"], g.state["adv_key"]
            if adv_key in seen_adv:
                continue
            seen_adv.add(adv_key)
            for lrc in lrcs:
                ratio = policy_ratio(t["logprobs"], t["old_logprobs"], m, log_ratio_clamp=lrc)
                plain = clipped_policy_loss(
                    t["logprobs"],
                    t["old_logprobs"],
                    adv,
                    m,
                    clip_low=hp.cliprange,
                    clip_high=hp.cliprange_high,
                    log_ratio_clamp=lrc,
                ).per_token[m]
                for agg in LossAgg:
                    w = loss_weights(lambda x, a=agg: aggregate_loss(x, m, a, **self.norm), m, adv.dtype)
                    terms = PolicyTerms(adv[m].double(), ratio[m].double(), w[m].double())
                    for c in solve_dual_clip(terms, plain, target):
                        duals += nice(c)
                    for dual in dict.fromkeys([self.base.conv.policy.dual_clip, None]):
                        known = tuple(dict.fromkeys([hp.cliprange, hp.cliprange_high or hp.cliprange]))
                        for lo, hi in solve_clip_ranges(terms, target, dual=dual, known=known):
                            if not self._clipfrac_ok(terms, lo, hi):
                                continue
                            lo_n, hi_n = nice(lo)[0], nice(hi)[0]
                            if 0.0 <= lo_n < 1.0:
                                clips.append((lo_n, None if hi_n == lo_n else hi_n))
        duals = [d for d in dict.fromkeys(duals) if d > 1.0][:8]
        base_clip = (hp.cliprange, hp.cliprange_high)
        clips = [c for c in dict.fromkeys(clips) if c != base_clip][:8]
        for dc in duals:
            self.propose_value("dual_clip", dc)
        for lo_c, hi_c in clips:
            self.propose_value("cliprange", lo_c)
            self.propose_value("cliprange_high", hi_c)
        return {"duals": duals, "clips": clips} if (duals or clips) else {}

    def _clipfrac_ok(self, terms: PolicyTerms, lo: float, hi: float) -> bool:
        if "pg_clipfrac" not in self.t:
            return True
        got = float(self.t["pg_clipfrac"])
        # ties at the boundary and rounding of a float32 trainer: a few tokens either way
        slack = self.tol.of(abs(got)) + 4.0 / max(terms.adv.numel(), 1)
        return abs(clipfrac_of(terms, lo, hi) - got) <= slack + self.tol.rtol


REWARD_STATE = ("kl", "rewards")
"""State entries that only the reward stage and step 3 (GAE or a critic-free estimator) read: the
whitening walk reads the raw advantages, so these ``[B, T]`` tensors are dropped before it runs."""
ROLLOUT_ONLY_STATE = ("kl", "rewards", "adv_raw")
"""State entries that only the rollout stages read: the policy stage builds its states from the
advantages, returns, masks and KL keys, so these ``[B, T]`` tensors are dropped before it runs."""


def drop_state(groups: list[Group], keys: tuple[str, ...]) -> list[Group]:
    """The groups with ``keys`` removed from their states (in place).

    Dropped from the groups a stage returns, before the next stage expands them: those groups are
    then also the parents the next stage's replayed states are rebuilt from (a parent holds its
    state for as long as a child may be replayed), so a key the next walk does not read is not
    held by them either.
    """
    for g in groups:
        g.patch(omit=keys)
    return groups


def drop_reward_state(groups: list[Group]) -> list[Group]:
    """:data:`REWARD_STATE` removed from the states (in place), and ``kl_cur`` where the KL penalty
    is not in the loss (``kl_in`` ≠ loss): only the policy stage's KL loss reads it then.

    A group's ``kl_in`` is read off its conventions (every member has the same: the reward stage's
    digest holds it), not off its state, which would replay a state that is not held.
    """
    for g in groups:
        in_loss = g.convs[0]["kl_in"] == KLPlacement.LOSS.value
        g.patch(omit=REWARD_STATE if in_loss else (*REWARD_STATE, "kl_cur"))
    return groups


def drop_rollout_state(groups: list[Group]) -> list[Group]:
    """The groups with :data:`ROLLOUT_ONLY_STATE` removed from their states (in place)."""
    return drop_state(groups, ROLLOUT_ONLY_STATE)


def nearest_note(g: Group) -> str:
    c = g.convs[0]
    keys = ("kl_estimator", "kl_in", "score_at", "score_clip", "whiten_rewards")
    return (
        " (raw values under the nearest convention: "
        + ", ".join(f"{k}={c.get(k)}" for k in keys if k in c)
        + ")"
    )


def pg_widen_for(search: Search, s: dict[str, Any]) -> Callable[[], float]:
    """The tie-widening of ``pg_clipfrac`` for a policy-stage state (cached per adv/clamp/clip).

    Keyed by the advantages' content digest (``adv_key``), not ``id``: the search drops and
    replays states, so an ``id`` could be reused by another tensor.
    """
    t, m = search.t, search.m
    cache: dict[Any, float] = search.__dict__.setdefault("_widen_cache", {})

    def widen() -> float:
        ck = (s["adv_key"], s["lrc"], s["clip"])
        if ck not in cache:
            setup = search.setup_for(
                log_ratio_clamp=s["lrc"], cliprange=s["clip"][0], cliprange_high=s["clip"][1]
            )
            cache[ck] = float(
                pg_tie_share(t["logprobs"], t["old_logprobs"], s["adv"], m, setup, search.tol.rtol)
            )
        return cache[ck]

    return widen


__all__ = [
    "ALTERNATIVES",
    "Group",
    "Search",
    "approx_kl_k2_all_positions",
    "digest",
    "drop_reward_state",
    "drop_rollout_state",
    "drop_state",
    "pg_widen_for",
]
