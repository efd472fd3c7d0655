"""``refppo verify``'s runner and entry point: one table row per (step, device, dtype).

A row is the worst :func:`~refppo.verify.tolerance.compare` of a step over all its outputs and
seeds; a crash of either implementation is a FAIL row. Exit 0 iff every row passes, 2 for an
unusable ``--device``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from refppo.verify.batches import make_batch
from refppo.verify.cases import CASES
from refppo.verify.tolerance import Tolerance, compare, tolerance_for


@dataclass(frozen=True)
class Row:
    """One table row: the worst comparison of a step over all its outputs and seeds."""

    step: str
    device: str
    dtype: str
    max_abs: float
    max_rel: float
    tolerance: str
    ok: bool
    worst: str


def run_step(name: str, device: torch.device, dtype: torch.dtype, seeds: Sequence[int]) -> Row:
    """Run one step's case on every seed; a raised exception counts as a failure."""
    tol = tolerance_for(dtype)
    max_abs = max_rel = 0.0
    ok, worst = True, ""
    for seed in seeds:
        batch = make_batch(seed, dtype)
        try:
            pairs = CASES[name](batch, device)
        except Exception as exc:  # a crash of either implementation is a FAIL row, not a traceback
            return Row(
                name, device.type, _dtype_name(dtype), math.inf, math.inf, _tol_str(tol), False, repr(exc)
            )
        for output, actual, expected, mask in pairs:
            c = compare(actual, expected, dtype, mask)
            if not c.ok and ok:
                worst = f"{output} (seed {seed})"
            ok = ok and c.ok
            max_abs, max_rel = max(max_abs, c.max_abs), max(max_rel, c.max_rel)
    return Row(name, device.type, _dtype_name(dtype), max_abs, max_rel, _tol_str(tol), ok, worst)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tol_str(tol: Tolerance) -> str:
    return f"atol={tol.atol:g}·S rtol={tol.rtol:g}"


LEGEND = (
    "\ntolerance: an output passes when |vectorized − naive| ≤ atol·S + rtol·|naive| at every element,\n"
    "  S = max(1, max |naive|) over that output (the rounding of a sum grows with the terms summed, not\n"
    "  with the result; refppo/verify/tolerance.py says why these values); max abs err / max rel err:\n"
    "  the worst |vectorized − naive| and |vectorized − naive| / |naive| (where naive ≠ 0) over every\n"
    "  output and seed, so a large rel err on a near-zero element can pass within atol·S."
)
"""Printed under the table: what its tolerance and error columns mean."""


def format_table(rows: Sequence[Row]) -> str:
    """The table ``refppo verify`` prints."""
    header = ("step", "device", "dtype", "max abs err", "max rel err", "tolerance", "result")
    body = [
        (
            r.step,
            r.device,
            r.dtype,
            f"{r.max_abs:.3e}",
            f"{r.max_rel:.3e}",
            r.tolerance,
            "PASS" if r.ok else f"FAIL {r.worst}".rstrip(),
        )
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body, strict=True)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in body]
    return "\n".join(lines)


def devices() -> list[torch.device]:
    """CPU, and CUDA when available."""
    out = [torch.device("cpu")]
    if torch.cuda.is_available():
        out.append(torch.device("cuda"))
    return out


def device_problem(name: str) -> str | None:
    """``None`` if ``name`` is a device this process can run on, else one line saying why not."""
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        return f"--device {name!r}: not a device name ({e})"
    if dev.type == "cpu":
        return None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            return f"--device {name!r}: CUDA is not available (torch {torch.__version__}, {build})"
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            return f"--device {name!r}: only {torch.cuda.device_count()} CUDA device(s) visible"
        return None
    if dev.type == "mps" and torch.backends.mps.is_available():
        return None
    return f"--device {name!r}: device type {dev.type!r} is not available here"


def main(argv: list[str]) -> int:
    """Entry point of ``refppo verify``; returns 0 iff every row passes, 2 for an unusable ``--device``."""
    parser = argparse.ArgumentParser(
        prog="refppo verify",
        description="Check every vectorized core step against its naive twin on seeded ragged batches.",
    )
    parser.add_argument("--seeds", type=int, default=20, help="seeded batches per step (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument(
        "--device", action="append", default=None, help="device to run on (repeatable; default cpu and cuda)"
    )
    args = parser.parse_args(argv)
    for name in args.device or ():
        problem = device_problem(name)
        if problem is not None:
            print(f"refppo verify: {problem}", file=sys.stderr)
            return 2
    devs = [torch.device(d) for d in args.device] if args.device else devices()
    seeds = list(range(args.seed, args.seed + args.seeds))
    start = time.perf_counter()
    rows = [
        run_step(name, dev, dtype, seeds)
        for name in CASES
        for dev in devs
        for dtype in (torch.float64, torch.float32)
    ]
    print(format_table(rows))
    print(LEGEND)
    n_fail = sum(not r.ok for r in rows)
    elapsed = time.perf_counter() - start
    print(f"\n{len(rows) - n_fail}/{len(rows)} passed on {len(seeds)} seeds in {elapsed:.1f} s")
    return 1 if n_fail else 0
