#!/usr/bin/env python3
"""TRL GRPOTrainer's and AReaL's GRPO family, run as dumps: preset reproduction and ``--detect``.

Not part of CI (by hand; ``tests/peers/test_peer_grpo_trl_areal.py`` runs it where the venvs exist).
Two halves, two interpreters, as ``tools/validate_presets.py``:

1. ``--make OUTDIR --venv V`` runs in side venv ``V`` (``$REFPPO_PEERS_ROOT``, default
   ``/work/peervenv``): ``trl`` (TRL 1.12.0) and ``trl-grpo`` (TRL 1.16.0) run
   ``tools/peer_makers/trl_grpo.py`` (TRL's own advantage block of
   ``GRPOTrainer._generate_and_score_completions`` for every ``scale_rewards`` form, and
   ``GRPOTrainer._compute_loss`` for the case's ``loss_type``); ``skyrl-areal`` (AReaL 1.0.4) runs
   ``tools/peer_makers/areal_grpo.py`` (``PPOActor._compute_advantages`` with a group-mean
   ``reward_norm``, std level group or batch). Nothing from refppo is imported there.
2. Without ``--make`` (refppo's interpreter), for every dump:

   * ``refppo diff DUMP --preset PEER --set K=V ...`` (the case's keys) must MATCH;
   * the case's control (one key flipped) must MISMATCH (else the case proves nothing);
   * ``--detect`` from refppo's defaults (``tools/validate_detect.py::detect_case``, read as a
     library: the same verdicts) must list the generating convention (``found``, or
     ``equivalent``: differing only on keys the dump does not pin, re-checked through the pipeline).

   A case in :data:`DETECT_GAPS` may miss the third check (reported with the reason).
   ``--no-detect`` leaves the third check out (``detect: "not run"``): ``--detect`` costs minutes
   per case on TRL GRPO dumps, so ``tests/peers/test_peer_grpo_trl_areal.py`` runs the first two on
   every case and ``--detect`` per case (``--case NAME``, each its own run) on a representative subset.
   A case whose ``--set`` names a key refppo does not have is reported NOT EXPRESSIBLE: the same
   diff without that key must MISMATCH (the form is really different); it counts as a failure only
   if it matches. (TRL ``scale_rewards="batch"`` was one until ``group_std_level=batch`` existed;
   AReaL ``std_level: batch`` under ``mean_level: group`` is ``group_std_level=batch-centred``.)

Exit 0 when every case that ran passes and at least one ran; 1 otherwise. A venv that is not
built (no ``READY`` stamp) is SKIPPED with the reason; a built venv whose makers crash (non-zero
exit, no status file, or a maker that raised) is FAILED (exit 1), whatever the other venvs did.
``--json-out FILE`` writes the results.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PEERS_ROOT = Path(os.environ.get("REFPPO_PEERS_ROOT", "/work/peervenv"))
VENVS: dict[str, str] = {"trl": "trl", "trl-grpo": "trl", "skyrl-areal": "areal"}
"""Side venv → the preset its dumps are checked under."""
DETECT_GAPS: dict[str, str] = {}
"""Case name → why ``--detect`` does not list its generating convention (named, reported; the
preset reproduction and the control are still required)."""


def make(out: Path, venv: str) -> int:
    """Half 1 (the side venv): write the dumps and ``status-VENV.json``."""
    from peer_makers.common import run_peers

    if venv not in VENVS:
        print(f"validate_grpo_peers.py: --venv: unknown {venv!r}; valid: {sorted(VENVS)}", file=sys.stderr)
        return 2
    if VENVS[venv] == "trl":
        from peer_makers import trl_grpo

        return run_peers(out, {venv: trl_grpo.make})
    from peer_makers import areal_grpo

    return run_peers(out, {venv: areal_grpo.make})


def _diff(dump: Path, preset: str, conv: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    from refppo.oracle.cli import main as diff_main

    argv = [str(dump), "--preset", preset]
    for k, v in conv.items():
        argv += ["--set", f"{k}={v}"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        rc = diff_main([*argv, "--json"])
    try:
        return rc, json.loads(buf.getvalue())
    except json.JSONDecodeError:
        return rc, {}


def known_keys() -> set[str]:
    """Every key ``--set`` accepts (convention keys, oracle extras, hyperparameters)."""
    from refppo.oracle.check.settings import ALL_KEYS

    return set(ALL_KEYS)


def check_case(
    dump: Path, preset: str, conv: dict[str, Any], flip: dict[str, Any], keys: set[str], detect: bool = True
) -> dict[str, Any]:
    """Diff, control and (unless ``detect`` is False) ``--detect`` of one dump (module docstring)."""
    from validate_detect import detect_case

    unknown = sorted(set(conv) - keys)
    if unknown:
        plain = {k: v for k, v in conv.items() if k not in unknown}
        rc, rep = _diff(dump, preset, plain)
        return {
            "verdict": "not expressible",
            "unknown_keys": unknown,
            "ok": rc == 1,  # the nearest expressible form must not reproduce it
            "nearest_first_divergence": rep.get("first_divergence"),
            "command": _cmd(dump, preset, plain),
        }
    rc, rep = _diff(dump, preset, conv)
    errs = [q["max_abs_err"] for q in rep.get("quantities", {}).values()]
    crc, _ = _diff(dump, preset, {**conv, **flip})
    det = detect_case(dump, preset, conv) if detect else {"verdict": "not run"}
    found = det["verdict"] in ("found", "equivalent", "not run")
    gap = DETECT_GAPS.get(dump.stem) if not found else None
    ok = rc == 0 and crc == 1 and (found or gap is not None)
    return {
        "verdict": "MATCH" if rc == 0 else f"MISMATCH at {rep.get('first_divergence')}",
        "ok": ok,
        "quantities": len(errs),
        "max_abs_err": max(errs, default=float("nan")),
        "control": flip,
        "control_mismatches": crc == 1,
        "detect": det["verdict"],
        "detect_differs": det.get("differs", {}),
        "detect_n": det.get("n_detected"),
        "detect_gap": gap,
        "command": _cmd(dump, preset, conv),
    }


def _cmd(dump: Path, preset: str, conv: dict[str, Any]) -> str:
    return f"refppo diff {dump.name} --preset {preset} " + " ".join(f"--set {k}={v}" for k, v in conv.items())


def run_venv(
    venv: str, py: Path, out: Path, only: str | None, detect: bool = True, case: str | None = None
) -> dict[str, Any]:
    proc = subprocess.run(
        [str(py), str(Path(__file__).resolve()), "--make", str(out), "--venv", venv],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    status_file = out / f"status-{venv}.json"
    if proc.returncode != 0 or not status_file.exists():
        return {"failed": "the makers could not run: " + " | ".join(proc.stderr.strip().splitlines()[-3:])}
    st = json.loads(status_file.read_text())[venv]
    if "skipped" in st:  # the venv is built (READY) but its maker raised: a failure, not a skip
        return {"failed": f"the maker raised: {st['skipped']}", "tb": st.get("tb", [])}
    keys = known_keys()
    cases = {}
    for name in st["made"]:
        if (only and only not in name) or (case and case != name):
            continue
        conv = json.loads((out / f"{name}.set.json").read_text())
        flip = json.loads((out / f"{name}.control.json").read_text())
        cases[name] = check_case(out / f"{name}.pt", VENVS[venv], conv, flip, keys, detect)
        _print_case(name, cases[name])
    return {"cases": cases}


def _print_case(name: str, c: dict[str, Any]) -> None:
    mark = "OK " if c["ok"] else "BAD"
    if c["verdict"] == "not expressible":
        print(f"  {mark} {name:<44} NOT EXPRESSIBLE (no key {', '.join(c['unknown_keys'])}); "
              f"nearest form mismatches at {c['nearest_first_divergence']}", flush=True)  # fmt: skip
        return
    flip = " ".join(f"{k}={v}" for k, v in c["control"].items())
    control = "mismatches" if c["control_mismatches"] else "STILL MATCHES"
    differs = ", ".join(sorted(c["detect_differs"])) or "-"
    print(
        f"  {mark} {name:<44} {c['verdict']} ({c['quantities']} quantities, "
        f"max abs err {c['max_abs_err']:.1e}); "
        f"control {flip}: {control}; --detect: {c['detect']} (differs only on: {differs})",
        flush=True,
    )
    if c.get("detect_gap"):
        print(f"      --detect gap (named): {c['detect_gap']}", flush=True)
    print(f"      {c['command']}", flush=True)


def validate(
    venvs: list[str],
    root: Path,
    keep: Path | None,
    only: str | None,
    json_out: Path | None,
    detect: bool = True,
    case: str | None = None,
) -> int:
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "tools"))
    from validate_presets import peers_python

    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for venv in venvs:
            py = peers_python(venv, root)
            if py is None:
                result[venv] = {"skipped": f"no side venv {root / venv} with a READY stamp"}
                print(f"{venv}: SKIPPED ({result[venv]['skipped']})")
                continue
            out = (keep or Path(tmp)) / venv
            out.mkdir(parents=True, exist_ok=True)
            ver = subprocess.run(
                [str(py), "-c", f"from importlib.metadata import version; print(version('{VENVS[venv]}'))"],
                capture_output=True, text=True,
            ).stdout.strip()  # fmt: skip
            print(f"{venv}: {VENVS[venv]} {ver}", flush=True)
            result[venv] = {"version": ver, **run_venv(venv, py, out, only, detect, case)}
            if "failed" in result[venv]:
                print(f"{venv}: FAILED ({result[venv]['failed']})")
    ran = [c for r in result.values() for c in r.get("cases", {}).values()]
    crashed = [v for v, r in result.items() if "failed" in r]
    bad = [c for c in ran if not c["ok"]] + crashed
    expressed = [c for c in ran if c["verdict"] != "not expressible"]
    worst = max((c["max_abs_err"] for c in expressed), default=float("nan"))
    print(f"{len(ran)} cases ({len(ran) - len(expressed)} not expressible), {len(bad)} failure(s) "
          f"({len(crashed)} venv(s) whose makers crashed); max abs err {worst:.2e}")  # fmt: skip
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=2, default=str))
    return 1 if bad or not ran else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--make", metavar="OUTDIR", help="(internal) write the dumps; run by a side venv")
    ap.add_argument("--venv", choices=sorted(VENVS), action="append", help="side venv(s) (default all)")
    ap.add_argument("--peers-root", default=str(PEERS_ROOT), help="folder of the side venvs")
    ap.add_argument("--keep", metavar="DIR", help="keep the dumps in DIR")
    ap.add_argument("--only", metavar="SUBSTR", help="check only the cases whose name contains SUBSTR")
    ap.add_argument("--case", metavar="NAME", help="check only the case named exactly NAME")
    ap.add_argument("--json-out", metavar="FILE", help="write the results as JSON")
    ap.add_argument(
        "--no-detect", action="store_true", help="skip the --detect check (preset and control only)"
    )
    args = ap.parse_args()
    if args.make:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        return make(Path(args.make), (args.venv or ["trl"])[0])
    return validate(
        args.venv or sorted(VENVS),
        Path(args.peers_root),
        Path(args.keep) if args.keep else None,
        args.only,
        Path(args.json_out) if args.json_out else None,
        detect=not args.no_detect,
        case=args.case,
    )


if __name__ == "__main__":
    raise SystemExit(main())
