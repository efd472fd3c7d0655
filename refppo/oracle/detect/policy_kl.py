"""The KL loss's options in the policy step of ``--detect``: the kl_loss stage under the carried KL,
``kl_grad_is_clip`` and, under ``kl_in=both``, the loss's own ``kl_loss_estimator`` and clamps.

``kl_grad_is_clip`` (OpenRLHF 0.11.2 ``unbiased_gradient``) changes no value, only ``grad_logprobs``:
its options get one digest on a dump without the gradient (the listed class says which values the
dump cannot tell apart, the evidence what to dump) and their own where the gradient is dumped (the
policy step's gradient check then keeps the one it reproduces). ``kl_loss_estimator`` (verl 0.9.1
``actor.kl_loss_type`` beside ``algorithm.kl_penalty``) is walked on every ``kl_in=both`` state:
every estimator with every clamp bundle (:data:`refppo.oracle.check.alternatives.CLAMP_BUNDLES`) as
the loss's own ``kl_loss_log_ratio_clamp`` and ``kl_loss_value_clamp``. Where the dump shows the
loss's KL (``kl_loss``, ``loss`` or ``grad_logprobs``) each is evaluated, and the options whose
values (and gradients) are bit-identical merge into one class; elsewhere they all share the carried
KL's value, one class (nothing is evaluated). Under ``kl_in=reward`` there is no KL loss, and under
``kl_in=loss`` the loss's own estimator is ``kl_estimator`` (the kl step walks it): the loss's own
keys are not walked there.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Any

from torch import Tensor

from refppo.conventions import KLEstimator, KLPlacement
from refppo.oracle.check.alternatives import CLAMP_BUNDLES
from refppo.oracle.check.settings import Setup
from refppo.oracle.detect.search import Search
from refppo.oracle.detect.solve import nice
from refppo.oracle.detect.states import Carried, digest

GRAD_IS_CLIPS: tuple[float | None, ...] = (None, 10.0)
"""``kl_grad_is_clip`` values walked (with the checked setting's): none and OpenRLHF 0.11.2's
``c = 10`` (``openrlhf/models/utils.py::compute_approx_kl`` with ``unbiased_gradient``: the KL loss's
gradient times ``min(exp(l − l^old), 10)``)."""
KLVariant = tuple[dict[str, Any], Tensor | None, bytes, tuple[dict[str, Any], ...]]
"""``(convention update, kl_loss, gradient key, class)``: one KL loss option (:meth:`KLLossWalk.variants`)."""
LOSS_KL_KEYS = ("kl_loss_estimator", "kl_loss_log_ratio_clamp", "kl_loss_value_clamp")
"""The KL loss's own estimator and clamps (None: the carried ``kl_estimator``'s)."""


def kl_loss_stage(s: Search, kl_setting: Any, agg: str, kagg: str | None) -> Tensor | None:
    """The kl_loss stage under ``kl_in=loss``, the KL keys ``kl_setting`` (the loss's own keys off),
    ``loss_agg = agg`` and ``kl_loss_agg = kagg``, on the current log-probs."""
    t = s.t
    q = {"logprobs": t["logprobs"], "ref_logprobs": t.get("ref_logprobs"), "mask": s.m}
    q["old_logprobs"] = t["old_logprobs"]  # read by kl_grad_is_clip's weight (the gradient only)
    off = dict.fromkeys(LOSS_KL_KEYS)
    st = s.setting(**off, **kl_setting, kl_in="loss", loss_agg=agg, kl_loss_agg=kagg)
    out: Tensor | None = s.evaluate("kl_loss", q, st, s.ev_counts(s.m))["kl_loss"]
    return out


class KLLossWalk:
    """The KL loss's options of the policy step (module docstring), its values memoised."""

    def __init__(self, s: Search, has_lp: bool) -> None:
        self.s = s
        t = s.t
        self.kll: dict[tuple[bytes, str | None, str], Tensor | None] = {}
        self.on = has_lp and "ref_logprobs" in t
        self.shown = any(k in t for k in ("kl_loss", "loss", "grad_logprobs"))
        self.grads = "grad_logprobs" in t
        self.tables: dict[tuple[bytes, str], list[tuple[dict[str, Any], Tensor | None, bytes]]] = {}
        own = s.base.conv.kl
        self.clips = [c for c in dict.fromkeys([own.grad_is_clip, *GRAD_IS_CLIPS]) if c != own.grad_is_clip]
        # the carried KL's option names the loss's own keys off where the checked setting sets them
        self.base_upd: dict[str, Any] = {} if own.loss_estimator is None else dict.fromkeys(LOSS_KL_KEYS)

    def kl_loss_as(self, kl_key: bytes, kl_setting: Any, agg: str, kagg: str | None) -> Tensor | None:
        """:func:`kl_loss_stage` memoised by the KL's digest ``kl_key``."""
        key = (kl_key, kagg, agg)
        if key not in self.kll:
            self.kll[key] = kl_loss_stage(self.s, kl_setting, agg, kagg)
        return self.kll[key]

    def variants(self, ca: Carried, base: Tensor | None, agg: str) -> list[KLVariant]:
        """``(keys, kl_loss, gradient key, class)`` of the KL loss options under ``loss_agg = agg``:
        the carried KL's ``base`` and, with a KL loss on the current log-probs, each
        ``kl_grad_is_clip`` and (under ``kl_in=both``) each distinct ``kl_loss_estimator`` × clamp
        bundle (:meth:`own_table`), with ``class`` the members of the loss's own keys (each named in
        full) that give the option's value and gradient too: the policy step walks one option per
        distinct value (and gradient, where ``grad_logprobs`` is dumped) and lists the class on the
        groups it keeps (:mod:`refppo.oracle.detect.policy_members`)."""
        if base is None or not self.on:
            return [({}, base, b"", ())]
        own_e = str(ca.kl_setting.get("kl_estimator", self.s.base.conv.kl.estimator.value))
        bkey = digest(own_e if self.grads else "", base)
        losses: list[tuple[dict[str, Any], Tensor | None, bytes]] = [(self.base_upd, base, bkey)]
        table = self.own_table(ca, base, agg) if ca.kl_in is KLPlacement.BOTH else []
        classes: dict[bytes, list[dict[str, Any]]] = {bkey: []}
        for upd, v, dk in table:
            if dk in classes:
                classes[dk].append(upd)
            else:
                classes[dk] = []
                losses.append((upd, v, dk))
        grads = [{}, *({"kl_grad_is_clip": c} for c in self.clips)]
        return [
            ({**lu, **cu}, v, digest(dk, *cu.values()), tuple(classes[dk]))
            for lu, v, dk in losses
            for cu in grads
        ]

    def own_table(
        self, ca: Carried, base: Tensor, agg: str
    ) -> list[tuple[dict[str, Any], Tensor | None, bytes]]:
        """Every ``kl_loss_estimator`` × clamp bundle (:data:`CLAMP_BUNDLES`) as the KL loss's own keys
        (``kl_in=both``), with its value and class key (equal: the same value and, with
        ``grad_logprobs``, the same estimator: a straight-through one differs from its plain twin by
        the gradient alone; a clamp that binds on no token gives the value and gradient without
        it). On a dump that does not show the KL loss (no ``kl_loss``, ``loss`` or
        ``grad_logprobs``) each has the carried ``base``'s value (one class: the dump cannot tell
        them apart; nothing evaluated); else each is evaluated (memoised), a straight-through one as
        its plain twin without ``grad_logprobs`` (the same value). Memoised by the carried KL."""
        key = (ca.kl_key, agg)
        hit = self.tables.get(key)
        if hit is not None:
            return hit
        out: list[tuple[dict[str, Any], Tensor | None, bytes]] = []
        for e, cl in itertools.product(KLEstimator, CLAMP_BUNDLES.values()):
            own = {f"kl_loss_{k.removeprefix('kl_')}": x for k, x in cl.items()}
            v: Tensor | None = base
            if self.shown:
                ev = e if self.grads else e.base
                kls = {"kl_estimator": ev.value, **cl}
                v = self.kl_loss_as(digest(ev.value, *map(str, cl.values())), kls, agg, None)
            out.append(({"kl_loss_estimator": e.value, **own}, v, digest(e.value if self.grads else "", v)))
        self.tables[key] = out
        return out


def loss_beta_note(s: Search, q: dict[str, Any], st: Setup, total: Tensor, seen: set[bytes]) -> None:
    """With a KL loss (the dumped ``kl_loss`` where there is one) whose ``total`` misses the dumped
    ``loss``: the KL loss's own β read off it, ``β_loss = (loss − total|β_loss=0) / kl_loss`` (the total
    is affine in β_loss), noted (one line in ``s.notes``) when the total at the rounded value
    (:func:`refppo.oracle.detect.solve.nice`) reproduces the dump — one equation for one constant:
    *fixed by one equation*, a fit, not a test. Not an option of the walk (``kl_loss_coef`` is not
    among the hyperparameters a listed convention names: ``search.HP_KEYS``), so the note says what
    to rerun with. ``q``: the total stage's inputs, ``st`` its setting; ``seen``: the
    ``(total, kl_loss)`` digests done."""
    kl_loss = q["kl_loss"]
    if kl_loss is None:
        return
    key = digest(total, kl_loss)
    k = float(kl_loss)
    if key in seen or "loss" not in s.t or k == 0.0 or not math.isfinite(k):
        return
    seen.add(key)
    if s.ratio("kl_loss", kl_loss, None) not in (None, 0.0) or s.ratio("loss", total, None) == 0.0:
        return  # its KL term is not the dump's, or its total already matches

    def total_at(b: float) -> Tensor:
        out: Tensor = s.evaluate("total", q, replace(st, hp=replace(st.hp, kl_loss_coef=b)))["loss"]
        return out

    beta = (float(s.t["loss"]) - float(total_at(0.0))) / k
    if not (math.isfinite(beta) and beta >= 0.0):
        return
    for b in nice(beta):
        if s.ratio("loss", total_at(b), None) == 0.0:
            line = (
                f"kl_loss_coef={b:g} reproduces loss where kl_coef={s.hp.kl_coef:g} does not (the KL "
                "loss's own β, kl_in=both: read off the 1 scalar loss, fixed by one equation: a fit, "
                f"not a test; rerun with --set kl_loss_coef={b:g}, dump grad_logprobs to test it)"
            )
            if line not in s.notes:
                s.notes.append(line)
            return


__all__ = ["GRAD_IS_CLIPS", "LOSS_KL_KEYS", "KLLossWalk", "KLVariant", "kl_loss_stage", "loss_beta_note"]
