"""The KL loss's options in the policy step of ``--detect``: the kl_loss stage under the carried KL,
``kl_grad_is_clip`` and, under ``kl_in=both``, the loss's own ``kl_loss_estimator`` and clamps.

``kl_grad_is_clip`` (OpenRLHF 0.11.2 ``unbiased_gradient``) changes no value, only ``grad_logprobs``:
its options get one digest on a dump without the gradient (the listed class says which values the
dump cannot tell apart, the evidence what to dump) and their own where the gradient is dumped (the
policy step's gradient check then keeps the one it reproduces). ``kl_loss_estimator`` (verl 0.9.1
``actor.kl_loss_type`` beside ``algorithm.kl_penalty``) is walked on a ``kl_in=both`` state of a dump
that shows the loss's KL (``kl_loss`` or ``grad_logprobs``): every estimator (the straight-through
ones only where the gradient tells them from their plain twins) with each clamp bundle
(:data:`refppo.oracle.check.alternatives.CLAMP_BUNDLES`) that changes the term's value.
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
        self.shown = "kl_loss" in t or "grad_logprobs" in t
        self.estimators = [e for e in KLEstimator if "grad_logprobs" in t or not e.straight_through]
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

    def variants(
        self, ca: Carried, base: Tensor | None, agg: str
    ) -> list[tuple[dict[str, Any], Tensor | None]]:
        """``(keys, kl_loss)`` of the KL loss options under ``loss_agg = agg``: the carried KL's
        ``base`` and, with a KL loss on the current log-probs, each ``kl_grad_is_clip`` and (under
        ``kl_in=both`` on a dump that shows the loss's KL) each ``kl_loss_estimator`` with a clamp
        bundle whose value differs from every one before (a bundle that binds on no token gives the
        value without it)."""
        if base is None or not self.on:
            return [({}, base)]
        losses: list[tuple[dict[str, Any], Tensor | None]] = [(self.base_upd, base)]
        if ca.kl_in is KLPlacement.BOTH and self.shown:
            seen = {digest(base)}
            for e, cl in itertools.product(self.estimators, CLAMP_BUNDLES.values()):
                kls = {"kl_estimator": e.value, **cl}
                v = self.kl_loss_as(digest(e.value, *map(str, cl.values())), kls, agg, None)
                if v is not None and digest(v) not in seen:
                    seen.add(digest(v))
                    own = {f"kl_loss_{k.removeprefix('kl_')}": x for k, x in cl.items()}
                    losses.append(({"kl_loss_estimator": e.value, **own}, v))
        grads = [{}, *({"kl_grad_is_clip": c} for c in self.clips)]
        return [({**lu, **cu}, v) for lu, v in losses for cu in grads]


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


__all__ = ["GRAD_IS_CLIPS", "LOSS_KL_KEYS", "KLLossWalk", "kl_loss_stage", "loss_beta_note"]
