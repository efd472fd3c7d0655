"""The value stage of the ``--detect`` search: clipped or not, its mask, its aggregation and ε_v.

When no named option reproduces ``vf_loss`` (and ``vf_clipfrac``), :func:`solve_value_clip`
reads the value clip range ``ε_v`` off the data and the stage is walked again with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from refppo.conventions import LossAgg, ValueClipForm
from refppo.core.aggregate import aggregate_loss, aggregate_masked
from refppo.core.by_rows import value_loss_by_rows
from refppo.core.checks import count_true
from refppo.core.value import value_loss
from refppo.oracle.check.alternatives import ALTERNATIVES
from refppo.oracle.check.ties import vf_tie_widen
from refppo.oracle.detect.groups import Group
from refppo.oracle.detect.search import SOLVE_GROUPS, Option, Search, digest
from refppo.oracle.detect.solve import loss_weights, nice
from refppo.pipeline.blocks import update_rows


def value_stage(search: Search, groups: list[Group]) -> list[Group]:
    """``value_loss`` × ``vf_mask`` × ``value_loss_agg`` on each group.

    ``value_loss_agg``: None (= the policy's loss_agg) or, only when the dump has values to check
    it against, each other mode (re-aggregating the per-token loss; no recompute). The "same as
    loss_agg" option keeps the base's spelling when it names that mode.
    """
    t, m, hp, norm = search.t, search.m, search.hp, search.norm
    values = t.get("values", t["old_values"])
    rows = update_rows(m)
    value_aggs_all = [getattr(a["value_loss_agg"], "value", None) for a in ALTERNATIVES["value_loss_agg"]]
    own_vagg = search.base.conv.agg.value
    own_vagg_name = None if own_vagg is None else own_vagg.value

    # token count of each mask (per_token is 0 on its padding); the mask is kept in the entry so
    # that its id cannot be reused while the memo lives
    n_tok: dict[int, tuple[float, Tensor]] = {}
    # vf_tie_widen per (returns, mask, ε_v): the options of a group share them. The tensors are kept
    # in the entry so that their ids cannot be reused while the memo lives.
    widen_memo: dict[tuple[int, int, float], tuple[float, Tensor, Tensor]] = {}

    # value_clip_form only matters for a clipped loss: the unclipped one keeps the base's form.
    own_form = search.base.conv.value.clip_form.value
    value_kinds = [("clipped", f.value) for f in ValueClipForm] + [("unclipped", own_form)]

    def make(extra: list[float] | None) -> Callable[[Group], Iterable[Option]]:
        clips = list(dict.fromkeys([hp.cliprange_value, *(extra or [])]))
        return lambda g: (o for c in clips for o in opts(g, c))

    def opts(g: Group, clip: float) -> Iterable[Option]:
        vaggs: list[str | None] = [own_vagg_name if own_vagg_name == g.state["agg"] else None]
        if "values" in t:
            vaggs += [a for a in value_aggs_all if a is not None and a != g.state["agg"]]
        for vl, form in value_kinds:
            for vfm in ("value", "response"):
                mask = g.state["vm"] if vfm == "value" else m
                vkw: dict[str, Any] = {
                    "clip": clip,
                    "kind": vl,
                    "clip_form": form,
                    "agg": g.state["agg"],
                    **norm,
                }
                vin = (values, t["old_values"], g.state["returns"], mask)
                # above ROW_BLOCK_ELEMENTS by row blocks (refppo.core.by_rows): the same outputs bit
                # for bit, without the whole batch's [B, T] temporaries
                out = value_loss(*vin, **vkw) if rows is None else value_loss_by_rows(rows, *vin, **vkw)
                for vagg in vaggs:
                    if vagg is None or vagg == g.state["agg"]:
                        vf = out.loss.detach()
                    else:
                        if id(mask) not in n_tok:
                            n_tok[id(mask)] = (float(count_true(mask)), mask)
                        n = n_tok[id(mask)][0]
                        vf = aggregate_masked(
                            out.per_token, mask, LossAgg(vagg), token_count=n, **norm
                        ).detach()
                    st = {**g.state, "vf_loss": vf, "vf_clipfrac": out.clipfrac, "vf_m": mask, "vl": vl}
                    st["vclip"] = clip
                    key = digest(
                        *(
                            g.state[k]
                            for k in ("pg_loss", "pg_clipfrac", "approx_kl", "entropy_loss", "kl_loss")
                        ),
                        st["vf_loss"],
                        st["vf_clipfrac"],
                    )
                    upd: dict[str, Any] = {"value_loss": vl, "value_clip_form": form, "vf_mask": vfm}
                    if clip != hp.cliprange_value:
                        upd["cliprange_value"] = clip
                    yield {**upd, "value_loss_agg": vagg}, st, key

    def checks(s: dict[str, Any]) -> list[float | None]:
        if "values" not in t:
            return []

        def vf_widen() -> float:
            if s["vl"] != "clipped":
                return 0.0
            key = (id(s["returns"]), id(s["vf_m"]), s["vclip"])
            if key not in widen_memo:
                rtol = search.tol.rtol
                w = vf_tie_widen(values, t["old_values"], s["returns"], s["vf_m"], s["vclip"], rtol)
                widen_memo[key] = (w, s["returns"], s["vf_m"])
            return widen_memo[key][0]

        return [
            search.ratio("vf_loss", s["vf_loss"], None),
            search.ratio("vf_clipfrac", s["vf_clipfrac"], None, vf_widen),
        ]

    def propose(gs: list[Group]) -> list[float]:
        if "values" not in t or "vf_loss" not in t:
            return []
        found: list[float] = []
        for g in gs[:SOLVE_GROUPS]:
            aggs = [g.state["agg"]] + (value_aggs_all if own_vagg is None else [own_vagg_name])
            for mask in (g.state["vm"], m):
                for agg in dict.fromkeys(a for a in aggs if a is not None):
                    terms = ValueTerms.of(values, t["old_values"], g.state["returns"], mask, agg, norm)
                    found += solve_value_clip(terms, float(t["vf_loss"]), search.tol.of(float(t["vf_loss"])))
        found = [c for c in dict.fromkeys(found) if c != hp.cliprange_value][:8]
        for c in found:
            search.propose_value("cliprange_value", c)
        return found

    return search.stage(groups, make, checks, "value", propose)


class ValueTerms:
    """The valid tokens of the value loss, flattened (float64): ``V``, ``V_old``, ``R``, weights."""

    def __init__(self, v: Tensor, v_old: Tensor, ret: Tensor, w: Tensor) -> None:
        self.v, self.v_old, self.ret, self.w = v, v_old, ret, w

    @classmethod
    def of(
        cls, v: Tensor, v_old: Tensor, ret: Tensor, mask: Tensor, agg: str, norm: dict[str, Any]
    ) -> ValueTerms:
        w = loss_weights(lambda x: aggregate_loss(x, mask, agg, **norm), mask, torch.float64)
        return cls(v[mask].double(), v_old[mask].double(), ret[mask].double(), w[mask])

    def loss(self, eps: float) -> float:
        """``½·Σ w·max((V−R)², (clamp(V, V_old ± ε) − R)²)`` (as :func:`refppo.core.value.value_loss`)."""
        vc = torch.minimum(torch.maximum(self.v, self.v_old - eps), self.v_old + eps)
        per = torch.maximum((self.v - self.ret) ** 2, (vc - self.ret) ** 2)
        return 0.5 * float((self.w * per).sum())


def solve_value_clip(terms: ValueTerms, target: float, tol: float, grid: int = 256) -> list[float]:
    """Value clip ranges ``ε_v`` under which the clipped value loss equals ``target``.

    ``vf_loss(ε)`` is continuous and piecewise quadratic in ε, with knots at ``|V − V_old|`` (a
    token enters or leaves the clip) and where a token's two branches cross; beyond the largest
    ``|V − V_old|`` it is the unclipped loss. The roots are bracketed on a grid of the quantiles of
    ``|V − V_old|`` (so every piece with many tokens is sampled) and refined by bisection; each is
    proposed rounded to the shortest round number (:func:`refppo.oracle.detect.solve.nice`) whose loss is
    still within ``tol`` of the target, else to 6 significant digits. Proposals only: the pipeline
    re-checks them.
    """
    d = (terms.v - terms.v_old).abs()
    if d.numel() == 0 or float(d.max()) == 0.0:
        return []
    qs = torch.quantile(d, torch.linspace(0.0, 1.0, grid, dtype=torch.float64)).tolist()
    xs = sorted(set([0.0, *qs]))
    fs = [terms.loss(x) - target for x in xs]
    roots: list[float] = []
    for (a, fa), (b, fb) in zip(zip(xs, fs, strict=True), zip(xs[1:], fs[1:], strict=True), strict=False):
        if fa == 0.0:
            roots.append(a)
        elif fa * fb < 0.0:
            for _ in range(80):
                mid = 0.5 * (a + b)
                fm = terms.loss(mid) - target
                if fm == 0.0:
                    break
                a, fa, b = (mid, fm, b) if fa * fm > 0.0 else (a, fa, mid)
            roots.append(0.5 * (a + b))
    out: list[float] = []
    for r in roots[:8]:
        picks = [c for c in nice(r, rel=1e-2) if abs(terms.loss(c) - target) <= tol]
        out.append(picks[0] if picks else float(f"{r:.6g}"))
    return out
