"""Comparing a trajectory with a golden one: the list of mismatches, and the measured deviations.

Tensors and scalars: ``|a − b| <= atol + rtol·|b|`` (exact for token ids, masks and permutations;
clip fractions against ``frac_atol``); checksums: ``|ΔΣp| <= ck·Σ|p|``, ``|ΔΣp²| <= ck·Σp²``.
"""

from __future__ import annotations

import math

import torch

from refppo.golden.cases import (
    COMPARED_METRICS,
    EXACT_FIELDS,
    SEAM_FIELDS,
    SEAM_METRICS,
    TENSOR_FIELDS,
    Tolerances,
)
from refppo.golden.trajectory import Trajectory


def _close(a: float, b: float, atol: float, rtol: float) -> bool:
    return math.isfinite(a) and abs(a - b) <= atol + rtol * abs(b)


def _fields(golden: Trajectory) -> tuple[str, ...]:
    """The golden's tensor fields: :data:`TENSOR_FIELDS`, and :data:`SEAM_FIELDS` when it has them."""
    return TENSOR_FIELDS + tuple(f for f in SEAM_FIELDS if f"it0.{f}" in golden.tensors)


def _metrics(golden: Trajectory) -> tuple[str, ...]:
    """The golden's compared metrics: :data:`COMPARED_METRICS`, and :data:`SEAM_METRICS` when it has them."""
    first = golden.record["iterations"][0]["metrics"]
    return COMPARED_METRICS + tuple(k for k in SEAM_METRICS if k in first)


def compare(golden: Trajectory, got: Trajectory, tol: Tolerances) -> list[str]:
    """Every mismatch between ``got`` and ``golden`` (empty: the trajectory is reproduced).

    Measured deviations: :func:`max_deviations`.
    """
    bad: list[str] = []
    n_it = len(golden.record["iterations"])
    for it in range(n_it):
        for f in (*_fields(golden), "perm"):
            key = f"it{it}.{f}"
            if key not in got.tensors:
                bad.append(f"{key}: missing (the golden has it)")
                continue
            a, b = got.tensors[key], golden.tensors[key]
            if a.shape != b.shape:
                bad.append(f"{key}: shape {list(a.shape)} != golden {list(b.shape)}")
                continue
            if f in EXACT_FIELDS:
                if not torch.equal(a, b):
                    bad.append(f"{key}: differs from golden (exact field)")
                continue
            a64, b64 = a.double(), b.double()
            excess = (a64 - b64).abs() - (tol.atol + tol.rtol * b64.abs())
            if bool((excess > 0).any()) or not bool(torch.isfinite(a64).all()):
                bad.append(f"{key}: max |Δ| {float((a64 - b64).abs().max()):.3g} over tolerance")
        gi, ai = golden.record["iterations"][it], got.record["iterations"][it]
        for k in _metrics(golden):
            atol = tol.frac_atol if "clipfrac" in k else tol.atol
            if not _close(ai["metrics"].get(k, math.nan), gi["metrics"][k], atol, tol.rtol):
                bad.append(f"it{it}.metrics.{k}: {ai['metrics'].get(k)!r} != golden {gi['metrics'][k]!r}")
        for s, (sa, sg) in enumerate(zip(ai["steps"], gi["steps"], strict=True)):
            for k in sg:
                atol = tol.frac_atol if "clipfrac" in k else tol.atol
                if not _close(sa[k], sg[k], atol, tol.rtol):
                    bad.append(f"it{it}.steps[{s}].{k}: {sa[k]!r} != golden {sg[k]!r}")
        for name, (s, s2, sabs) in gi["checksums"].items():
            a_s, a_s2, _ = ai["checksums"][name]
            if not (
                abs(a_s - s) <= tol.checksum * sabs + 1e-12 and abs(a_s2 - s2) <= tol.checksum * s2 + 1e-12
            ):
                bad.append(f"it{it}.checksums.{name}: [{a_s!r}, {a_s2!r}] != golden [{s!r}, {s2!r}]")
    return bad


def max_deviations(golden: Trajectory, got: Trajectory) -> dict[str, float]:
    """Measured max |Δ| per tensor field (over iterations), per metric, and the max relative
    checksum deviation — for reports (tests print them)."""
    out: dict[str, float] = {}
    n_it = len(golden.record["iterations"])
    for f in _fields(golden):
        if f in EXACT_FIELDS:
            continue
        out[f] = max(
            float((got.tensors[f"it{it}.{f}"].double() - golden.tensors[f"it{it}.{f}"].double()).abs().max())
            for it in range(n_it)
        )
    for k in _metrics(golden):
        out[f"metric.{k}"] = max(
            abs(got.record["iterations"][it]["metrics"][k] - golden.record["iterations"][it]["metrics"][k])
            for it in range(n_it)
        )
    ck = 0.0
    for it in range(n_it):
        for name, (s, s2, sabs) in golden.record["iterations"][it]["checksums"].items():
            a_s, a_s2, _ = got.record["iterations"][it]["checksums"][name]
            ck = max(ck, abs(a_s - s) / sabs, abs(a_s2 - s2) / s2)
    out["checksum_rel"] = ck
    return out
