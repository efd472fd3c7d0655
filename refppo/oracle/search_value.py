"""The value stage of the ``--detect`` search: clipped or not, its mask and its aggregation."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from refppo.conventions import LossAgg, ValueClipForm
from refppo.core.aggregate import aggregate_masked
from refppo.core.value import value_loss
from refppo.oracle.diagnose import ALTERNATIVES
from refppo.oracle.recompute import vf_tie_widen
from refppo.oracle.search import Group, Option, Search, digest
from refppo.validate import count_true


def value_stage(search: Search, groups: list[Group]) -> list[Group]:
    """``value_loss`` × ``vf_mask`` × ``value_loss_agg`` on each group.

    ``value_loss_agg``: None (= the policy's loss_agg) or, only when the dump has values to check
    it against, each other mode (re-aggregating the per-token loss; no recompute). The "same as
    loss_agg" option keeps the base's spelling when it names that mode.
    """
    t, m, hp, norm = search.t, search.m, search.hp, search.norm
    values = t.get("values", t["old_values"])
    value_aggs_all = [a["value_loss_agg"] for a in ALTERNATIVES["value_loss_agg"]]
    own_vagg = search.base.conv.value_loss_agg
    own_vagg_name = None if own_vagg is None else own_vagg.value

    n_tok: dict[int, float] = {}  # token count of each mask (per_token is 0 on its padding)

    # value_clip_form only matters for a clipped loss: the unclipped one keeps the base's form.
    own_form = search.base.conv.value_clip_form.value
    value_kinds = [("clipped", f.value) for f in ValueClipForm] + [("unclipped", own_form)]

    def opts(g: Group) -> Iterable[Option]:
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
                    clip_form=form,
                    agg=g.state["agg"],
                    **norm,
                )
                for vagg in vaggs:
                    if vagg is None or vagg == g.state["agg"]:
                        vf = out.loss.detach()
                    else:
                        if id(mask) not in n_tok:
                            n_tok[id(mask)] = float(count_true(mask))
                        n = n_tok[id(mask)]
                        vf = aggregate_masked(
                            out.per_token, mask, LossAgg(vagg), token_count=n, **norm
                        ).detach()
                    st = {**g.state, "vf_loss": vf, "vf_clipfrac": out.clipfrac, "vf_m": mask, "vl": vl}
                    key = digest(
                        *(
                            g.state[k]
                            for k in ("pg_loss", "pg_clipfrac", "approx_kl", "entropy_loss", "kl_loss")
                        ),
                        st["vf_loss"],
                        st["vf_clipfrac"],
                    )
                    upd = {"value_loss": vl, "value_clip_form": form, "vf_mask": vfm}
                    yield {**upd, "value_loss_agg": vagg}, st, key

    def checks(s: dict[str, Any]) -> list[float | None]:
        if "values" not in t:
            return []

        def vf_widen() -> float:
            if s["vl"] != "clipped":
                return 0.0
            return vf_tie_widen(
                values,
                t["old_values"],
                s["returns"],
                s["vf_m"],
                hp.cliprange_value,
                search.tol.rtol,
            )

        return [
            search.ratio("vf_loss", s["vf_loss"], None),
            search.ratio("vf_clipfrac", s["vf_clipfrac"], None, vf_widen),
        ]

    return search.expand(groups, opts, checks, "value")
