"""What the gradient diagnosis says about a ``grad_*`` before any hypothesis: where a row sits
(micro-batch, rank), a non-finite value (NaN reported as NaN, with its first position), and a
reference gradient that is exactly 0 (tolerance 0). Used by :mod:`refppo.oracle.check.grad_diagnose`
and the report's first-divergence line (:mod:`refppo.oracle.check.diagnose`). Also the value check of a
``kl_estimator`` candidate (:func:`kl_values_differ`): several estimators share a gradient; and the
scalars a trainer with a named normaliser bug would log (:func:`logged_scalars`), so that a bug
named from the gradient is re-checked against the dumped losses too.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from refppo.dump.load import Dump
from refppo.dump.tolerances import TOLERANCES
from refppo.errors import RefPPOError
from refppo.oracle.check.compare import QuantityResult, compare
from refppo.oracle.check.grad import GRAD_QUANTITIES, UpdateInputs
from refppo.oracle.check.recompute import recompute
from refppo.oracle.check.settings import Setup
from refppo.pipeline.blocks import Normalisers
from refppo.pipeline.step import update_quantities


def where_text(r: int, k: int, dump: Dump) -> str:
    parts = []
    if dump.step.micro_batches > 1 or "micro_batch" in dump.tensors:
        parts.append(f"micro-batch {k}")
    if dump.step.world_size > 1 or "rank" in dump.tensors:
        parts.append(f"rank {r}")
    return " of ".join(parts) if parts else "the step"


def _at(dump: Dump, b: int, t: int) -> str:
    """``row b, token t`` with its micro-batch and rank where the dump has them."""
    k = int(dump.tensors["micro_batch"][b]) if "micro_batch" in dump.tensors else 0
    r = int(dump.tensors["rank"][b]) if "rank" in dump.tensors else 0
    where = where_text(r, k, dump)
    return f"row {b}, token {t}" + ("" if where == "the step" else f" ({where})")


def _position(dump: Dump, b: int, t: int) -> dict[str, int]:
    k = int(dump.tensors["micro_batch"][b]) if "micro_batch" in dump.tensors else 0
    r = int(dump.tensors["rank"][b]) if "rank" in dump.tensors else 0
    return {"row": b, "token": t, "micro_batch": k, "rank": r}


def _first_nonfinite(dump: Dump, name: str) -> tuple[str, int, int, int, int] | None:
    """``(NaN | +inf | -inf, row, token, NaN count, ±inf count)`` of ``name``, or None when finite.

    The first NaN in row-major order (row, then token), else the first infinity."""
    d = dump.tensors[name]
    bad = ~torch.isfinite(d)
    if not bool(bad.any()):
        return None
    nan = torch.isnan(d)
    n_nan = int(nan.sum())
    b, t = (int(i) for i in (nan if n_nan else bad).nonzero()[0])
    v = float(d[b, t])
    word = "NaN" if math.isnan(v) else ("+inf" if v > 0 else "-inf")
    return word, b, t, n_nan, int(bad.sum()) - n_nan


def nonfinite(dump: Dump, name: str) -> tuple[str, dict[str, Any]] | None:
    """``(line, explained_by entry)`` for a ``grad_*`` holding NaN or ±inf, or None.

    The first such position (:func:`_first_nonfinite`: NaN is reported as NaN, before any
    infinity) with its micro-batch and rank. A non-finite gradient is a mismatch, not a refusal at
    load: it is an output of the trainer (spec/dump-format.md).
    """
    got = _first_nonfinite(dump, name)
    if got is None:
        return None
    word, b, t, n_nan, n_inf = got
    line = (
        f"{name}: the dump holds {word} at {_at(dump, b, t)}, the first of {n_nan} NaN and {n_inf} "
        f"infinite position(s) (a non-finite gradient is a mismatch whatever the tolerance)"
    )
    value = {"NaN": "nan", "+inf": "inf", "-inf": "-inf"}[word]  # JSON has no NaN: a string
    entry: dict[str, Any] = {"kind": "gradient", "bug": "non_finite", "value": value}
    entry.update(_position(dump, b, t), nan_count=n_nan, inf_count=n_inf, all_match=False)
    return line, entry


def zero_reference_line(dump: Dump, name: str, ref: Tensor) -> str | None:
    """The line saying that the reference ``name`` is exactly 0 at every position, so its tolerance
    ``(rtol + atol)·max|ref grad|`` is 0 and any nonzero value of the dump is a mismatch (None
    when the reference is not all 0). Deliberate: a trainer whose objective has no term reading
    those inputs (no value loss: ``vf_coef = 0``) computes exact zeros (spec/dump-format.md)."""
    if float(ref.abs().max()) != 0.0:
        return None
    d = dump.tensors[name].abs()
    flat = int(torch.nan_to_num(d, nan=math.inf).argmax())
    b, t = divmod(flat, d.shape[1])
    return (
        f"{name}: the reference gradient is exactly 0 here (every position), so its tolerance "
        f"(rtol + atol)·max|ref grad| is 0 and any nonzero value is a mismatch; the dump has "
        f"{float(dump.tensors[name][b, t]):.3g} at {_at(dump, b, t)} (its largest |{name}|)"
    )


def first_line(dump: Dump, name: str, max_abs_err: float, tol: float) -> str:
    """The report's ``first divergence`` line of a ``grad_*`` (NaN named as NaN, with its position)."""
    got = _first_nonfinite(dump, name)
    if got is not None:
        word, b, t, _, _ = got
        return f"first divergence: {name} (the dump holds {word} at {_at(dump, b, t)})"
    return f"first divergence: {name} (max abs err {max_abs_err:.3g} > tol {tol:.3g})"


