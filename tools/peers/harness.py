"""refppo's half of every peer validator: the side venvs, the protocol, the bookkeeping.

Side venvs: ``$REFPPO_PEERS_ROOT/NAME`` (default root ``/work/peervenv``), built by
``tools/build_peer_venvs.sh``; a venv counts as built when it holds a ``READY`` stamp and
``bin/python`` (:func:`peers_python`).

Protocol (:func:`run_peer`; the peer's half is :mod:`peers.peer_side`): write ``OUT/request.json``
(and, for a ``batch`` request, the plain tensors ``OUT/batch.pt``), run
``VENV/bin/python tools/peers --peer-side OUT`` with ``tools/`` (and, ``with_refppo``, the
repository) on ``PYTHONPATH``, read ``OUT/status.json`` back (JSON; tensors with
``weights_only=True``: nothing is unpickled). ``reuse``: a folder that already holds the status of
the same request, made by the same interpreter and the same ``tools/peers`` code (``OUT/made.json``),
is read back without running the peer again (a validator's ``--dumps DIR``: each peer's dumps made
once for several runs, e.g. once per test session).

Bookkeeping (:class:`Report`), one rule for every validator:

- a venv that is not built is SKIPPED, with the reason;
- a built venv whose interpreter exits non-zero, times out or writes no status, or a unit that
  raised, is FAILED, whatever the other venvs did;
- a case passes when its check passes and every control mismatches as required;
- exit 0 when at least one case ran, every case passed and nothing FAILED; 1 otherwise (a
  mismatch, a control that still matches, a crash, or nothing run at all: a skip is never a pass);
  2 on bad input (argparse, or one line naming what is wrong).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TOOLS = Path(__file__).resolve().parent.parent
REPO = TOOLS.parent
DEFAULT_ROOT = Path("/work/peervenv")


def peers_root() -> Path:
    """``$REFPPO_PEERS_ROOT``, else :data:`DEFAULT_ROOT` (read at each call)."""
    return Path(os.environ.get("REFPPO_PEERS_ROOT") or DEFAULT_ROOT)


def peers_python(venv: str, root: Path | None = None) -> Path | None:
    """The interpreter of side venv ``venv`` under ``root`` when it is built (``READY``), else None."""
    env = (root or peers_root()) / venv
    py = env / "bin" / "python"
    return py if (env / "READY").exists() and py.exists() else None


def not_built(venv: str, root: Path | None = None) -> str:
    """The reason a skip names for a venv :func:`peers_python` does not find."""
    return f"no side venv {(root or peers_root()) / venv} with a READY stamp (run tools/build_peer_venvs.sh)"


@dataclass(frozen=True)
class Unit:
    """One call on the peer's side: the distribution whose version is reported, ``module:function``."""

    dist: str
    target: str


def run_peer(
    py: Path,
    out: Path,
    units: Mapping[str, Unit],
    *,
    kind: str = "files",
    setup: str | None = None,
    options: Mapping[str, Any] | None = None,
    with_refppo: bool = False,
    timeout: float = 1500,
    reuse: bool = False,
) -> tuple[dict[str, Any] | None, str]:
    """Run ``units`` in interpreter ``py`` (module docstring): ``(status, "")`` or ``(None, why)``;
    ``reuse``: the status already in ``out`` when it was made for the same request (module docstring)."""
    request = {
        "kind": kind,
        "setup": setup,
        "units": {u: [x.dist, x.target] for u, x in units.items()},
        "options": dict(options or {}),
    }
    if not reuse:
        return _run_peer(py, out, request, with_refppo, timeout)
    made = {"request": request, "python": str(py), "code": _peers_code_digest()}
    with (out / ".lock").open("w") as lock:  # one maker per folder, whoever else asks meanwhile
        fcntl.flock(lock, fcntl.LOCK_EX)
        status_file, made_file = out / "status.json", out / "made.json"
        if status_file.exists() and made_file.exists() and json.loads(made_file.read_text()) == made:
            status: dict[str, Any] = json.loads(status_file.read_text())
            return status, ""
        result = _run_peer(py, out, request, with_refppo, timeout)
        if result[0] is not None:
            made_file.write_text(json.dumps(made, indent=2))
        return result


