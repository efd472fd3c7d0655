"""The checks the validators share (refppo's interpreter): ``refppo diff`` in-process, error measures.

- :func:`diff`: ``refppo diff DUMP [--preset P] [--set K=V ...] [EXTRA ...] --json`` through
  :func:`refppo.oracle.cli.main`, its JSON report, and the command line that reproduces it.
- :func:`preset_case`: a dump reproduced under its preset and ``--set`` (must exit 0), and its
  control (the option the case exercises flipped; must exit 1).
- :func:`err`: ``max |a − b|`` (over ``mask`` when given) and its tolerance ``rtol·max(1, max|b|)``.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peers.harness import Case, Control


@dataclass
class Diff:
    rc: int
    """0 match, 1 mismatch, 2 bad input (``error`` says why; ``report`` is then empty)."""
    report: dict[str, Any]
    command: str
    error: str = ""

    @property
    def max_abs_err(self) -> float:
        return max((q["max_abs_err"] for q in self.report.get("quantities", {}).values()), default=0.0)

    @property
    def first(self) -> Any:
        return self.report.get("first_divergence")


def diff_argv(
    dump: Path, preset: str | None, sets: Mapping[str, Any], extra: Sequence[str] = ()
) -> list[str]:
    argv = [str(dump), *(["--preset", preset] if preset else [])]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    return [*argv, *extra]


def diff(dump: Path, preset: str | None, sets: Mapping[str, Any], extra: Sequence[str] = ()) -> Diff:
    """``refppo diff`` on ``dump`` with its JSON report (module docstring)."""
    from refppo.oracle.cli import main as diff_main

    argv = diff_argv(dump, preset, sets, extra)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = diff_main([*argv, "--json"])
    command = "refppo diff " + " ".join([dump.name, *argv[1:]])
    if rc == 2:  # bad input: one line on stderr, no report
        return Diff(rc, {}, command, err.getvalue().strip())
    return Diff(rc, json.loads(out.getvalue()), command)


def dump_file(folder: Path, name: str) -> Path:
    """The dump a maker wrote for case ``name``: ``NAME.pt`` or ``NAME.safetensors``."""
    pt = folder / f"{name}.pt"
    return pt if pt.exists() else folder / f"{name}.safetensors"


def preset_case(unit: str, folder: Path, name: str, preset: str, verbose: bool = False) -> Case:
    """``name``'s dump under ``--preset preset`` + its ``NAME.set.json`` (must match), and, when
    ``NAME.control.json`` exists, with those keys on top (must mismatch)."""
    sets = json.loads((folder / f"{name}.set.json").read_text())
    path = dump_file(folder, name)
    d = diff(path, preset, sets)
    controls = []
    control_file = folder / f"{name}.control.json"
    if control_file.exists():
        flip = json.loads(control_file.read_text())
        c = diff(path, preset, {**sets, **flip})
        label = " ".join(f"--set {k}={v}" for k, v in flip.items())
        word = "mismatches (the option matters)" if c.rc == 1 else f"exit {c.rc}: STILL MATCHES, vacuous"
        controls.append(Control(label, c.rc == 1, word))
    quantities = {q: [r["max_abs_err"], r["tol"], r["ok"]] for q, r in d.report.get("quantities", {}).items()}
    notes = [d.command]
    facts = folder / f"{name}.facts.json"
    if facts.exists():
        notes.append(facts.read_text().strip())
    if verbose or d.rc != 0:
        notes += [f"{q:<14} max_abs_err={e:.3e} tol={t:.1e} ok={ok}" for q, (e, t, ok) in quantities.items()]
    if d.rc != 0:
        notes += [f"! {x}" for x in d.report.get("diagnosis", [])] + ([f"! {d.error}"] if d.error else [])
    info = {
        "verdict": "MATCH" if d.rc == 0 else f"MISMATCH at {d.first}",
        "first_divergence": d.first,
        "diagnosis": d.report.get("diagnosis", []),
        "quantities": quantities,
        "command": d.command,
        "sets": sets,
    }
    return Case(unit, name, d.rc == 0, {"abs": d.max_abs_err}, controls, info, notes)


def err(a: Any, b: Any, mask: Any = None, rtol: float = 0.0) -> tuple[float, float]:
    """``(max |a − b|, rtol·max(1, max|b|))``, both over ``mask`` when given (float64)."""
    import torch

    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    if mask is not None:
        a, b = a[mask], b[mask]
    return float((a - b).abs().max()), rtol * max(1.0, float(b.abs().max()))
