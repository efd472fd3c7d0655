"""The value and loss steps of ``--detect``.

* value (the value and value_agg stages): every :class:`ValueLoss` member, every
  :class:`ValueClipForm` member for the clipped loss, every :class:`VfMask` member, and
  ``value_loss_agg`` (like ``loss_agg``, or, when the dump has ``values`` to check it against, every
  other :class:`LossAgg` member). When none reproduces ``vf_loss`` (and ``vf_clipfrac``),
  :func:`refppo.oracle.detect.solve_value.solve_value_clip` reads the value clip range ``ε_v`` off the data
  and the step is walked again with it.
* loss (the kl_loss and total stages): ``kl_loss_agg`` (like ``loss_agg``, or every other mode
  when the KL is in the loss) and the total; a separate critic's dumped ``loss`` is the actor's
  objective, the total with a value weight of 0.

The value stage's per-token loss is made once per ``(returns, value loss, clip form, mask, ε_v)``
and aggregated under every mode by the value_agg stage (memoised across groups by the returns'
digest: scalars only).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from refppo.agg_conventions import MASK_AGGS
from refppo.conventions import ValueClipForm, ValueLoss, VfMask
from refppo.oracle.check.settings import Setup
from refppo.oracle.check.ties import delta_rounding_ties, vf_tie_widen
from refppo.oracle.detect.grad_fit import GradFit
from refppo.oracle.detect.grad_solve import propose_value_grad
from refppo.oracle.detect.groups import Group, Option
from refppo.oracle.detect.policy import kl_loss_stage
from refppo.oracle.detect.policy_kl import loss_beta_note
from refppo.oracle.detect.search import SOLVE_GROUPS, Search
from refppo.oracle.detect.solve import loss_weights
from refppo.oracle.detect.solve_value import ValueKnots, solve_value_clip
from refppo.oracle.detect.states import Carried, LossState, PolicyState, ValueState, digest
from refppo.pipeline.blocks import Evaluation, Normalisers, update_rows

VALUE_AGGS: list[str | None] = [None, *(a.value for a in MASK_AGGS)]
"""``value_loss_agg``: None (= ``loss_agg``) or every mode."""


class ValueEval:
    """The value step's evaluations through the stages, memoised by what determines each."""

    def __init__(self, s: Search, memoise: bool = True) -> None:
        self.s = s
        self.memoise = memoise
        """Whether :meth:`losses` keeps its results (the value step reads them again for every
        policy group on the same returns; the prune reads each returns once and keeps a bool)."""
        t = s.t
        self.values = t.get("values", t["old_values"])
        self.logprobs = t.get("logprobs", t["old_logprobs"])
        self.memo: dict[tuple[Any, ...], tuple[Tensor, dict[str, Tensor]]] = {}
        self.widen: dict[tuple[Any, ...], float] = {}
        self.ties: dict[tuple[Any, ...], bool] = {}

    def delta_ties(self, ca: Carried, vfm: VfMask, clip: float) -> bool:
        """Whether some token's ``value_clip_form=delta`` count is a rounding tie
        (:func:`refppo.oracle.check.ties.delta_rounding_ties`) on these returns, mask and ``ε_v``:
        then the ``vf_clipfrac`` comparison widens by the form (:func:`vf_tie_widen`), so options of
        the two forms with bit-identical scalars are kept apart (by row blocks: no ``[B, T]``
        temporaries of the whole batch)."""
        key = (ca.ret_key, vfm, clip)
        if key not in self.ties:
            mask, old = self.mask(ca, vfm), self.s.t["old_values"]
            B = mask.shape[0]
            step = update_rows(mask) or B
            blocks = (slice(i, min(i + step, B)) for i in range(0, B, step))
            self.ties[key] = any(
                bool(delta_rounding_ties(self.values[r], old[r], ca.returns[r], mask[r], clip).any())
                for r in blocks
            )
        return self.ties[key]

    def mask(self, ca: Carried, vfm: VfMask) -> Tensor:
        return self.s.m if vfm is VfMask.RESPONSE else ca.vm

    def losses(
        self, ca: Carried, vl: str, form: str, vfm: VfMask, clip: float, modes: list[str]
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """``(vf_clipfrac, {mode: vf_loss})``: the value stage on the returns of ``ca``, then the
        value_agg stage under each of ``modes`` (``value_loss_agg``)."""
        s = self.s
        key = (ca.ret_key, vl, form, vfm, clip)
        hit = self.memo.get(key)
        if hit is not None and all(a in hit[1] for a in modes):
            return hit
        q = {
            "values": self.values, "old_values": s.t["old_values"], "returns": ca.returns,
            "value_mask": ca.vm, "mask": s.m, "logprobs": self.logprobs,
        }  # fmt: skip
        st = s.setting(value_loss=vl, value_clip_form=form, vf_mask=vfm.value, cliprange_value=clip)
        out = s.evaluate("value", q, st)
        qa = {
            "vf_per_token": out["vf_per_token"],
            "vf_loss_mask": out["vf_loss_mask"],
            "logprobs": self.logprobs,
        }
        ev = s.ev_counts(out["vf_loss_mask"])
        vfs = dict(hit[1]) if hit is not None else {}
        for a in modes:
            if a not in vfs:
                vfs[a] = s.evaluate("value_agg", qa, s.setting(value_loss_agg=a), ev)["vf_loss"].detach()
        if self.memoise:
            self.memo[key] = (out["vf_clipfrac"], vfs)
        return out["vf_clipfrac"], vfs


def _value_options(
    ve: ValueEval, clips: list[float]
) -> Callable[[Group[PolicyState]], Iterable[Option[ValueState]]]:
    s = ve.s
    own_vagg = s.base.conv.agg.value
    own_name = None if own_vagg is None else own_vagg.value
    kinds = value_kinds(s)

    def opts(g: Group[PolicyState]) -> Iterable[Option[ValueState]]:
        ps = g.state
        agg = ps.agg.value
        vaggs: list[str | None] = [own_name if own_name == agg else None]
        if "values" in s.t:
            vaggs += [a for a in VALUE_AGGS if a is not None and a != agg]
        modes = [agg if v is None else v for v in vaggs]
        for clip in clips:
            for vl, form in kinds:
                for vfm in VfMask:
                    clipfrac, vfs = ve.losses(ps.carried, vl, form, vfm, clip, modes)
                    for vagg, mode in zip(vaggs, modes, strict=True):
                        vset: dict[str, Any] = {
                            "value_loss": vl,
                            "value_clip_form": form,
                            "vf_mask": vfm.value,
                        }
                        vset.update(value_loss_agg=vagg, cliprange_value=clip)
                        st = ValueState(
                            ps, vfs[mode], clipfrac, ve.mask(ps.carried, vfm), vl == "clipped", clip, vset
                        )
                        # the forms apart where their clipfrac widenings differ (delta's rounding ties)
                        apart = form if vl == "clipped" and ve.delta_ties(ps.carried, vfm, clip) else ""
                        key = digest(
                            ps.pg_loss,
                            ps.pg_clipfrac,
                            ps.approx_kl,
                            ps.entropy_loss,
                            ps.kl_loss,
                            st.vf_loss,
                            clipfrac,
                            apart,
                        )
                        upd: dict[str, Any] = {
                            "value_loss": vl,
                            "value_clip_form": form,
                            "vf_mask": vfm.value,
                        }
                        if clip != s.hp.cliprange_value:
                            upd["cliprange_value"] = clip
                        yield {**upd, "value_loss_agg": vagg}, st, key

    return opts


def value_step(s: Search, groups: list[Group[PolicyState]]) -> list[Group[ValueState]]:
    """``vf_loss`` and ``vf_clipfrac``: ``value_loss`` × ``value_clip_form`` × ``vf_mask`` ×
    ``value_loss_agg`` on each group (the setting's ``ε_v``, then the solver's)."""
    ve = ValueEval(s)
    gf = GradFit(s)
    t = s.t

    def make(extra: list[float] | None) -> Callable[[Group[PolicyState]], Iterable[Option[ValueState]]]:
        return _value_options(ve, list(dict.fromkeys([s.hp.cliprange_value, *(extra or [])])))

    def checks(st: ValueState) -> list[float | None]:
        if "values" not in t:
            return []
        ca = st.policy.carried

        def widen() -> float:
            if not st.clipped or st.vf_mask is None:
                return 0.0
            form = st.setting.get("value_clip_form") or s.base.conv.value.clip_form.value
            key = (ca.ret_key, id(st.vf_mask), st.vclip, form)  # vf_mask: the walk's own mask tensors
            if key not in ve.widen:
                ve.widen[key] = vf_tie_widen(
                    ve.values, t["old_values"], ca.returns, st.vf_mask, st.vclip, s.tol.rtol, form
                )
            return ve.widen[key]

        out = [s.ratio("vf_loss", st.vf_loss, None), s.ratio("vf_clipfrac", st.vf_clipfrac, None, widen)]
        if all(r is None or r == 0.0 for r in out):  # the gradient only where every scalar agrees
            out.append(gf.value_ratio(st))
        return out

    return s.stage(groups, make, checks, "value", lambda gs: _propose_value_clip(ve, gs))


def _propose_value_clip(ve: ValueEval, groups: list[Group[PolicyState]]) -> list[float]:
    """Value clip ranges under which ``vf_loss`` is reproduced, per group (the first
    :data:`SOLVE_GROUPS`), mask and aggregation (the value_agg stage's weights)."""
    s, t = ve.s, ve.s.t
    if "values" in t and "vf_loss" not in t:  # a v2 dump without the scalar: the gradient's
        return propose_value_grad(s, groups)
    if "values" not in t or "vf_loss" not in t:
        return []
    own = s.base.conv.agg.value
    found: list[float] = []
    knots: dict[bytes, ValueKnots] = {}  # by content: the groups often carry the same returns
    solved: set[tuple[bytes, str]] = set()
    for g in groups[:SOLVE_GROUPS]:
        ps = g.state
        aggs: list[str | None] = [ps.agg.value, *(VALUE_AGGS if own is None else [own.value])]
        for vfm in VfMask:
            mask = ve.mask(ps.carried, vfm)
            key = digest(ps.carried.returns, mask)
            if key not in knots:
                knots[key] = ValueKnots.of(ve.values, t["old_values"], ps.carried.returns, mask)
            for agg in dict.fromkeys(a for a in aggs if a is not None):
                if (key, agg) in solved:
                    continue  # the same returns, mask and weights: the same proposals (deduplicated below)
                solved.add((key, agg))
                st = s.setting(value_loss_agg=agg)

                def fn(x: Tensor, st: Setup = st, mask: Tensor = mask) -> Tensor:
                    q = {"vf_per_token": x, "vf_loss_mask": mask, "logprobs": ve.logprobs}
                    out: Tensor = s.evaluate(
                        "value_agg", q, st, Evaluation(norm=Normalisers(seq_count=s.ev.norm.seq_count))
                    )["vf_loss"]
                    return out

                w = loss_weights(fn, mask, torch.float64)
                terms = knots[key].weighted(w[mask])
                found += solve_value_clip(terms, float(t["vf_loss"]), s.tol.of(float(t["vf_loss"])))
    found = [c for c in dict.fromkeys(found) if c != s.hp.cliprange_value][:8]
    for c in found:
        s.propose_value("cliprange_value", c)
    return found


def no_critic(s: Search, groups: list[Group[PolicyState]]) -> list[Group[ValueState]]:
    """No critic: no value loss (without values the value stage makes no per-token loss, which the
    value_agg stage aggregates to 0)."""
    q = {"vf_per_token": None, "vf_loss_mask": s.m, "logprobs": s.t["logprobs"]}
    vf = s.evaluate("value_agg", q, s.base)["vf_loss"]
    clip = s.hp.cliprange_value
    return [g.map_state(lambda ps: ValueState(ps, vf, vf, None, False, clip)) for g in groups]


def loss_step(s: Search, groups: list[Group[ValueState]]) -> list[Group[LossState]]:
    """``loss`` and ``kl_loss``: the total of every term, and ``kl_loss_agg``."""
    t = s.t
    has_lp = "logprobs" in t
    own_kagg = {} if s.base.conv.agg.kl is None else {"kl_loss_agg": None}
    kll: dict[tuple[bytes, str, str], Tensor | None] = {}
    totals: dict[str, Setup] = {}
    betas_seen: set[bytes] = set()

    def total_setting(kl_in: str) -> Setup:
        """A separate critic's dumped ``loss`` is the actor's objective, without the value term
        (a weight of 0, as the recompute's reference)."""
        if kl_in not in totals:
            st = s.setting(kl_in=kl_in)
            totals[kl_in] = replace(st, hp=replace(st.hp, vf_coef=0.0)) if s.dump.step.separate_critic else st
        return totals[kl_in]

    def kl_loss_mode(ca: Carried, agg: str, kagg: str) -> Tensor | None:
        key = (ca.kl_key, agg, kagg)
        if key not in kll:
            kll[key] = kl_loss_stage(s, ca.kl_setting, agg, kagg)
        return kll[key]

    def opts(g: Group[ValueState]) -> Iterable[Option[LossState]]:
        vs = g.state
        ps = vs.policy
        agg = ps.agg.value
        # kl_loss_agg: the policy step aggregated the KL loss like pg_loss (None); SkyRL's KL loss
        # keeps its own mode (skyrl_train ppo_utils), so every other mode is walked too
        kls: list[tuple[dict[str, Any], Tensor | None]] = [(own_kagg, ps.kl_loss)]
        if ps.kl_loss is not None:
            ca = ps.carried
            kls += [({"kl_loss_agg": a.value}, kl_loss_mode(ca, agg, a.value)) for a in MASK_AGGS if a != agg]
        for upd, kl_loss in kls:
            q = dict(pg_loss=ps.pg_loss, vf_loss=vs.vf_loss, entropy_loss=ps.entropy_loss, kl_loss=kl_loss)
            tset = total_setting(ps.carried.kl_in.value)
            total = s.evaluate("total", q, tset)["loss"]
            loss_beta_note(s, q, tset, total, betas_seen)  # the KL loss's own β: noted when it alone differs
            yield upd, LossState(vs, total, kl_loss), digest(total, ps.pg_loss, vs.vf_loss, kl_loss)
            # kl_metric_agg: the logged KL (the dumped kl_loss) aggregated unlike the term (TRL GRPO)
            term = str(upd.get("kl_loss_agg") or agg)
            for a in MASK_AGGS if kl_loss is not None else ():
                if a.value != term:
                    metric = kl_loss_mode(ps.carried, agg, a.value)
                    st = LossState(vs, total, metric)
                    yield {**upd, "kl_metric_agg": a.value}, st, digest(total, ps.pg_loss, vs.vf_loss, metric)

    def checks(st: LossState) -> list[float | None]:
        out: list[float | None] = []
        if has_lp and ("values" in t or "old_values" not in t):
            out.append(s.ratio("loss", st.loss, None))
        if st.kl_loss is not None:
            out.append(s.ratio("kl_loss", st.kl_loss, None))
        return out

    return s.expand(groups, opts, checks, "loss")


def value_kinds(s: Search) -> list[tuple[str, str]]:
    """``(value_loss, value_clip_form)`` walked: every clip form for the clipped loss, the checked
    form for the others (it changes nothing there)."""
    own_form = s.base.conv.value.clip_form.value
    kinds = [
        (vl.value, f.value) for vl in ValueLoss for f in (ValueClipForm if vl is ValueLoss.CLIPPED else [])
    ]
    return kinds + [(vl.value, own_form) for vl in ValueLoss if vl is not ValueLoss.CLIPPED]


__all__ = ["VALUE_AGGS", "ValueEval", "loss_step", "no_critic", "value_kinds", "value_step"]