def _peers_code_digest() -> str:
    """sha256 of every ``tools/peers`` source file (the makers included): a change invalidates reuse."""
    h = hashlib.sha256()
    for f in sorted((TOOLS / "peers").rglob("*.py")):
        h.update(str(f.relative_to(TOOLS)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _run_peer(
    py: Path, out: Path, request: dict[str, Any], with_refppo: bool, timeout: float
) -> tuple[dict[str, Any] | None, str]:
    """Write ``request``, run the peer's side in ``py``, read its status (:func:`run_peer`)."""
    (out / "request.json").write_text(json.dumps(request, indent=2))
    (out / "status.json").unlink(missing_ok=True)
    (out / "made.json").unlink(missing_ok=True)  # only a run with reuse stamps what it made
    path = [str(TOOLS), *([str(REPO)] if with_refppo else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    argv = [str(py), str(TOOLS / "peers"), "--peer-side", str(out)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"{py} did not finish within {timeout:.0f} s"
    status_file = out / "status.json"
    if proc.returncode != 0 or not status_file.exists():
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return None, f"{py} exited {proc.returncode} without a status ({tail})"
    status: dict[str, Any] = json.loads(status_file.read_text())
    return status, ""


@dataclass
class Control:
    """A variation that must NOT reproduce the peer (else the case proves nothing)."""

    label: str
    ok: bool
    """It mismatched (or was caught where it had to be)."""
    detail: str = ""


@dataclass
class Case:
    """One comparison of refppo with a peer's own code."""

    unit: str
    name: str
    ok: bool
    """The check itself passed (controls aside)."""
    errors: dict[str, float] = field(default_factory=dict)
    """Measure → max abs error (``nan``: not measured)."""
    controls: list[Control] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    """Lines printed under the case (the command that reproduces it, the diagnosis)."""

    @property
    def passed(self) -> bool:
        return self.ok and all(c.ok for c in self.controls)


def _fmt(e: float) -> str:
    return f"{e:.1e}"


class Report:
    """Skips, failures, versions and cases of one validator run; prints as it goes."""

    def __init__(self, validator: str) -> None:
        self.validator = validator
        self.skipped: dict[str, str] = {}
        self.failed: dict[str, dict[str, Any]] = {}
        self.versions: dict[str, str] = {}
        self.cases: list[Case] = []

    def skip(self, what: str, why: str) -> None:
        self.skipped[what] = why
        print(f"{what}: SKIPPED ({why})", flush=True)

    def fail(self, what: str, why: str, tb: list[str] | None = None) -> None:
        self.failed[what] = {"why": why, "tb": list(tb or [])}
        print(f"{what}: FAILED ({why})", flush=True)
        for line in tb or []:
            print(f"    {line}")

    def version(self, unit: str, line: str) -> None:
        self.versions[unit] = line
        print(f"{unit}: {line}", flush=True)

    def add(self, case: Case) -> Case:
        self.cases.append(case)
        errs = "  ".join(f"{k} {_fmt(v)}" for k, v in case.errors.items())
        mark = "OK " if case.passed else "BAD"
        print(f"  {mark} {case.unit:<20} {case.name:<48} {errs}", flush=True)
        for c in case.controls:
            print(f"      {'ok ' if c.ok else 'BAD'} control {c.label}: {c.detail}", flush=True)
        for line in case.notes:
            print(f"      {line}", flush=True)
        return case

    def summary(self) -> dict[str, Any]:
        worst: dict[str, float] = {}
        for c in self.cases:
            for k, v in c.errors.items():
                if not math.isnan(v):
                    worst[k] = max(worst.get(k, 0.0), v)
        controls = [ctl for c in self.cases for ctl in c.controls]
        return {
            "cases": len(self.cases),
            "passed": sum(c.passed for c in self.cases),
            "controls": len(controls),
            "controls_mismatched": sum(c.ok for c in controls),
            "max_abs_err": worst,
            "skipped": sorted(self.skipped),
            "failed": sorted(self.failed),
        }

    def exit_code(self) -> int:
        if self.failed or not self.cases or not all(c.passed for c in self.cases):
            return 1
        return 0

    def finish(self, json_out: Path | None = None) -> int:
        """Print the summary line, write ``json_out``; return the exit code (module docstring)."""
        s = self.summary()
        worst = ", ".join(f"{k} {v:.2e}" for k, v in s["max_abs_err"].items()) or "-"
        print(
            f"{self.validator}: {s['cases']} cases run, {s['passed']} passed; controls "
            f"{s['controls_mismatched']}/{s['controls']} mismatched; max abs err {worst}; "
            f"skipped {len(s['skipped'])}, failed {len(s['failed'])}",
            flush=True,
        )
        if not self.cases:
            print(f"{self.validator}: no case ran (every venv skipped or failed): not a pass")
        rc = self.exit_code()
        if json_out is not None:
            doc = {
                "validator": self.validator,
                "exit": rc,
                "summary": s,
                "skipped": self.skipped,
                "failed": self.failed,
                "versions": self.versions,
                "cases": [asdict(c) | {"passed": c.passed} for c in self.cases],
            }
            json_out.write_text(json.dumps(doc, indent=2, default=str))
        return rc


def run_venvs(
    report: Report,
    venvs: Mapping[str, Mapping[str, Unit]],
    root: Path,
    work: Path,
    *,
    batch: Mapping[str, Any] | None = None,
    **kw: Any,
) -> Iterator[tuple[str, Path, dict[str, Any]]]:
    """Run each venv's units (:func:`run_peer`); yield ``(unit, out_dir, status)`` of each unit
    that ran, after recording the skips, the failures and the versions in ``report``."""
    for venv, units in venvs.items():
        py = peers_python(venv, root)
        if py is None:
            report.skip(venv, not_built(venv, root))
            continue
        out = work / venv
        out.mkdir(parents=True, exist_ok=True)
        if batch is not None:
            import torch

            torch.save(dict(batch), out / "batch.pt")
        status, why = run_peer(py, out, units, kind="batch" if batch is not None else "files", **kw)
        if status is None:
            report.fail(venv, why)
            continue
        for unit, st in status.items():
            if "error" in st:  # the venv is built but this unit raised: a failure, never a skip
                report.fail(unit, f"raised {st['error']}", st.get("tb"))
                continue
            report.version(unit, f"{units[unit].dist} {st['version']}")
            yield unit, out, st


@contextlib.contextmanager
def workdir(keep: Path | None) -> Iterator[Path]:
    """``keep`` (created) or a temporary folder removed afterwards."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory(prefix="refppo-peers-") as tmp:
        yield Path(tmp)


def parser(name: str, doc: str | None, venvs: list[str]) -> argparse.ArgumentParser:
    """The options every validator takes: ``--venv`` (repeatable), ``--peers-root``, ``--keep``,
    ``--json-out``."""
    first = (doc or "").strip().splitlines()[0] if doc else None
    ap = argparse.ArgumentParser(prog=f"tools/peers {name}", description=first)
    ap.add_argument("--venv", choices=venvs, action="append", help="side venv(s) to run (default all)")
    ap.add_argument(
        "--peers-root",
        type=Path,
        default=None,
        help=f"folder of the side venvs (default $REFPPO_PEERS_ROOT or {DEFAULT_ROOT})",
    )
    ap.add_argument("--keep", type=Path, metavar="DIR", help="keep the peers' files in DIR")
    ap.add_argument("--json-out", type=Path, metavar="FILE", help="write the report as JSON")
    return ap


def selected(args: argparse.Namespace, table: Mapping[str, Any]) -> dict[str, Any]:
    """The rows of ``table`` named by ``--venv`` (all without it), in the table's order."""
    chosen = set(args.venv or table)
    return {k: v for k, v in table.items() if k in chosen}


def root_of(args: argparse.Namespace) -> Path:
    root: Path = args.peers_root or peers_root()
    return root


def bad_input(prog: str, what: str) -> int:
    """One line on stderr naming what is wrong; exit status 2."""
    print(f"{prog}: {what}", file=sys.stderr)
    return 2
