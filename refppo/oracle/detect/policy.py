"""The policy stage of the ``--detect`` search: dual clip, log-ratio clamp, clip ranges, aggregation.

Named options first (no dual clip / verl's ``c = 3`` / the checked setting's; no clamp / 20; every
``loss_agg``; every ``approx_kl`` metric; the checked clip ranges). When none reproduces
``pg_loss`` and ``pg_clipfrac``, :meth:`refppo.oracle.detect.search.Search.propose_policy` solves the
dual-clip constant and the clip ranges from the data and the stage is walked again with them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from refppo.conventions import ApproxKL, KLPlacement, LossAgg
from refppo.core.aggregate import aggregate_loss, aggregate_masked
from refppo.core.by_rows import policy_token_loss_by_rows, row_blocks
from refppo.core.checks import count_true
from refppo.core.policy import approx_kl_k2_all_positions, clipped_policy_loss
from refppo.oracle.detect.groups import Group
from refppo.oracle.detect.search import Option, Search, digest, pg_widen_for
from refppo.pipeline.blocks import update_rows

MEMO_MAX = 16384
"""Entries of the policy stage's per-advantages loss memo (scalars) before it is cleared."""


def policy_stage(search: Search, groups: list[Group]) -> list[Group]:
    t, m, hp = search.t, search.m, search.hp
    has_lp = "logprobs" in t
    logprobs = t.get("logprobs", t["old_logprobs"])
    base_duals: list[float | None] = list(dict.fromkeys([None, 3.0, search.base.conv.policy.dual_clip]))
    lrcs: list[float | None] = list(dict.fromkeys([None, 20.0, search.base.conv.policy.log_ratio_clamp]))
    aggs = [a.value for a in LossAgg]
    norm = search.norm
    entropy = t.get("entropy")
    base_clip = (hp.cliprange, hp.cliprange_high)
    own_eagg: dict[str, Any] = {} if search.base.conv.agg.entropy is None else {"entropy_agg": None}

    # Work shared by every candidate of the stage, done once.
    # Above ROW_BLOCK_ELEMENTS, the loss by row blocks (refppo.core.by_rows: the same per-token loss,
    # clip fraction and approx_kl bit for bit) instead of the whole batch's ~8 [B, T] temporaries;
    # the log-ratio tests below by the same blocks (one block below ROW_BLOCK_ELEMENTS).
    rows = update_rows(m)
    block = m.shape[0] if rows is None else rows
    lp_old = t["old_logprobs"]
    max_abs_d = max(float(d.abs().max()) for _, d in _log_ratios(block, logprobs, lp_old, m))
    ak2 = approx_kl_k2_all_positions(logprobs, t["old_logprobs"], m) if has_lp else None
    ent_by_agg = {a: aggregate_loss(entropy, m, a, **norm) for a in aggs} if entropy is not None else {}
    kll_cache: dict[tuple[bytes, str], Tensor] = {}
    # ``per_token`` of clipped_policy_loss is already 0 on padding and the mask is validated: the
    # core's aggregate_masked with the token count computed once is aggregate_loss without the
    # per-call re-validation, masking and counting (three full passes per candidate and mode).
    n_tok = float(count_true(m))
    # By the advantages' content (groups of other rollout conventions often share it): whether a
    # dual clip acts, and the loss under each (clip, dual, clamp), aggregated (scalars only).
    acts: dict[tuple[Any, ...], bool] = {}
    computed: dict[tuple[Any, ...], _Aggregated] = {}

    def make(extra: dict[str, list[Any]] | None) -> Callable[[Group], Iterable[Option]]:
        duals = list(dict.fromkeys(base_duals + list((extra or {}).get("duals", []))))
        clips = [base_clip, *(extra or {}).get("clips", [])]

        def opts(g: Group) -> Iterable[Option]:
            adv, adv_key = g.state["adv"], g.state["adv_key"]
            for clip in clips:
                lo, hi = clip
                for dual in duals:
                    for lrc in lrcs:
                        # A clamp that never binds, or a dual clip that never acts, changes
                        # nothing: reuse the result instead of recomputing it.
                        eff_lrc = lrc if (lrc is not None and max_abs_d > lrc) else None
                        eff_dual = dual
                        if dual is not None and dual > 1.0 + (hi if hi is not None else lo):
                            dk = (adv_key, dual, eff_lrc)
                            if dk not in acts:
                                acts[dk] = _dual_acts(block, logprobs, lp_old, adv, m, dual, eff_lrc)
                            if not acts[dk]:
                                eff_dual = None
                        ck = (adv_key, clip, eff_dual, eff_lrc)
                        if ck not in computed:
                            if len(computed) >= MEMO_MAX:  # a cache: bounded, values recomputed
                                computed.clear()
                            computed[ck] = _Aggregated.of(
                                _policy_loss(
                                    rows, logprobs, t["old_logprobs"], adv, m, lo, hi, eff_dual, eff_lrc
                                ),
                                lambda x, a: aggregate_masked(x, m, LossAgg(a), token_count=n_tok, **norm),
                                aggs,
                            )
                        out = computed[ck]
                        upd_clip = {} if clip == base_clip else {"cliprange": lo, "cliprange_high": hi}
                        yield from _agg_options(g, out, dual, lrc, eff_lrc, clip, upd_clip)

        return opts

    def _agg_options(
        g: Group, out: Any, dual: Any, lrc: Any, eff_lrc: Any, clip: Any, upd_clip: dict[str, Any]
    ) -> Iterable[Option]:
        for agg in aggs:
            pg = out.pg[agg]
            # entropy_agg: like pg_loss (None), or, when the dump holds entropy_loss to pin it, any
            # other mode (SkyRL's entropy is token-mean whatever loss_agg: skyrl_train ppo_utils)
            ents: list[tuple[dict[str, Any], Tensor | None]] = [(own_eagg, ent_by_agg.get(agg))]
            if "entropy_loss" in t:
                ents += [({"entropy_agg": a}, ent_by_agg[a]) for a in ent_by_agg if a != agg]
            kll = None
            if g.state["kl_in"] == KLPlacement.LOSS.value and g.state["kl_cur"] is not None:
                kk = (g.state["kl_key"], agg)
                if kk not in kll_cache:
                    kll_cache[kk] = aggregate_loss(g.state["kl_cur"], m, agg, **norm)
                kll = kll_cache[kk]
            for (eupd, ent), ak in itertools.product(ents, [a.value for a in ApproxKL]):
                # each approx_kl metric as recompute.py computes it
                akl = {"k1": out.approx_kl, "k2_all_positions": ak2, "neg_k1": -out.approx_kl}[ak]
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
                    "kl_cur": g.state["kl_cur"] if kll is not None else None,
                    "agg": agg,
                    "adv": g.state["adv"],
                    "adv_key": g.state["adv_key"],
                    "lrc": eff_lrc,
                    "clip": clip,
                }
                key = digest(g.state["ret_key"], pg, out.clipfrac, akl, ent, kll, agg)
                upd = {
                    "dual_clip": dual,
                    "log_ratio_clamp": lrc,
                    "loss_agg": agg,
                    "approx_kl": ak,
                    **eupd,
                    **upd_clip,
                }
                yield upd, st, key

    def checks(s: dict[str, Any]) -> list[float | None]:
        if not has_lp:
            return []
        pg_r = search.ratio("pg_loss", s["pg_loss"], None)
        out = [pg_r]
        # Only a candidate whose pg_loss matches needs the (costlier) tie-widened clipfrac check.
        if pg_r is None or pg_r == 0.0:
            out.append(search.ratio("pg_clipfrac", s["pg_clipfrac"], None, pg_widen_for(search, s)))
        else:
            out.append(search.ratio("pg_clipfrac", s["pg_clipfrac"], None))
        out.append(search.ratio("approx_kl", s["approx_kl"], None))
        if s["entropy_loss"] is not None:
            out.append(search.ratio("entropy_loss", s["entropy_loss"], None))
        return out

    return search.stage(groups, make, checks, "policy", search.propose_policy if has_lp else None)


