#!/usr/bin/env python3
"""Check ``refppo.capture.adapters`` against the peers' OWN installed code. Run by the e2e tests.

Two halves, two interpreters (as ``tools/validate_presets.py``):

1. ``--make OUTDIR --peer P`` runs in a side venv of ``tools/build_peer_venvs.sh`` with the
   repository on ``PYTHONPATH``: ``tools/peer_makers/adapters.py`` builds the peer's container by
   running the peer's code (verl's ``DataProto`` through ``apply_kl_penalty``/``compute_advantage``
   and ``ppo_loss``/``value_loss``; OpenRLHF's ``Experience`` through
   ``compute_advantages_and_returns`` and ``PolicyLoss``/``ValueLoss``; one TRL ``PPOTrainer``
   step), turns it into a dump with the adapter, and writes it with a control (one field of the
   container corrupted).
2. Without ``--make`` (refppo's interpreter): runs half 1 in each built venv, then
   ``refppo diff DUMP --preset P --set <the adapter's convention>`` on every dump (must match, exit
   0) and on every control (must mismatch, exit 1, first at the corrupted quantity). Prints the
   peer version, the verdicts and the max errors; ``--json-out`` writes them.

A venv that is not built (no ``READY`` stamp) is reported as SKIPPED. When the installed oracle has
no dump v2 (no ``refppo.dump.load.GRAD_KEYS``) the makers leave the gradients out.
Exit codes: 0 every case matches and every control mismatches (or all skipped), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
from validate_presets import PEERS_ROOT, peers_python  # noqa: E402  (tools/ is not a package)

VENV: dict[str, str] = {"verl": "verl-openrlhf", "openrlhf": "verl-openrlhf", "trl": "trl"}
"""Peer → the side venv its maker runs in."""
PACKAGE: dict[str, str] = {"verl": "verl", "openrlhf": "openrlhf", "trl": "trl"}


def make(out: Path, peer: str, v2: bool) -> int:
    """Half 1 (a peer's interpreter): run the maker; ``out/status-PEER.json`` says what was made."""
    import importlib.metadata
    import traceback

    from peer_makers.adapters import maker

    status: dict[str, Any] = {"version": importlib.metadata.version(PACKAGE[peer])}
    try:
        status["cases"] = maker(peer)(out, v2)
    except Exception as exc:  # report why the peer could not run, then stop
        status["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
        status["tb"] = traceback.format_exc().strip().splitlines()[-6:]
    (out / f"status-{peer}.json").write_text(json.dumps(status, indent=2))
    return 0


def oracle_has_v2() -> bool:
    from refppo.dump import load

    return hasattr(load, "GRAD_KEYS")


def _diff(dump: Path, peer: str, conv: dict[str, Any]) -> tuple[int, dict[str, Any], str]:
    import contextlib
    import io

    from refppo.oracle.cli import main as diff_main

    argv = [str(dump), "--preset", peer]
    for k, v in conv.items():
        argv += ["--set", f"{k}={v}"]
    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        rc = diff_main([*argv, "--json"])
    command = "refppo diff " + " ".join(argv[1:])
    if rc == 2:  # bad input: one line on stderr, no report
        return (
            rc,
            {"quantities": {}, "first_divergence": None, "diagnosis": [err.getvalue().strip()]},
            command,
        )
    return rc, json.loads(buf.getvalue()), command


def run_peer(peer: str, py: Path, out: Path, v2: bool) -> dict[str, Any]:
    """Make ``peer``'s dumps with ``py`` and diff each (and its control) against the preset."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tools")])}
    argv = [str(py), str(Path(__file__).resolve()), "--make", str(out), "--peer", peer]
    proc = subprocess.run(
        [*argv, *(["--v2"] if v2 else [])], capture_output=True, text=True, env=env, timeout=1500
    )
    status_file = out / f"status-{peer}.json"
    if proc.returncode != 0 or not status_file.exists():
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return {"error": f"the {VENV[peer]} interpreter could not run the maker ({tail})"}
    status: dict[str, Any] = json.loads(status_file.read_text())
    if "error" in status:
        return status
    cases = []
    for case in status["cases"]:
        name = case["name"]
        conv = json.loads((out / f"{name}.set.json").read_text())
        rc, rep, command = _diff(out / f"{name}.safetensors", peer, conv)
        controls = []
        for i, quantity in enumerate(case["controls"]):
            crc, crep, _ = _diff(out / f"{name}.control{i}.safetensors", peer, conv)
            first = crep.get("first_divergence")
            controls.append(
                {
                    "corrupted": quantity,
                    "rc": crc,
                    "first_divergence": first,
                    "caught": crc == 1 and first == quantity,
                }
            )
        quantities = {q: (r["max_abs_err"], r["tol"], r["ok"]) for q, r in rep["quantities"].items()}
        cases.append(
            {
                "name": name,
                "ok": rc == 0,
                "first_divergence": rep.get("first_divergence"),
                "diagnosis": rep.get("diagnosis", []),
                "dtype": rep.get("dump", {}).get("dtype"),
                "max_abs_err": max((e for e, _, _ in quantities.values()), default=0.0),
                "quantities": quantities,
                "keys": case["keys"],
                "command": command,
                "controls": controls,
            }
        )
    return {"version": status["version"], "cases": cases}


def _print(result: dict[str, Any]) -> int:
    failures = 0
    for peer, res in result.items():
        if "skipped" in res or "error" in res:
            word = "SKIPPED" if "skipped" in res else "ERROR"
            failures += word == "ERROR"
            print(f"{peer}: {word} ({res.get('skipped') or res.get('error')})")
            for line in res.get("tb", []):
                print(f"    {line}")
            continue
        for c in res["cases"]:
            verdict = "MATCH" if c["ok"] else f"MISMATCH at {c['first_divergence']}"
            print(
                f"{peer} {res['version']:<7} {c['name']:<40} {verdict}  ({len(c['quantities'])} quantities, "
                f"{c['dtype']}, max abs err {c['max_abs_err']:.2e})"
            )
            print(f"    {c['command']}")
            for ctl in c["controls"]:
                first = ctl["first_divergence"]
                what = "caught" if ctl["caught"] else f"NOT CAUGHT (exit {ctl['rc']}, first {first})"
                print(f"    control (must first diverge at {ctl['corrupted']}): {what}")
                failures += not ctl["caught"]
            if not c["ok"]:
                for q, (err, tol, ok) in c["quantities"].items():
                    print(f"    {q:<14} max_abs_err={err:.3e} tol={tol:.1e} ok={ok}")
                for d in c["diagnosis"]:
                    print(f"    ! {d}")
            failures += not c["ok"]
    return failures


def validate(peers: list[str], root: Path, keep: Path | None, json_out: Path | None) -> int:
    sys.path.insert(0, str(REPO))
    v2 = oracle_has_v2()
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for peer in peers:
            py = peers_python(VENV[peer], root)
            if py is None:
                result[peer] = {
                    "skipped": f"no side venv {root / VENV[peer]} (run tools/build_peer_venvs.sh)"
                }
                continue
            out = (keep or Path(tmp)) / peer
            out.mkdir(parents=True, exist_ok=True)
            result[peer] = {**run_peer(peer, py, out, v2), "v2": v2}
    failures = _print(result)
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=2))
    return 1 if failures else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--make", metavar="OUTDIR", help="(internal) write the dumps; run by a side venv")
    ap.add_argument("--peer", choices=sorted(VENV), action="append", help="peer(s) to check (default all)")
    ap.add_argument("--v2", action="store_true", help="(internal, with --make) keep the dump-v2 keys")
    ap.add_argument("--peers-root", default=str(PEERS_ROOT), help="folder of the side venvs")
    ap.add_argument("--keep", metavar="DIR", help="keep the dumps in DIR")
    ap.add_argument("--json-out", metavar="FILE", help="write the results as JSON")
    args = ap.parse_args()
    if args.make:
        return make(Path(args.make), (args.peer or ["verl"])[0], args.v2)
    return validate(
        args.peer or sorted(VENV),
        Path(args.peers_root),
        Path(args.keep) if args.keep else None,
        Path(args.json_out) if args.json_out else None,
    )


if __name__ == "__main__":
    raise SystemExit(main())