KL_VALUES = ("kl_loss", "loss")
"""The dumped values the KL-in-loss estimator sets (``kl_in = loss``, 0-dim, current vs ref). Not
``kl``: a trainer may estimate the rollout KL with another estimator than its loss's (verl's
``algorithm.kl_penalty`` vs ``kl_loss_type``), and a loss on the wrong estimator is the bug named."""


def kl_values_differ(dump: Dump, setup: Setup, results: dict[str, QuantityResult]) -> list[str]:
    """The quantities of :data:`KL_VALUES` that ``setup`` (a ``kl_estimator`` candidate) does NOT
    reproduce, among the 0-dim ones the checked setting reproduced (``results[n].ok``), compared
    within the dump's value tolerance.

    The reference is :func:`refppo.oracle.check.recompute.recompute` under ``setup``: the very path that
    made the checked setting's ``loss``/``kl_loss`` (one path), so a separate critic's ``loss``
    (no value term) and a critic-free dump (no value term, not a zero stand-in's) are built as
    the checked setting's were.

    k2, k1+, k3+ and abs+ all have the gradient ``d = l − l_ref`` (``∂½d²/∂l``), so the gradient
    alone cannot tell them apart; their ``kl_loss = agg(KL_t)`` with ``KL_t`` = ``½d²``, ``d``,
    ``e^{−d} − 1 + d`` (k3's value, clamps included) and ``|d|`` does.
    """
    ok = [n for n in KL_VALUES if n in results and results[n].ok and dump.tensors[n].dim() == 0]
    if not ok:
        return []
    tol = TOLERANCES[dump.dtype]
    ref = recompute(dump, setup).values
    return [n for n in ok if not compare(n, dump.tensors[n], ref[n], None, tol).ok]


ADDITIVE = ("pg_loss", "vf_loss", "entropy_loss", "kl_loss", "loss")
"""Loss scalars a split step adds up (each micro-batch's loss as passed to backward, times its scale)."""
METRICS = ("pg_clipfrac", "approx_kl", "vf_clipfrac")
"""Logged means: a split step's logger averages the micro-batches' values."""


def _scalars(dump: Dump, inp: UpdateInputs, setup: Setup, norm: Normalisers | None) -> dict[str, float]:
    """The 0-dim quantities of one row set, as :func:`refppo.oracle.check.recompute.recompute` builds
    them (``approx_kl`` by ``conv.policy.approx_kl``; no value term in ``loss`` without a critic or
    with a separate one)."""
    critic = "old_values" in dump.tensors
    uq = update_quantities(
        logprobs=inp.logprobs, values=inp.values, old_logprobs=inp.old_logprobs, old_values=inp.old_values,
        advantages=inp.advantages, returns=inp.returns, mask=inp.mask, value_mask_=inp.value_mask,
        ref_logprobs=inp.ref_logprobs, entropy=inp.entropy, hp=setup.hp, conv=setup.conv, norm=norm,
    )  # fmt: skip
    out = {n: float(getattr(uq, n).detach()) for n in (*ADDITIVE, "pg_clipfrac", "vf_clipfrac")}
    if not critic or dump.step.separate_critic:
        out["loss"] -= setup.hp.vf_coef * out["vf_loss"]
    out["approx_kl"] = float(uq.approx_kl)  # the metric of conv.policy.approx_kl
    return out


def logged_scalars(
    dump: Dump,
    inp: UpdateInputs,
    setup: Setup,
    row_sets: list[Tensor],
    scale: float,
    norm: Normalisers | None = None,
) -> dict[str, float]:
    """The 0-dim quantities a trainer would log whose step runs each row set of ``row_sets``
    through the pipeline on its own (its own normalisers, or ``norm``):

        additive (:data:`ADDITIVE`):  Σ_g scale·q_g   (the losses as passed to backward, summed as
                                                       ``StepRecorder`` sums them)
        metrics  (:data:`METRICS`):   (1/G)·Σ_g q_g   (the logger's mean over the G row sets)

    ``scale`` is the hypothesis's factor of each row set's loss (``1/(K·W)`` for the per-micro-batch
    normaliser: the mean of the micro-batch means)."""
    parts = [_scalars(dump, inp.take(rows), setup, norm) for rows in row_sets]
    out = {n: scale * sum(p[n] for p in parts) for n in ADDITIVE}
    out.update({n: sum(p[n] for p in parts) / len(parts) for n in METRICS})
    return out


