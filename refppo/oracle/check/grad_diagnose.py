"""Why a dump's gradient differs from the reference: ratios by token, row, micro-batch and rank, and
named explanations, each re-checked through ``refppo.pipeline`` (dump v2).

The ratio ``dump/reference`` is fitted (least squares ``d ≈ k·r`` over the valid positions) per
(rank, micro-batch) group and per row. Then each hypothesis recomputes the gradient the buggy step
would give, through :func:`refppo.pipeline.step.update_quantities`
(:func:`refppo.oracle.check.grad.pipeline_grads`,
never a second formula), and is named only if that gradient reproduces every ``grad_*`` of the dump
within the gradient tolerance:

============================ ==================================================================
hypothesis                    recomputed gradient
============================ ==================================================================
local normaliser              each (rank, micro-batch) group through the pipeline with its OWN
                              normalisers (token / sequence count), averaged by ``1/(K·W)``
local normaliser, summed      the same with the micro-batch losses summed: ``1/W`` only (verl
                              0.9.1's losses without the global batch info)
rank normaliser               each rank's rows with that rank's normalisers, ``1/W`` (DDP mean)
constant factor               the reference × ``W``, ``K``, ``W·K`` or an inverse (DDP sum where
                              it averages, a missing or extra ``1/K`` of accumulation)
loss_agg                      another aggregation mode (per-row factors: sequence normalisation)
padded tokens counted         token-mean normaliser = every position ``B·T`` (a mask leak)
clip not in the gradient      the policy clip (and dual clip) removed: the unclipped branch's
                              gradient at tokens the reference clips
advantages not detached       ``grad_values − ∂pg/∂advantages`` (from the pipeline's per-token
                              policy loss: every clip, dual clip, log-ratio clamp and GSPO)
... and whitened              ``grad_values − s·∂pg/∂A`` (``A = (R − V − μ)/σ``, ``s = 1/σ``, the
                              statistics numbers) or ``+ Σ_t ∂pg/∂A_t·∂A_t/∂V`` through the
                              pipeline's whitening with the statistics on the live ``V``
KL estimator                  ``kl_in = loss`` with another ``kl_estimator``; not named if its
                              ``kl_loss`` or ``loss`` differs from the dump's where the checked
                              setting's matched (k2, k1+, k3+, abs+ share a gradient)
============================ ==================================================================

A nonzero gradient at padded positions (where the reference is 0 by definition) is named as a
padding leak with the rows, micro-batches and ranks it sits in.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from refppo.agg_conventions import MASK_AGGS
from refppo.conventions import KLEstimator, LossAgg
from refppo.dump.load import Dump
from refppo.dump.tolerances import TOLERANCES
from refppo.errors import RefPPOError
from refppo.oracle.check.bug_terms import dpg_dadv, whitened_not_detached
from refppo.oracle.check.compare import QuantityResult, compare
from refppo.oracle.check.grad import GRAD_QUANTITIES, UpdateInputs, grad_tolerance, pipeline_grads, unclipped
from refppo.oracle.check.grad_notes import (
    factor_text,
    kl_values_differ,
    nonfinite,
    rest_of_step,
    zero_reference_line,
)
from refppo.oracle.check.grad_notes import where_text as _where
from refppo.oracle.check.settings import Setup
from refppo.pipeline.blocks import Normalisers

Grads = dict[str, Tensor]


def groups(dump: Dump) -> list[tuple[int, int, Tensor]]:
    """``(rank, micro_batch, row indices)`` of each nonempty group, rank-major."""
    B = dump.B
    rank = dump.tensors.get("rank", torch.zeros(B, dtype=torch.int64))
    mb = dump.tensors.get("micro_batch", torch.zeros(B, dtype=torch.int64))
    out = []
    for r in range(dump.step.world_size):
        for k in range(dump.step.micro_batches):
            rows = ((rank == r) & (mb == k)).nonzero().flatten()
            if rows.numel():
                out.append((r, k, rows))
    return out


def _factor(d: Tensor, r: Tensor) -> float:
    rr = float((r * r).sum())
    return float((d * r).sum()) / rr if rr > 0 else math.nan


def ratio_lines(dump: Dump, name: str, ref: Tensor, cmp_mask: Tensor, tol: float) -> list[str]:
    """``dump/reference`` per (rank, micro-batch) and per row of ``name``; the padded gradient."""
    d = dump.tensors[name]
    zero = torch.zeros((), dtype=d.dtype)
    lines = []
    parts = []
    for r, k, rows in groups(dump):
        m = cmp_mask[rows]
        parts.append(f"{_where(r, k, dump)}: {factor_text(d[rows][m], ref[rows][m])}")
    if parts:
        lines.append(f"{name}: dump/reference by group: " + "; ".join(parts))
    per_row = [_factor(d[b][cmp_mask[b]], ref[b][cmp_mask[b]]) for b in range(dump.B)]
    finite = [x for x in per_row if math.isfinite(x)]
    if finite and max(finite) - min(finite) > 1e-6 * max(abs(x) for x in finite):
        lines.append(f"{name}: per-row factors range {min(finite):.4g} .. {max(finite):.4g}")
    pad = torch.where(cmp_mask, zero, d)
    leak = ~(pad.abs() <= tol)  # NaN counts
    if bool(leak.any()):
        leak_rows: list[int] = leak.any(dim=1).nonzero().flatten().tolist()
        where = sorted({_where(r, k, dump) for r, k, g in groups(dump) if set(g.tolist()) & set(leak_rows)})
        lines.append(
            f"{name}: a padding leak: nonzero gradient at {int(leak.sum())} padded positions in rows "
            f"{leak_rows[:8]} ({', '.join(where)}); the reference is 0 there"
        )
    return lines


def _scatter(dump: Dump, parts: list[tuple[Tensor, Grads]], like: Grads) -> Grads:
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    for rows, g in parts:
        for k in out:
            out[k][rows] = g[k]
    return out


def _split(
    inp: UpdateInputs, setup: Setup, row_sets: list[Tensor], scale: float, like: Grads, dump: Dump
) -> Grads:
    """Each row set through the pipeline with its own (local) normalisers, times ``scale``."""
    parts = []
    for rows in row_sets:
        g = pipeline_grads(inp.take(rows), setup)
        parts.append((rows, {k: v * scale for k, v in g.items()}))
    return _scatter(dump, parts, like)


def _count_text(dump: Dump, setup: Setup, inp: UpdateInputs) -> Callable[[Tensor], tuple[str, float]]:
    """The normaliser a loss_agg mode divides by, counted over some rows: ``(what, value)``."""
    agg = setup.conv.agg.loss

    def count(rows: Tensor) -> tuple[str, float]:
        if agg is LossAgg.TOKEN_MEAN:
            return "N", float(inp.mask[rows].sum())
        return "S", float(rows.numel())

    return count


Hypothesis = tuple[str, str, Callable[[], Grads]]
"""``(id, description, candidate gradient)``."""


def hypotheses(dump: Dump, setup: Setup, inp: UpdateInputs, ref: Grads) -> list[Hypothesis]:
    """Every hypothesis that applies to this dump (module docstring), in the order they are tried."""
    return [
        *_normaliser_hypotheses(dump, setup, inp, ref),
        *_factor_hypotheses(dump, ref),
        *_convention_hypotheses(setup, inp, ref),
    ]


def _normaliser_hypotheses(dump: Dump, setup: Setup, inp: UpdateInputs, ref: Grads) -> list[Hypothesis]:
    """Local normalisers: per (rank, micro-batch) group, and per rank."""
    W, K = dump.step.world_size, dump.step.micro_batches
    gs = groups(dump)
    count = _count_text(dump, setup, inp)
    what, n_step = count(torch.arange(dump.B))
    unit = "token count" if what == "N" else "sequence count"
    out: list[Hypothesis] = []
    if setup.conv.agg.loss is LossAgg.TOKEN_SUM:
        return out  # no normaliser: a local one is the global one
    if len(gs) > 1:
        facs, even = [], []
        for r, k, rows in gs:
            n = count(rows)[1]
            if n * K * W == n_step:
                even.append(_where(r, k, dump))
                continue
            facs.append(
                f"{_where(r, k, dump)}: factor {n_step / (K * W * n):.4g} = {what}_step/(K·W·{what}_mb)"
                f" = {n_step:g}/({K}·{W}·{n:g})"
            )
        if even:
            facs.append(f"factor 1 ({what}_mb = {what}_step/(K·W)): {', '.join(even)}")
        out.append((
            "local_normaliser",
            f"a per-micro-batch normaliser: each micro-batch divides by its own {unit} and the micro-batch "
            f"losses are averaged (1/(K·W)); off: " + "; ".join(facs),
            lambda: _split(inp, setup, [g[2] for g in gs], 1.0 / (K * W), ref, dump),
        ))  # fmt: skip
    if len(gs) > 1 and K > 1:  # (K = 1: summed and averaged are the same step)
        facs = [
            f"{_where(r, k, dump)}: factor {n_step / (W * count(rows)[1]):.4g} = {what}_step/(W·{what}_mb)"
            for r, k, rows in gs
        ]
        out.append((
            "local_normaliser_summed",
            f"a per-micro-batch normaliser whose micro-batch losses are summed, not averaged: each "
            f"micro-batch divides by its own {unit} and no 1/K is applied (verl 0.9.1's losses without "
            f"the global batch info); " + "; ".join(facs),
            lambda: _split(inp, setup, [g[2] for g in gs], 1.0 / W, ref, dump),
        ))  # fmt: skip
    if W > 1 and K > 1:
        ranks = [(r, torch.cat([g[2] for g in gs if g[0] == r])) for r in sorted({g[0] for g in gs})]
        facs = [f"rank {r}: factor {n_step / (W * count(rows)[1]):.4g}" for r, rows in ranks]
        out.append((
            "rank_normaliser",
            f"a per-rank normaliser: each rank divides by its own {unit} and DDP averages (1/W); "
            + "; ".join(facs),
            lambda: _split(inp, setup, [x[1] for x in ranks], 1.0 / W, ref, dump),
        ))  # fmt: skip
    return out


def _factor_hypotheses(dump: Dump, ref: Grads) -> list[Hypothesis]:
    """The reference times W, K, W·K or an inverse; one hypothesis per value (W = K: both named)."""
    W, K = dump.step.world_size, dump.step.micro_batches
    consts: dict[str, tuple[float, str]] = {}
    if W > 1:
        consts["W"] = (W, "gradients summed over ranks where DDP averages them (or a normaliser missing 1/W)")
        consts["1/W"] = (1.0 / W, "an extra 1/W (a rank's loss divided by W and averaged again by DDP)")
    if K > 1:
        consts["K"] = (K, "the accumulation's 1/K missing (K micro-batch gradients summed)")
        consts["1/K"] = (1.0 / K, "an extra 1/K (a loss already normalised over the step divided by K again)")
    if W > 1 and K > 1:
        consts["W·K"] = (W * K, "both 1/W and 1/K missing")
        consts["1/(W·K)"] = (1.0 / (W * K), "an extra 1/(W·K)")
    by_value: dict[float, list[tuple[str, str]]] = {}
    for label, (c, text) in consts.items():
        by_value.setdefault(c, []).append((label, text))
    out: list[Hypothesis] = []
    for c, named in by_value.items():
        labels = " = ".join(lab for lab, _ in named)
        text = "; or ".join(t for _, t in named)
        out.append((f"factor_{labels}", f"a constant factor {labels} = {c:g}: {text}", _times(ref, c)))
    return out


def _convention_hypotheses(setup: Setup, inp: UpdateInputs, ref: Grads) -> list[Hypothesis]:
    """Another aggregation, padding counted, the clip not in the gradient, A not detached, KL estimator."""
    out: list[Hypothesis] = []
    for agg in MASK_AGGS:
        if agg is not setup.conv.agg.loss:
            alt = setup.with_convention({"loss_agg": agg})
            out.append((f"loss_agg={agg.value}", f"the aggregation loss_agg={agg.value}", _grads(inp, alt)))
    if setup.conv.agg.loss is LossAgg.TOKEN_MEAN:
        n_all, n_tok = float(inp.mask.numel()), float(inp.mask.sum())
        out.append((
            "padded_tokens_counted",
            f"the token-mean normaliser counts padded positions ({n_all:g} = B·T, not {n_tok:g} tokens)",
            _grads(inp, setup, Normalisers(token_count=n_all, value_token_count=n_all)),
        ))  # fmt: skip
    out.append((
        "clip_not_in_gradient",
        "the clip is not applied to the gradient: tokens the reference clips carry the unclipped branch's "
        "gradient (the clip on the wrong branch, or the clipped ratio not cut from the graph)",
        lambda: {**ref, "grad_logprobs": pipeline_grads(inp, unclipped(setup))["grad_logprobs"]},
    ))  # fmt: skip
    out.append(("advantages_not_detached", _NOT_DETACHED, lambda: _not_detached(inp, setup, ref)))
    out += whitened_not_detached(setup, inp, ref)
    if setup.conv.kl.placement.in_loss:
        for est in KLEstimator:
            if est is not setup.conv.kl.estimator:
                alt = setup.with_convention({"kl_estimator": est})
                now = setup.conv.kl.estimator.value
                text = f"the KL-in-loss gradient of kl_estimator={est.value} (not {now})"
                out.append((f"kl_estimator={est.value}", text, _grads(inp, alt)))
    return out


_NOT_DETACHED = (
    "the advantages are not detached: grad_values also carries −∂pg_loss/∂advantages "
    "(advantages computed from the current values inside the graph)"
)


def _times(ref: Grads, c: float) -> Callable[[], Grads]:
    return lambda: {k: v * c for k, v in ref.items()}


def _grads(inp: UpdateInputs, setup: Setup, norm: Normalisers | None = None) -> Callable[[], Grads]:
    return lambda: pipeline_grads(inp, setup, norm=norm)


def _not_detached(inp: UpdateInputs, setup: Setup, ref: Grads) -> Grads:
    """``grad_values − ∂pg_loss/∂A``: a trainer whose advantages (``A = R − V``) keep ``V``'s graph.

    The core treats the advantages as constants (it detaches them), so ``∂pg/∂A`` is read from the
    core's own per-token loss ``ℓ`` (:func:`refppo.pipeline.update.policy_term`, every ``policy_loss``,
    clip, dual clip and log-ratio clamp as the reference runs them). ``ℓ`` is positively
    homogeneous in each token's advantage: the ratio does not depend on ``A`` and the clip branch
    and the dual-clip cap ``−c·A`` depend on its sign only, so ``ℓ(A) = A·ℓ(+1)`` for ``A > 0`` and
    ``|A|·ℓ(−1)`` for ``A < 0``. With ``w = ∂pg/∂ℓ`` (autograd through the aggregation)::

        ∂pg/∂A_t = w_t·ℓ_t(+1)           A_t > 0
                 = −w_t·ℓ_t(−1)          A_t < 0
                 = w_t·(ℓ_t(+1) − ℓ°_t(−1))/2  A_t = 0 (torch's ½/½ share of the tied branches
                                          of ``max``; the dual-clip cap, applied where A < 0
                                          only, is off: ``ℓ°`` is ``ℓ`` without ``dual_clip``)

    where ``ℓ(±1)`` is ``policy_term`` with every advantage ``±1``
    (``tests/oracle/test_grad_diagnose_not_detached.py`` checks it against autograd of a
    hand-written loss whose advantages are a leaf).
    """
    return {**ref, "grad_values": ref["grad_values"] - dpg_dadv(inp, setup)}


def _reproduces(dump: Dump, cand: Grads, names: list[str]) -> bool:
    gtol = grad_tolerance(TOLERANCES[dump.dtype])
    ones = torch.ones_like(dump.mask)
    return all(compare(n, dump.tensors[n], cand[n], ones, gtol).ok for n in names)


def explain_grad(
    dump: Dump, setup: Setup, inp: UpdateInputs, results: dict[str, QuantityResult]
) -> tuple[list[str], list[dict[str, Any]]]:
    """Diagnosis lines and ``explained_by`` entries for a diverging ``grad_*`` quantity."""
    names = [n for n in GRAD_QUANTITIES if n in results]
    bad = [n for n in names if not results[n].ok]
    ref_full = pipeline_grads(inp, setup)
    ref = {n: ref_full[n] for n in names}
    cmp = {"grad_logprobs": inp.mask, "grad_values": inp.value_mask}
    notes: list[str] = []
    found: list[dict[str, Any]] = []
    for n in bad:
        nf = nonfinite(dump, n)
        if nf is not None:
            notes.append(nf[0])
            found.append(nf[1])
            continue
        zero = zero_reference_line(dump, n, ref[n])
        if zero is not None:
            notes.append(zero)
        else:
            notes += ratio_lines(dump, n, ref[n], cmp[n], results[n].tol)
    if found:  # no hypothesis reproduces a NaN or an infinity: name it and stop
        return notes, found
    if "grad_values" in bad and setup.hp.vf_coef == 0.0:
        notes.append(
            "grad_values: vf_coef = 0 makes the reference gradient 0 (v1's advice for a critic with its "
            "own optimizer): set separate_critic: true and vf_coef to the value loss's weight in the "
            "critic's objective"
        )
    ruled_out: list[str] = []
    for hid, text, make in hypotheses(dump, setup, inp, ref_full):
        try:
            cand = make()
        except (RefPPOError, ValueError):
            continue
        if _reproduces(dump, cand, names):
            if hid.startswith("kl_estimator="):
                alt = setup.with_convention({"kl_estimator": hid.split("=", 1)[1]})
                off = kl_values_differ(dump, alt, results)
                if off:
                    ruled_out.append(f"{hid} (its {', '.join(off)} differ)")
                    continue
            tail, everything = rest_of_step(dump, setup, inp, hid, results, groups(dump))
            notes.append(f"explained by {text}{tail}")
            found.append({"kind": "gradient", "bug": hid, "all_match": everything})
    if ruled_out:
        notes.append(f"the gradient alone fits {'; '.join(ruled_out)}: ruled out by the dumped values")
    if not found and _leak_only(dump, ref, names, cmp):
        notes.append("explained by a padding leak: the valid positions match, the padded ones are not 0")
        found.append({"kind": "gradient", "bug": "padding_leak", "all_match": False})
    if not found:
        notes.append(
            f"no named gradient pattern reproduces {', '.join(bad)} (each re-checked by the pipeline)"
        )
    return notes, found


def _leak_only(dump: Dump, ref: Grads, names: list[str], cmp: dict[str, Tensor]) -> bool:
    """The dump matches the reference on the valid positions, and differs only at padding."""
    gtol = grad_tolerance(TOLERANCES[dump.dtype])
    return all(compare(n, dump.tensors[n], ref[n], cmp[n], gtol).ok for n in names)


__all__ = ["explain_grad", "groups", "hypotheses", "ratio_lines"]
