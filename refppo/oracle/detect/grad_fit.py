"""The gradient checks of ``--detect`` (dump v2): a candidate's ``grad_logprobs`` / ``grad_values``
compared with the dump's, where the dump holds them.

The reference gradient of a candidate is the oracle's own
(:func:`refppo.oracle.check.grad.reference_grads`: the update stages walked under autograd over the
``B`` rows as one batch, the step's global normalisers, the branch nearest the dump at a clip tie),
under the candidate's setting: its advantages and returns (the group's state), its policy keys, its
``loss_agg``, its KL keys and placement (the policy step), its value keys (the value step). It is
compared at the oracle's gradient tolerance (:func:`refppo.oracle.check.grad.grad_tolerance`, every
position: padding against 0), so a listed candidate passes ``refppo diff``'s gradient check.

    grad_logprobs = ∂(pg_loss + β·kl_loss)/∂l      (the policy step: pg, KL-in-loss terms)
    grad_values   = vf_coef·∂vf_loss/∂V              (the value step)

The gradient is per token, so a candidate is first screened on the first :func:`screen_rows` rows,
with the step's global normalisers (:class:`refppo.pipeline.blocks.Normalisers`: the same per-token
gradient as on the whole batch) and the tie tokens left out, at a tolerance that bounds the whole
batch's from above: a candidate whose gradient matches has ``max|ref| ≤ max|dump| + tol``, so its
tolerance is at most ``τ·max|dump|/(1 − τ)`` (``τ = rtol + atol``); an error above that on the first
rows rejects it without the rest of the batch.

With ``kl_in = loss`` the KL term is aggregated by ``kl_loss_agg`` (walked by the loss step); the
policy step accepts a candidate whose gradient matches under some ``kl_loss_agg``
(:meth:`GradFit.policy_ratio`) and the loss step checks the one it names. A straight-through KL
estimator (``k3+``) has its plain twin's values, so the kl step merges them; the policy step tries
both, and the re-check through the pipeline keeps the one the gradient names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from refppo.agg_conventions import MASK_AGGS
from refppo.conventions import KLEstimator, LossAgg, PolicyLoss
from refppo.core.checks import count_true
from refppo.errors import RefPPOError
from refppo.oracle.check.compare import compare
from refppo.oracle.check.grad import UpdateInputs, grad_tolerance, pipeline_grads, reference_grads
from refppo.oracle.check.grad_diagnose import explain_grad
from refppo.oracle.check.settings import Setup
from refppo.oracle.check.ties import pg_tie_mask, vf_tie_mask
from refppo.oracle.detect.search import Search
from refppo.oracle.detect.states import PolicyState, ValueState
from refppo.pipeline.blocks import Normalisers

SCREEN_ELEMENTS = 1 << 13
"""Elements (rows × T) of the screen's first rows."""