def _log_ratios(rows: int, logp: Tensor, logp_old: Tensor, m: Tensor) -> Iterator[tuple[slice, Tensor]]:
    """``(r, d[r])`` for each block ``r`` of ``rows`` rows: ``d = logp − logp_old`` on valid tokens,
    0 on padding (the elementwise values of the whole batch's ``d``, without its ``[B, T]``)."""
    zero = torch.zeros((), dtype=logp.dtype)
    for r in row_blocks(m.shape[0], rows):
        yield r, torch.where(m[r], logp[r] - logp_old[r], zero)


def _dual_acts(
    rows: int, logp: Tensor, logp_old: Tensor, adv: Tensor, m: Tensor, dual: float, lrc: float | None
) -> bool:
    """Whether a dual clip ``c`` acts on some token: valid, ``A < 0`` and ``exp(clamp(d, ±κ)) > c``
    (``d`` of :func:`_log_ratios`; κ the log-ratio clamp, or none), by blocks of ``rows`` rows."""
    for r, d in _log_ratios(rows, logp, logp_old, m):
        dc = d if lrc is None else torch.clamp(d, -lrc, lrc)
        if bool((m[r] & (adv[r] < 0) & (torch.exp(dc) > dual)).any()):
            return True
    return False


def _policy_loss(
    rows: int | None,
    logp: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    m: Tensor,
    lo: float,
    hi: float | None,
    dual: float | None,
    lrc: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(per_token, clipfrac, approx_kl)`` of :func:`clipped_policy_loss` (``rows`` None) or of
    :func:`refppo.core.by_rows.policy_loss_by_rows` by ``rows`` rows: the same values bit for bit,
    the latter without the whole batch's ``[B, T]`` temporaries (one ``[B, T]`` buffer, ``ℓ``, plus
    one block's: the ratio ``ρ``, not read here, is not kept)."""
    kw: dict[str, Any] = {"clip_low": lo, "clip_high": hi, "dual_clip": dual, "log_ratio_clamp": lrc}
    if rows is None:
        out = clipped_policy_loss(logp, logp_old, adv, m, **kw)
        return out.per_token, out.clipfrac, out.approx_kl
    # the loss by blocks without the ratio's [B, T] buffer (not read here)
    blocks = policy_token_loss_by_rows(rows, logp, logp_old, adv, m, gspo=False, keep_ratio=False, **kw)
    return blocks.per_token, blocks.clipfrac, blocks.approx_kl


class _Aggregated:
    """A clipped policy loss without its ``[B, T]`` tensors: ``pg_loss`` under each aggregation."""

    def __init__(self, pg: dict[str, Tensor], clipfrac: Tensor, approx_kl: Tensor) -> None:
        self.pg, self.clipfrac, self.approx_kl = pg, clipfrac, approx_kl

    @classmethod
    def of(
        cls, out: tuple[Tensor, Tensor, Tensor], agg: Callable[[Tensor, str], Tensor], aggs: list[str]
    ) -> _Aggregated:
        per_token, clipfrac, approx_kl = out
        return cls({a: agg(per_token, a).detach() for a in aggs}, clipfrac, approx_kl)
