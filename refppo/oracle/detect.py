"""``--detect``: every convention that reproduces a dump, searched stage by stage.

Conventions decompose along the pipeline, so the search never enumerates the full product:

====== ============================================ =========================================
stage  keys it adds                                  quantities it is checked against
====== ============================================ =========================================
kl     kl_estimator, KL clamps                       kl
reward kl_in, score_at, score_clip                   token_rewards
gae    (none: GAE itself)                            returns
whiten whiten_advantages, whiten_variance            advantages
policy dual_clip, log_ratio_clamp, loss_agg,         pg_loss, pg_clipfrac, approx_kl,
       approx_kl                                     entropy_loss
value  value_loss, value_clip_form, vf_mask,         vf_loss, vf_clipfrac
       value_loss_agg
loss   (none: the total)                             kl_loss, loss
====== ============================================ =========================================

After each stage, candidates whose outputs are bit-identical are merged into one group (so an
inactive clamp, say, never doubles the work of the stages after it), and when the dump holds a
quantity of the stage only the groups that reproduce it go on. When none does, the nearest groups
go on and the stage is recorded as unmatched.

The staged search composes the core functions itself (for speed), so its result is not trusted on
its own: the :data:`VERIFIED` detected conventions closest to the base are re-checked through the
one verified path (:func:`refppo.oracle.diagnose.check` → :mod:`refppo.pipeline`), and a
convention that fails that re-check is dropped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from refppo.conventions import KLPlacement, ScorePosition, ValueClipForm
from refppo.core.aggregate import aggregate_loss
from refppo.core.gae import gae
from refppo.core.kl import token_kl
from refppo.core.policy import clipped_policy_loss
from refppo.core.rewards import token_rewards
from refppo.core.value import value_loss
from refppo.errors import RefPPOError
from refppo.oracle.compare import compare
from refppo.oracle.diagnose import ALTERNATIVES, CLAMP_BUNDLES, alt_json, check
from refppo.oracle.load import TOLERANCES, Dump
from refppo.oracle.recompute import (
    approx_kl_k2_all_positions,
    clipped_scores,
    pg_tie_share,
    vf_tie_widen,
    whiten,
)
from refppo.oracle.settings import Setup
from refppo.pipeline import value_mask

VALUE_CLIP_FORMS: tuple[str, ...] = tuple(f.value for f in ValueClipForm)
"""The forms of the clipped value searched (``around_old``: verl/TRL; ``delta``: OpenRLHF/SkyRL/AReaL)."""

MAX_EQUIV = 256
"""Equivalent conventions kept per group (the rest are counted)."""
NEAREST = 3
"""Groups kept after a stage that no group reproduces."""


@dataclass
class Group:
    """Candidates whose outputs so far are identical: their partial conventions and shared state."""

    convs: list[dict[str, Any]]
    n_equiv: int
    state: dict[str, Any]
    worst: float = 0.0
    """Largest err/tol ratio over the quantities checked so far (0 = all matched exactly)."""
    unmatched: list[str] = field(default_factory=list)


@dataclass
class Detection:
    """The outcome of ``--detect``."""

    detected: list[dict[str, Any]]
    n_detected: int
    nearest: dict[str, Any] | None
    unmatched_stages: list[str]
    undetermined: list[str]


def _digest(*parts: Any) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        if isinstance(p, Tensor):
            h.update(p.detach().contiguous().numpy().tobytes())
        else:
            h.update(repr(p).encode())
        h.update(b"|")
    return h.digest()


class _Search:
    def __init__(self, dump: Dump, base: Setup) -> None:
        self.dump = dump
        self.base = base
        self.t = dump.tensors
        self.m = dump.mask
        self.hp = base.hp
        self.tol = TOLERANCES[dump.dtype]
        self.unmatched: list[str] = []

    # ----- helpers -------------------------------------------------------------------------
    def _ratio(
        self, name: str, ref: Tensor, cmp_mask: Tensor | None, widen: Callable[[], float] | None = None
    ) -> float | None:
        if not self.dump.has(name):
            return None
        r = compare(name, self.t[name], ref, cmp_mask, self.tol)
        if not r.ok and widen is not None:
            r = compare(name, self.t[name], ref, cmp_mask, self.tol, widen=widen())
        if r.ok:
            return 0.0
        return r.max_abs_err / r.tol if r.tol > 0 else float("inf")

    def _expand(
        self,
        groups: list[Group],
        options: Callable[[Group], Iterable[tuple[dict[str, Any], dict[str, Any], bytes]]],
        checks: Callable[[dict[str, Any]], list[float | None]],
        stage: str,
    ) -> list[Group]:
        """Expand each group by ``options`` (``(conv update, new state, digest)``), merge, filter."""
        merged: dict[bytes, Group] = {}
        for g in groups:
            for upd, st, key in options(g):
                new_convs = [{**c, **upd} for c in g.convs]
                if key in merged:
                    tgt = merged[key]
                    room = MAX_EQUIV - len(tgt.convs)
                    tgt.convs.extend(new_convs[: max(room, 0)])
                    tgt.n_equiv += g.n_equiv
                    tgt.worst = min(tgt.worst, g.worst)
                    continue
                merged[key] = Group(new_convs, g.n_equiv, st, g.worst, list(g.unmatched))
        out = list(merged.values())
        scored: list[tuple[float, Group]] = []
        any_check = False
        for g in out:
            ratios = [r for r in checks(g.state) if r is not None]
            any_check = any_check or bool(ratios)
            scored.append((max(ratios) if ratios else 0.0, g))
        if not any_check:
            return out
        ok = [g for s, g in scored if s == 0.0]
        if ok:
            return ok
        self.unmatched.append(stage)
        scored.sort(key=lambda sg: max(sg[0], sg[1].worst))
        kept = []
        for s, g in scored[:NEAREST]:
            g.worst = max(g.worst, s)
            g.unmatched.append(stage)
            kept.append(g)
        return kept

    # ----- stages -------------------------------------------------------------------------
    def run(self) -> list[Group]:
        t, m, hp = self.t, self.m, self.hp
        clamp_opts = list(CLAMP_BUNDLES.values())
        own = {
            "kl_log_ratio_clamp": self.base.conv.kl_log_ratio_clamp,
            "kl_value_clamp": self.base.conv.kl_value_clamp,
        }
        if own not in clamp_opts:
            clamp_opts.append(own)
        has_lp = "logprobs" in t

        def kl_opts(g: Group) -> Iterable[tuple[dict[str, Any], dict[str, Any], bytes]]:
            for est in ("k1", "k2", "k3", "abs"):
                for cl in clamp_opts:
                    kw = {"log_ratio_clamp": cl["kl_log_ratio_clamp"], "value_clamp": cl["kl_value_clamp"]}
                    try:
                        kl_old = token_kl(t["old_logprobs"], t["ref_logprobs"], m, est, **kw)
                        kl_cur = token_kl(t["logprobs"], t["ref_logprobs"], m, est, **kw) if has_lp else None
                    except RefPPOError:
                        continue
                    key = _digest(kl_old, kl_cur)
                    st = {"kl": kl_old, "kl_cur": kl_cur, "kl_key": key}
                    yield {"kl_estimator": est, **cl}, st, key

        groups = [Group([{}], 1, {})]
        groups = self._expand(groups, kl_opts, lambda s: [self._ratio("kl", s["kl"], m)], "kl")

        clip_opts: list[float | None] = [None, 5.0, 10.0]
        if self.base.extras.score_clip not in clip_opts:
            clip_opts.append(self.base.extras.score_clip)

        def reward_opts(g: Group) -> Iterable[tuple[dict[str, Any], dict[str, Any], bytes]]:
            for kl_in in ("reward", "loss"):
                for score_at in ("last_valid", "after_last_valid", "last_position"):
                    for sc in clip_opts:
                        scores = clipped_scores(t["scores"], sc)
                        use_kl = kl_in == "reward" and hp.kl_coef > 0
                        r = token_rewards(
                            scores, g.state["kl"] if use_kl else None, m, hp.kl_coef, score_at=score_at
                        )
                        vm = value_mask(m, ScorePosition(score_at))
                        st = {**g.state, "rewards": r, "vm": vm, "kl_in": kl_in}
                        key = _digest(g.state["kl_key"], r, vm, kl_in)
                        yield {"kl_in": kl_in, "score_at": score_at, "score_clip": sc}, st, key

        groups = self._expand(
            groups,
            reward_opts,
            lambda s: [self._ratio("token_rewards", s["rewards"], s["vm"])],
            "token_rewards",
        )

        def gae_opts(g: Group) -> Iterable[tuple[dict[str, Any], dict[str, Any], bytes]]:
            adv_raw, ret = gae(g.state["rewards"], t["old_values"], g.state["vm"], gamma=hp.gamma, lam=hp.lam)
            ret_key = _digest(ret, g.state["vm"])
            st = {**g.state, "adv_raw": adv_raw, "returns": ret, "ret_key": ret_key}
            yield {}, st, _digest(g.state["kl_key"], g.state["kl_in"], ret_key, adv_raw)

        groups = self._expand(
            groups, gae_opts, lambda s: [self._ratio("returns", s["returns"], s["vm"])], "returns"
        )

        whiten_opts = [("none", self.base.conv.whiten_variance.value)]
        whiten_opts += [(w, v) for w in ("masked", "masked_no_shift") for v in ("unbiased", "population")]

        def whiten_f(g: Group) -> Iterable[tuple[dict[str, Any], dict[str, Any], bytes]]:
            for w, v in whiten_opts:
                upd = {"whiten_advantages": w, "whiten_variance": v}
                try:
                    adv = whiten(g.state["adv_raw"], m, self.base.with_convention(upd))
                except RefPPOError:
                    continue
                st = {**g.state, "adv": adv}
                yield upd, st, _digest(g.state["kl_key"], g.state["kl_in"], g.state["ret_key"], adv)

        groups = self._expand(
            groups, whiten_f, lambda s: [self._ratio("advantages", s["adv"], m)], "advantages"
        )
        if not ("logprobs" in t or "values" in t):
            return groups

        logprobs = t.get("logprobs", t["old_logprobs"])
        values = t.get("values", t["old_values"])
        duals: list[float | None] = [None, 3.0]
        if self.base.conv.dual_clip not in duals:
            duals.append(self.base.conv.dual_clip)
        lrcs: list[float | None] = [None, 20.0]
        if self.base.conv.log_ratio_clamp not in lrcs:
            lrcs.append(self.base.conv.log_ratio_clamp)
        aggs = [a["loss_agg"] for a in ALTERNATIVES["loss_agg"]]
        norm = {"horizon": hp.horizon} if hp.horizon is not None else {}
        entropy = t.get("entropy")

        # Work shared by every candidate of the policy stage, done once.
        d_valid = torch.where(m, logprobs - t["old_logprobs"], torch.zeros((), dtype=logprobs.dtype))
        max_abs_d = float(d_valid.abs().max())
        ak2 = approx_kl_k2_all_positions(logprobs, t["old_logprobs"], m) if has_lp else None
        ent_by_agg = {a: aggregate_loss(entropy, m, a, **norm) for a in aggs} if entropy is not None else {}
        kll_cache: dict[tuple[bytes, str], Tensor] = {}
        widen_cache: dict[tuple[int, float | None], float] = {}

        def policy_opts(g: Group) -> Iterable[tuple[dict[str, Any], dict[str, Any], bytes]]:
            adv = g.state["adv"]
            computed: dict[tuple[float | None, float | None], Any] = {}
            for dual in duals:
                for lrc in lrcs:
                    # A clamp that never binds, or a dual clip that never acts, changes nothing:
                    # reuse the result instead of recomputing it.
                    eff_lrc = lrc if (lrc is not None and max_abs_d > lrc) else None
                    eff_dual = dual
                    if dual is not None and dual > 1.0 + (hp.cliprange_high or hp.cliprange):
                        ratio = torch.exp(
                            d_valid if eff_lrc is None else torch.clamp(d_valid, -eff_lrc, eff_lrc)
                        )
                        if not bool((m & (adv < 0) & (ratio > dual)).any()):
                            eff_dual = None
                    if (eff_dual, eff_lrc) not in computed:
                        computed[(eff_dual, eff_lrc)] = clipped_policy_loss(
                            logprobs,
                            t["old_logprobs"],
                            adv,
                            m,
                            clip_low=hp.cliprange,
                            clip_high=hp.cliprange_high,
                            dual_clip=eff_dual,
                            log_ratio_clamp=eff_lrc,
                        )
                    out = computed[(eff_dual, eff_lrc)]
                    for agg in aggs:
                        pg = aggregate_loss(out.per_token, m, agg, **norm).detach()
                        ent = ent_by_agg.get(agg)
                        kll = None
                        if g.state["kl_in"] == KLPlacement.LOSS.value and g.state["kl_cur"] is not None:
                            ck = (g.state["kl_key"], agg)
                            if ck not in kll_cache:
                                kll_cache[ck] = aggregate_loss(g.state["kl_cur"], m, agg, **norm)
                            kll = kll_cache[ck]
                        for ak in ("k1", "k2_all_positions"):
                            akl = out.approx_kl if ak == "k1" else ak2
                            st = {
                                "returns": g.state["returns"],
                                "ret_key": g.state["ret_key"],
                                "vm": g.state["vm"],
                                "kl_in": g.state["kl_in"],
                                "pg_loss": pg,
                                "pg_clipfrac": out.clipfrac,
                                "approx_kl": akl,
                                "entropy_loss": ent,
                                "kl_loss": kll,
                                "agg": agg,
                                "adv": adv,
                                "lrc": eff_lrc,
                            }
                            key = _digest(g.state["ret_key"], pg, out.clipfrac, akl, ent, kll, agg)
                            upd = {
                                "dual_clip": dual,
                                "log_ratio_clamp": lrc,
                                "loss_agg": agg,
                                "approx_kl": ak,
                            }
                            yield upd, st, key

        def policy_checks(s: dict[str, Any]) -> list[float | None]:
            if not has_lp:
                return []

            def pg_widen() -> float:
                ck = (id(s["adv"]), s["lrc"])
                if ck not in widen_cache:
                    setup = self.base.with_convention({"log_ratio_clamp": s["lrc"]})
                    widen_cache[ck] = float(
                        pg_tie_share(logprobs, t["old_logprobs"], s["adv"], m, setup, self.tol.rtol)
                    )
                return widen_cache[ck]

            pg_r = self._ratio("pg_loss", s["pg_loss"], None)
            out = [pg_r]
            # Only a candidate whose pg_loss matches needs the (costlier) tie-widened clipfrac check.
            if pg_r is None or pg_r == 0.0:
                out.append(self._ratio("pg_clipfrac", s["pg_clipfrac"], None, pg_widen))
            else:
                out.append(self._ratio("pg_clipfrac", s["pg_clipfrac"], None))
            out.append(self._ratio("approx_kl", s["approx_kl"], None))
            if s["entropy_loss"] is not None:
                out.append(self._ratio("entropy_loss", s["entropy_loss"], None))
            return out

        groups = self._expand(groups, policy_opts, policy_checks, "policy")

        # value_loss_agg: None (= the policy's loss_agg) or, only when the dump has values to
        # check it against, each other mode (re-aggregating the per-token loss; no recompute).
        # The "same as loss_agg" option keeps the base's spelling when it names that mode.
        value_aggs_all = [a["value_loss_agg"] for a in ALTERNATIVES["value_loss_agg"]]
        own_vagg = self.base.conv.value_loss_agg
        own_vagg_name = None if own_vagg is None else own_vagg.value

        # value_clip_form only matters for a clipped loss: the unclipped one keeps the base's form.
        own_form = self.base.conv.value_clip_form.value
        value_kinds = [("clipped", f) for f in VALUE_CLIP_FORMS] + [("unclipped", own_form)]

        def value_opts(g: Group) -> Iterable[tuple[dict[str, Any], dict[str, Any], bytes]]:
            vaggs: list[str | None] = [own_vagg_name if own_vagg_name == g.state["agg"] else None]
            if "values" in t:
                vaggs += [a for a in value_aggs_all if a is not None and a != g.state["agg"]]
            for vl, form in value_kinds:
                for vfm in ("value", "response"):
                    mask = g.state["vm"] if vfm == "value" else m
                    out = value_loss(
                        values,
                        t["old_values"],
                        g.state["returns"],
                        mask,
                        clip=hp.cliprange_value,
                        kind=vl,
                        agg=g.state["agg"],
                        clip_form=form,
                        **norm,
                    )
                    for vagg in vaggs:
                        if vagg is None or vagg == g.state["agg"]:
                            vf = out.loss.detach()
                        else:
                            vf = aggregate_loss(out.per_token, mask, vagg, **norm).detach()
                        st = {**g.state, "vf_loss": vf, "vf_clipfrac": out.clipfrac, "vf_m": mask}
                        st["vl"] = vl
                        key = _digest(
                            *(
                                g.state[k]
                                for k in ("pg_loss", "pg_clipfrac", "approx_kl", "entropy_loss", "kl_loss")
                            ),
                            st["vf_loss"],
                            st["vf_clipfrac"],
                        )
                        upd = {"value_loss": vl, "value_clip_form": form, "vf_mask": vfm}
                        yield {**upd, "value_loss_agg": vagg}, st, key

        def value_checks(s: dict[str, Any]) -> list[float | None]:
            if "values" not in t:
                return []

            def vf_widen() -> float:
                if s["vl"] != "clipped":
                    return 0.0
                return vf_tie_widen(
                    values, t["old_values"], s["returns"], s["vf_m"], hp.cliprange_value, self.tol.rtol
                )

            return [
                self._ratio("vf_loss", s["vf_loss"], None),
                self._ratio("vf_clipfrac", s["vf_clipfrac"], None, vf_widen),
            ]

        groups = self._expand(groups, value_opts, value_checks, "value")

        def loss_opts(g: Group) -> Iterable[tuple[dict[str, Any], dict[str, Any], bytes]]:
            s = g.state
            total = s["pg_loss"] + hp.vf_coef * s["vf_loss"]
            if s["entropy_loss"] is not None:
                total = total - hp.ent_coef * s["entropy_loss"]
            if s["kl_loss"] is not None:
                total = total + hp.kl_coef * s["kl_loss"]
            st = {**s, "loss": total}
            yield {}, st, _digest(total, s["pg_loss"], s["vf_loss"], s["kl_loss"])

        def loss_checks(s: dict[str, Any]) -> list[float | None]:
            out: list[float | None] = []
            if has_lp and "values" in t:
                out.append(self._ratio("loss", s["loss"], None))
            if s["kl_loss"] is not None:
                out.append(self._ratio("kl_loss", s["kl_loss"], None))
            return out

        groups = self._expand(groups, loss_opts, loss_checks, "loss")
        return groups


def _full(base: dict[str, Any], partial: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    out.update(alt_json(partial))
    for k, v in out.items():
        out[k] = getattr(v, "value", v)
        if isinstance(out[k], tuple):
            out[k] = list(out[k])
    return out


def _distance(base: dict[str, Any], conv: dict[str, Any]) -> int:
    return sum(1 for k in conv if conv[k] != base.get(k))


VERIFIED = 5
"""How many detected conventions (closest to the base first) are re-checked through the pipeline."""


def detect(dump: Dump, base: Setup, *, limit: int = 50) -> Detection:
    """Search the convention space around ``base`` (its hyperparameters are kept fixed)."""
    search = _Search(dump, base)
    groups = search.run()
    base_json = _full(base.convention_dict(), {})
    matched = [g for g in groups if not g.unmatched and g.worst == 0.0]
    if matched:
        seen: set[str] = set()
        convs: list[dict[str, Any]] = []
        for g in matched:
            for c in g.convs:
                full = _full(base_json, c)
                key = repr(sorted(full.items()))
                if key not in seen:
                    seen.add(key)
                    convs.append(full)
        convs.sort(key=lambda c: _distance(base_json, c))
        head = [
            c
            for c in convs[:VERIFIED]
            if check(dump, setup_from_json(base, c), explain_divergence=False).match
        ]
        # every re-checked candidate failing means the staged search itself is off: trust none of it
        convs = head + convs[VERIFIED:] if head else []
        n_total = sum(g.n_equiv for g in matched)
        undetermined = sorted(k for k in base_json if len({repr(c.get(k)) for c in convs}) > 1)
        if convs:
            return Detection(convs[:limit], max(n_total, len(convs)), None, [], undetermined)
    best = min(groups, key=lambda g: g.worst) if groups else None
    nearest = _full(base_json, best.convs[0]) if best is not None else None
    return Detection([], 0, nearest, list(dict.fromkeys(search.unmatched)), [])


def setup_from_json(base: Setup, conv: dict[str, Any]) -> Setup:
    """A setup with the convention keys of a detected/nearest dict (hyperparameters from ``base``)."""
    upd = {k: (tuple(v) if isinstance(v, list) else v) for k, v in conv.items()}
    return base.with_convention(upd)


__all__ = ["Detection", "detect", "setup_from_json"]