LOGGED_AS: dict[str, str] = {
    "local_normaliser": "the mean of the micro-batch means",
    "local_normaliser_summed": "the micro-batch means summed (and averaged over ranks)",
    "rank_normaliser": "the mean of the ranks' means",
    "padded_tokens_counted": "divided by B·T",
}
"""How a hypothesis's trainer logs its losses (the report's words; ``loss_agg=...``: under that mode)."""


def hypothesis_logs(
    hid: str, dump: Dump, inp: UpdateInputs, setup: Setup, groups: list[tuple[int, int, Tensor]]
) -> dict[str, float] | None:
    """:func:`logged_scalars` of the step a named gradient hypothesis ``hid`` describes (its row
    sets, scale and setting, as :mod:`refppo.oracle.check.grad_diagnose` builds its gradient), or None
    for a hypothesis that says nothing about the logged values (a constant factor of the gradient,
    the clip or the detach: the forward values are the reference's)."""
    W, K = dump.step.world_size, dump.step.micro_batches
    every = [torch.arange(dump.B)]
    if hid == "local_normaliser":
        return logged_scalars(dump, inp, setup, [g[2] for g in groups], 1.0 / (K * W))
    if hid == "local_normaliser_summed":
        return logged_scalars(dump, inp, setup, [g[2] for g in groups], 1.0 / W)
    if hid == "rank_normaliser":
        ranks = sorted({g[0] for g in groups})
        rows = [torch.cat([g[2] for g in groups if g[0] == r]) for r in ranks]
        return logged_scalars(dump, inp, setup, rows, 1.0 / W)
    if hid.startswith("loss_agg="):
        return logged_scalars(
            dump, inp, setup.with_convention({"loss_agg": hid.split("=", 1)[1]}), every, 1.0
        )
    if hid == "padded_tokens_counted":
        n_all = float(inp.mask.numel())
        norm = Normalisers(token_count=n_all, value_token_count=n_all)
        return logged_scalars(dump, inp, setup, every, 1.0, norm)
    return None


def reproduced_scalars(
    dump: Dump, logged: dict[str, float], results: dict[str, QuantityResult], names: list[str]
) -> list[str]:
    """The quantities of ``names`` that ``logged`` reproduces within their tolerance (as compared)."""
    return [n for n in names if n in logged and abs(float(dump.tensors[n]) - logged[n]) <= results[n].tol]


def factor_text(d: Tensor, r: Tensor) -> str:
    """The fitted ``dump/reference`` of one group, or what happened where it is not a number: the
    reference is 0 there (the dump's largest ``|g|`` named), the dump holds a non-finite value."""
    if not bool(torch.isfinite(d).all()):
        return "the dump is not finite there"
    if float((r * r).sum()) == 0.0:
        peak = float(d.abs().max()) if d.numel() else 0.0
        return (
            "reference 0 there, dump 0 too"
            if peak == 0.0
            else f"reference 0 there, dump max |g| = {peak:.3g}"
        )
    return f"{float((d * r).sum()) / float((r * r).sum()):.4g}"


def rest_of_step(
    dump: Dump,
    setup: Setup,
    inp: UpdateInputs,
    hid: str,
    results: dict[str, QuantityResult],
    groups: list[tuple[int, int, Tensor]],
) -> tuple[str, bool]:
    """The tail of the line naming gradient hypothesis ``hid``, and whether it explains every
    quantity: the non-gradient quantities that differ are re-checked against the values the buggy
    trainer would log (:func:`refppo.oracle.check.grad_notes.hypothesis_logs`: a per-micro-batch
    normaliser logs the mean of the micro-batch means), never blamed on a second bug unchecked.
    ``groups``: the dump's ``(rank, micro_batch, rows)``
    (:func:`refppo.oracle.check.grad_diagnose.groups`)."""
    still = [k for k, r in results.items() if k not in GRAD_QUANTITIES and not r.ok]
    if not still:
        return "; with it every quantity in the dump matches", True
    scalar = [n for n in still if dump.tensors[n].dim() == 0]
    logs = None
    if scalar:
        try:
            logs = hypothesis_logs(hid, dump, inp, setup, groups)
        except (RefPPOError, ValueError):
            logs = None
    fits = [] if logs is None else reproduced_scalars(dump, logs, results, scalar)
    rest = [n for n in still if n not in fits]
    logged = f"{', '.join(fits)} as this trainer logs them: {LOGGED_AS.get(hid, 'under it')}"
    if not rest:
        return f"; with it every quantity in the dump matches ({logged})", True
    verb = "differs" if len(rest) == 1 else "differ"
    if fits:
        return f"; it explains the gradient and {logged}; {', '.join(rest)} still {verb}", False
    return f"; it explains the gradient only: {', '.join(rest)} still {verb}", False


__all__ = [
    "ADDITIVE",
    "KL_VALUES",
    "LOGGED_AS",
    "METRICS",
    "factor_text",
    "first_line",
    "hypothesis_logs",
    "kl_values_differ",
    "logged_scalars",
    "nonfinite",
    "reproduced_scalars",
    "rest_of_step",
    "where_text",
    "zero_reference_line",
]
