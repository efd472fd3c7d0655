"""What the gradient diagnosis says about a ``grad_*`` before any hypothesis: where a row sits
(micro-batch, rank), a non-finite value (NaN reported as NaN, with its first position), and a
reference gradient that is exactly 0 (tolerance 0). Used by :mod:`refppo.oracle.check.grad_diagnose`
and the report's first-divergence line (:mod:`refppo.oracle.check.diagnose`). Also the value check of a
``kl_estimator`` candidate (:func:`kl_values_differ`): several estimators share a gradient.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from refppo.dump.load import TOLERANCES, Dump
from refppo.oracle.check.compare import QuantityResult, compare
from refppo.oracle.check.recompute import recompute
from refppo.oracle.check.settings import Setup


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


__all__ = ["KL_VALUES", "first_line", "kl_values_differ", "nonfinite", "where_text", "zero_reference_line"]