def screen_rows(B: int, T: int) -> int:
    """Rows of the screen: about :data:`SCREEN_ELEMENTS` elements; 0 (no screen) when that is the
    whole batch."""
    n = max(1, SCREEN_ELEMENTS // max(T, 1))
    return 0 if n >= B else n


def kl_twins(kl_setting: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The group's KL keys, then its estimator's straight-through twin (``k3`` ↔ ``k3+``: the same
    values, another gradient; the kl step merged them)."""
    own = dict(kl_setting)
    est = own.get("kl_estimator")
    if est is None:
        return [own]
    e = KLEstimator(est)
    twins = [x for x in KLEstimator if x.base is e.base and x is not e]
    return [own, *({**own, "kl_estimator": x.value} for x in twins)]


class GradFit:
    """The gradient checks of one ``--detect`` search (module docstring)."""

    def __init__(self, s: Search) -> None:
        self.s = s
        t = s.t
        self.lp_on = s.dump.has("grad_logprobs") and "logprobs" in t
        self.v_on = s.dump.has("grad_values") and "values" in t and "old_values" in t
        self.tol = grad_tolerance(s.tol)
        self.memo: dict[tuple[Any, ...], float] = {}
        B, T = s.m.shape
        self.screen = screen_rows(B, T)
        self.head = torch.arange(self.screen)
        self.cap = {n: self._cap(n) for n in ("grad_logprobs", "grad_values") if s.dump.has(n)}
        self.calls = 0
        """Candidates evaluated (screen or full), for tests and profiles."""
        self.screened_out = 0
        """Candidates rejected on the first rows."""

    def _cap(self, name: str) -> float:
        """The largest tolerance a matching candidate can have: ``τ·max|dump|/(1 − τ)``."""
        tau = self.tol.rtol
        peak = float(torch.nan_to_num(self.s.t[name].abs(), nan=math.inf).max())
        return tau * peak / (1.0 - tau) if tau < 1.0 else math.inf

    # ----- the inputs and the setting of a candidate ------------------------------------------------
    def inputs(self, adv: Tensor, returns: Tensor, vf_mask: Tensor) -> UpdateInputs:
        """The update's inputs as the reference walks them (zero stand-ins without a critic)."""
        t, m = self.s.t, self.s.m
        critic = "old_values" in t and "values" in t
        zeros = torch.zeros_like(t["old_logprobs"]) if not critic else None
        values = t["values"] if critic else zeros
        old_values = t["old_values"] if critic else zeros
        assert values is not None and old_values is not None
        return UpdateInputs(
            t["logprobs"], values, t["old_logprobs"], old_values, adv, returns, m, vf_mask,
            t.get("ref_logprobs"), t.get("entropy"), t.get("rollout_logprobs"), t.get("truncated"),
        )  # fmt: skip

    def policy_setting(
        self, ps: PolicyState, kl: Mapping[str, Any], kagg: str | None, agg: LossAgg | None = None
    ) -> Setup:
        """The checked setting with the policy state's keys (``agg``: another ``loss_agg``), its KL
        keys ``kl``, ``kl_loss_agg`` ``kagg`` and the rollout correction off (a corrected state is
        not checked here)."""
        mode = (ps.agg if agg is None else agg).value
        upd: dict[str, Any] = {**ps.setting, **kl, "loss_agg": mode, "kl_loss_agg": kagg}
        upd.update(kl_in=ps.carried.kl_in.value, rollout_is=None)
        return self.s.setting(**upd)

    # ----- the comparison ----------------------------------------------------------------------
    def ratio(self, name: str, inp: UpdateInputs, setup: Setup, is_w: Tensor | None = None) -> float:
        """``max error / tolerance`` of the reference ``name`` under ``setup`` (0: within it). The
        screen first; then the pipeline's gradient, and only when that differs and some token sits
        at a clip tie, :func:`reference_grads`' branch nearest the dump there (two more passes).
        ``is_w``: a rollout correction's weight ``w'`` (:meth:`corrected`; its clip ties left out)."""
        self.calls += 1
        t, ones = self.s.t, torch.ones_like(self.s.m)
        try:
            if self.screen and self._screen_fails(name, inp, setup, is_w):
                self.screened_out += 1
                return math.inf
            if is_w is not None:
                tie = self._ties(name, inp, setup)
                cor = torch.where(tie, t[name], self.corrected(inp, setup, is_w, self.s.ev.norm))
                r = compare(name, t[name], cor, ones, self.tol)
                return 0.0 if r.ok else (r.max_abs_err / r.tol if r.tol > 0 else math.inf)
            r = compare(name, t[name], pipeline_grads(inp, setup, norm=self.s.ev.norm)[name], ones, self.tol)
            ties = self._ties(name, inp, setup) if not r.ok else None
            if ties is not None and bool(ties.any()):
                ref = reference_grads(inp, setup, {name: t[name]}, {name: ties})[name]
                r = compare(name, t[name], ref, ones, self.tol)
        except RefPPOError:
            return math.inf  # a refused pairing reproduces nothing
        if r.ok:
            return 0.0
        return r.max_abs_err / r.tol if r.tol > 0 else math.inf

    @staticmethod
    def corrected(inp: UpdateInputs, setup: Setup, is_w: Tensor, norm: Normalisers | None = None) -> Tensor:
        """``grad_logprobs`` with the correction's detached weight ``w'`` on the policy term:
        ``g + (w' − 1)·g_pg`` (``g``: the whole objective's gradient with the correction off,
        ``g_pg``: its ``pg_loss`` term's; the policy stage multiplies ``ℓ_t`` by ``w'_t`` before the
        aggregation, so ``∂pg/∂l_t`` scales by ``w'_t``, and no other term reads ``w'``)."""
        whole = pipeline_grads(inp, setup, norm=norm)["grad_logprobs"]
        pg = pipeline_grads(inp, setup, norm=norm, objective="pg_loss")["grad_logprobs"]
        return whole + (is_w.to(pg.dtype) - 1.0) * pg

    def _ties(self, name: str, inp: UpdateInputs, setup: Setup) -> Tensor:
        rtol = self.s.tol.rtol
        if name == "grad_logprobs":
            return pg_tie_mask(inp.logprobs, inp.old_logprobs, inp.advantages, inp.mask, setup, rtol)
        if setup.conv.value.loss.value != "clipped":
            return torch.zeros_like(inp.mask)
        eps_v = setup.hp.cliprange_value
        return vf_tie_mask(inp.values, inp.old_values, inp.returns, inp.value_mask, eps_v, rtol)

    def _screen_fails(self, name: str, inp: UpdateInputs, setup: Setup, is_w: Tensor | None = None) -> bool:
        """Whether the first rows already exceed :meth:`_cap` (ties left out)."""
        m, vm = self.s.m, inp.value_mask
        norm = Normalisers(
            token_count=float(count_true(m)),
            seq_count=self.s.ev.norm.seq_count or float(m.shape[0]),
            value_token_count=float(count_true(vm)),
        )
        part = inp.take(self.head)
        if is_w is None:
            ref = pipeline_grads(part, setup, norm=norm)[name]
        else:
            ref = self.corrected(part, setup, is_w[: self.screen], norm)
        ties = self._ties(name, part, setup)
        d = self.s.t[name][: self.screen]
        err = torch.where(ties, torch.zeros((), dtype=ref.dtype), (d - ref).abs())
        return bool(torch.nan_to_num(err, nan=math.inf).max() > self.cap[name])

    # ----- the steps' checks --------------------------------------------------------------------
    def policy_ratio(self, ps: PolicyState) -> float | None:
        """``grad_logprobs`` under the policy state: 0 when some KL twin and ``kl_loss_agg`` (with
        ``kl_in = loss``) reproduces it, else the smallest error ratio; None when not checked."""
        if not self.lp_on:
            return None
        ca = ps.carried
        kaggs: list[str | None] = [None]
        if ca.kl_in.in_loss:
            kaggs += [a.value for a in MASK_AGGS if a is not ps.agg]
        key = (
            ps.adv_key,
            ca.ret_key,
            ca.kl_key,
            ca.kl_in,
            tuple(sorted(ps.setting.items())),
            ps.agg,
            ps.is_key,
        )
        if key not in self.memo:
            inp = self.inputs(ps.adv, ca.returns, ca.vm)
            best = math.inf
            for kl in kl_twins(ca.kl_setting):
                for kagg in kaggs:
                    setup = self.policy_setting(ps, kl, kagg)
                    best = min(best, self.ratio("grad_logprobs", inp, setup, ps.is_weights))
                    if best == 0.0:
                        break
                if best == 0.0 or not ca.kl_in.in_loss:
                    break
            self.memo[key] = best
        return self.memo[key]

    def value_ratio(self, vs: ValueState) -> float | None:
        """``grad_values`` under the value state's keys (None: not dumped, no critic, or a state
        without its value keys)."""
        if not self.v_on or not vs.setting or vs.vf_mask is None:
            return None
        ps = vs.policy
        ca = ps.carried
        vkey = tuple(sorted(vs.setting.items()))
        key = ("v", ca.ret_key, ps.agg, vkey)
        if key not in self.memo:
            upd = {**vs.setting, "loss_agg": ps.agg.value}
            try:
                setup = self.s.setting(**upd)
            except RefPPOError:
                self.memo[key] = math.inf
                return math.inf
            inp = self.inputs(ps.adv, ca.returns, vs.vf_mask)
            self.memo[key] = self.ratio("grad_values", inp, setup)
        return self.memo[key]


EXPLAIN_DUALS: tuple[float | None, ...] = (None, 3.0)
"""Dual clips the explanation tries besides the nearest group's (none; verl's and OpenRLHF's c = 3)."""


def _explain_settings(fit: GradFit, states: list[PolicyState]) -> list[tuple[PolicyState, dict[str, Any]]]:
    """``(state, policy keys)`` the explanation tries, nearest first: each state's own keys, then
    the vanilla loss with its clip ranges under each of :data:`EXPLAIN_DUALS` and the checked one."""
    out: list[tuple[PolicyState, dict[str, Any]]] = []
    own_dual = fit.s.base.conv.policy.dual_clip
    for ps in states:
        out.append((ps, dict(ps.setting)))
        for dual in dict.fromkeys([*EXPLAIN_DUALS, own_dual]):
            alt = {**ps.setting, "policy_loss": PolicyLoss.VANILLA.value, "dual_clip": dual}
            if alt != dict(ps.setting):
                out.append((ps, alt))
    return out


def explain_policy(fit: GradFit, states: list[PolicyState]) -> list[str]:
    """Why no convention's gradient reproduces ``grad_logprobs``: the oracle's gradient diagnosis
    (:func:`refppo.oracle.check.grad_diagnose.explain_grad`: a per-micro-batch or per-rank
    normaliser, a constant factor, the clip not in the gradient, … each re-checked through the
    pipeline) under the nearest groups' states (:func:`_explain_settings`) and each ``loss_agg``,
    the first that names a bug; else the dump/reference factors under the nearest. A named bug is
    no convention: ``--detect`` lists none for it."""
    s = fit.s
    head = "policy: no convention's gradient reproduces grad_logprobs"
    first: list[str] = []
    for ps, keys in _explain_settings(fit, states):
        inp = fit.inputs(ps.adv, ps.carried.returns, ps.carried.vm)
        for agg in dict.fromkeys([ps.agg, *MASK_AGGS]):
            setup = fit.policy_setting(
                replace(ps, setting=keys), kl_twins(ps.carried.kl_setting)[0], None, agg
            )
            ref = pipeline_grads(inp, setup, norm=s.ev.norm)["grad_logprobs"]
            res = compare("grad_logprobs", s.t["grad_logprobs"], ref, torch.ones_like(s.m), fit.tol)
            notes, found = explain_grad(s.dump, setup, inp, {"grad_logprobs": res})
            named = [n for n in notes if n.startswith("explained by")]
            if found and named:
                bug = ", ".join(str(f["bug"]) for f in found)
                where = (
                    f"loss_agg={agg.value}, policy_loss={keys['policy_loss']}, dual_clip={keys['dual_clip']}"
                )
                return [
                    f"{head}; under {where} it is a trainer bug, not a convention ({bug}): "
                    + "; ".join(named)
                ]
            if not first:
                first = [f"{head}; under the nearest (loss_agg={agg.value}): " + "; ".join(notes)]
    return first


__all__ = ["SCREEN_ELEMENTS", "GradFit", "explain_policy", "kl_twins", "screen_rows"]
