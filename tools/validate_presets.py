#!/usr/bin/env python3
"""Show that the peer presets reproduce the peers' OWN installed code. Not part of CI.

Two halves, two interpreters:

1. ``--make OUTDIR --group G`` runs in a side venv built by ``tools/build_peer_venvs.sh``
   (``$REFPPO_PEERS_ROOT``, default ``/work/peervenv``): ``verl-openrlhf`` (verl 0.9.1, OpenRLHF
   0.11.2) or ``skyrl-areal`` (SkyRL-train 0.3.1, AReaL 1.0.4), each installed ``--no-deps`` with
   inert stand-ins for ray, vllm, deepspeed, ... (``tools/peer_makers/common.py``). The makers in
   ``tools/peer_makers/`` draw random right-padded batches (junk on the padding), compute every
   quantity with the peer's own functions (the docstring of each maker lists what is called and the
   one-line glue restated because the real caller wants Ray workers or batch objects) and write one
   dump + sidecar + the ``--set`` keys per case. They import nothing from refppo.
2. Without ``--make`` (refppo's interpreter) it runs half 1 in every built venv and
   ``refppo diff DUMP --preset <peer> --set ...`` on each dump, printing the verdict, the max
   errors and the command that reproduces it. Each case also has a *control*: the same diff with
   the option the case exercises flipped, which must NOT match (else the case proves nothing).

Critic-free cases (issue #13: GRPO, Dr. GRPO, RLOO, REINFORCE++ and its baseline, no critic in the
dump) come from ``tools/peer_makers/critic_free.py``; its makers are named ``PEER:critic-free`` and
checked under ``--preset PEER`` with the case's ``--set advantage=...``. verl's ``opo``, ``gpg``,
``grpo_passk`` and OpenRLHF's ``flash_reinforce`` come from ``tools/peer_makers/critic_free_more.py``
(makers ``PEER:critic-free-more``), checked the same way.

TRL 1.12.0 runs in its own venv through ``tools/validate_trl_preset.py`` (TRL's whole
``PPOTrainer.train``, captured with a tracer). A venv that is not built (no ``READY`` stamp) is
reported as SKIPPED; a built venv whose makers crash (non-zero exit, no status file, or a maker
recorded as raised) is FAILED, whatever the other venvs did (the rule of
``tools/validate_grpo_peers.py`` and ``tools/validate_detect.py``). ``$REFPPO_PEERS_PYTHON`` still
overrides the ``verl-openrlhf`` interpreter.

Exit codes: 0 some case ran, every case that ran matches and every control mismatches; 1 otherwise
(a mismatch, a vacuous control, a crashed maker, or nothing run at all).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PEERS_ROOT = Path(os.environ.get("REFPPO_PEERS_ROOT", "/work/peervenv"))
GROUPS: dict[str, tuple[str, ...]] = {
    "verl-openrlhf": (
        "verl",
        "openrlhf",
        "verl:critic-free",
        "openrlhf:critic-free",
        "verl:critic-free-more",
        "openrlhf:critic-free-more",
    ),
    "skyrl-areal": ("skyrl", "areal", "skyrl:critic-free"),
}
"""Side venv (``tools/build_peer_venvs.sh``) → the dump makers that run in it. ``PEER:critic-free``
(``tools/peer_makers/critic_free.py``; ``PEER:critic-free-more``: verl ``opo``, ``gpg``,
``grpo_passk`` and OpenRLHF ``flash_reinforce``, ``tools/peer_makers/critic_free_more.py``) is
checked under ``--preset PEER`` with ``--set advantage=…``."""


# ------------------------------------------------------------------------------------------------
# Half 1: runs in a peer's environment (tools/peer_makers; imports nothing from refppo).
# ------------------------------------------------------------------------------------------------


def make(out: Path, group: str) -> int:
    from peer_makers.common import run_peers

    makers: dict[str, Callable[[Path], list[str]]] = {}
    if group == "verl-openrlhf":
        from peer_makers import critic_free, critic_free_more, verl_openrlhf

        makers = {
            "verl": verl_openrlhf.make_verl,
            "openrlhf": verl_openrlhf.make_openrlhf,
            "verl:critic-free": critic_free.make_verl,
            "openrlhf:critic-free": critic_free.make_openrlhf,
            "verl:critic-free-more": critic_free_more.make_verl,
            "openrlhf:critic-free-more": critic_free_more.make_openrlhf,
        }
    elif group == "skyrl-areal":
        from peer_makers import areal, critic_free, skyrl

        makers = {"skyrl": skyrl.make, "areal": areal.make, "skyrl:critic-free": critic_free.make_skyrl}
    else:
        print(
            f"validate_presets.py: --group: unknown group {group!r}; valid: {sorted(GROUPS)}", file=sys.stderr
        )
        return 2
    return run_peers(out, makers)


# ------------------------------------------------------------------------------------------------
# Half 2: runs with refppo's interpreter.
# ------------------------------------------------------------------------------------------------


def peers_python(group: str, root: Path | None = None) -> Path | None:
    """The interpreter of side venv ``group`` when it is built (``READY`` stamp), else None.

    ``$REFPPO_PEERS_PYTHON`` overrides the ``verl-openrlhf`` interpreter (the older single-venv set-up).
    """
    if group == "verl-openrlhf" and os.environ.get("REFPPO_PEERS_PYTHON"):
        py = Path(os.environ["REFPPO_PEERS_PYTHON"])
        return py if py.exists() else None
    env = (root or PEERS_ROOT) / group
    py = env / "bin" / "python"
    return py if (env / "READY").exists() and py.exists() else None


def _reproduce(dump: Path, peer: str, conv: dict[str, Any]) -> list[str]:
    argv = [str(dump), "--preset", peer]
    for k, v in conv.items():
        argv += ["--set", f"{k}={v}"]
    return argv


def run_group(group: str, py: Path, out: Path) -> dict[str, Any]:
    """Make the dumps of ``group`` with ``py`` and diff each against its preset + ``--set``.

    Returns ``{peer: {"failed": why, "tb": [...]} | {"cases": [{name, ok, max_abs_err, quantities,
    command}]}}``: the venv is built, so a maker that did not run is a failure, never a skip.
    """
    import contextlib
    import io

    from refppo.oracle.cli import main as diff_main

    proc = subprocess.run(
        [str(py), str(Path(__file__).resolve()), "--make", str(out), "--group", group],
        capture_output=True,
        text=True,
        timeout=900,
    )
    status_file = out / f"status-{'-'.join(GROUPS[group])}.json"
    if proc.returncode != 0 or not status_file.exists():
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return {
            p: {"failed": f"the {group} interpreter could not run the dump makers ({tail})"}
            for p in GROUPS[group]
        }
    status = json.loads(status_file.read_text())
    result: dict[str, Any] = {}
    for peer, st in status.items():
        if "skipped" in st:  # the venv is built (READY) but its maker raised: a failure, not a skip
            result[peer] = {"failed": f"the maker raised: {st['skipped']}", "tb": st.get("tb", [])}
            continue
        cases = []
        for name in st["made"]:
            conv = json.loads((out / f"{name}.set.json").read_text())
            preset = peer.split(":")[0]  # "verl:critic-free" runs under --preset verl
            argv = _reproduce(out / f"{name}.pt", preset, conv)
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                rc = diff_main([*argv, "--json"])
            rep = json.loads(buf.getvalue())
            quantities = {q: (r["max_abs_err"], r["tol"], r["ok"]) for q, r in rep["quantities"].items()}
            control_file = out / f"{name}.control.json"
            control: dict[str, Any] | None = None
            if control_file.exists():
                flip = json.loads(control_file.read_text())
                buf = io.StringIO()
                with contextlib.redirect_stdout(buf):
                    crc = diff_main([*_reproduce(out / f"{name}.pt", preset, {**conv, **flip}), "--json"])
                control = {"set": flip, "mismatches": crc == 1}
            cases.append(
                {
                    "name": name,
                    "ok": rc == 0,
                    "first_divergence": rep.get("first_divergence"),
                    "diagnosis": rep.get("diagnosis", []),
                    "max_abs_err": max((e for e, _, _ in quantities.values()), default=0.0),
                    "quantities": quantities,
                    "command": "refppo diff " + " ".join(argv[1:]),
                    "control": control,
                }
            )
        result[peer] = {"cases": cases}
    return result


def _print(result: dict[str, Any], verbose: bool) -> int:
    failures = 0
    for peer, res in result.items():
        if "skipped" in res or "failed" in res:
            word = "SKIPPED" if "skipped" in res else "FAILED"
            print(f"{peer}: {word} ({res.get('skipped') or res['failed']})")
            for line in res.get("tb", []):
                print(f"    {line}")
            failures += word == "FAILED"
            continue
        for c in res["cases"]:
            verdict = "MATCH" if c["ok"] else f"MISMATCH at {c['first_divergence']}"
            n = len(c["quantities"])
            print(
                f"{peer:<9} {c['name']:<52} {verdict}  ({n} quantities, max abs err {c['max_abs_err']:.2e})"
            )
            print(f"    {c['command']}")
            if c.get("control") is not None:
                ctl = c["control"]
                flip = " ".join(f"--set {k}={v}" for k, v in ctl["set"].items())
                word = (
                    "mismatches (the option matters)" if ctl["mismatches"] else "STILL MATCHES: vacuous case"
                )
                print(f"    control {flip}: {word}")
                if not ctl["mismatches"]:
                    failures += 1
            if verbose or not c["ok"]:
                for q, (err, tol, ok) in c["quantities"].items():
                    print(f"    {q:<14} max_abs_err={err:.3e} tol={tol:.1e} ok={ok}")
            if not c["ok"]:
                failures += 1
                for d in c["diagnosis"]:
                    print(f"    ! {d}")
    return failures


def validate(groups: list[str], root: Path, keep: Path | None, verbose: bool, json_out: Path | None) -> int:
    sys.path.insert(0, str(REPO))
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for group in groups:
            py = peers_python(group, root)
            if py is None:
                for p in GROUPS[group]:
                    result[p] = {"skipped": f"no side venv {root / group} (run tools/build_peer_venvs.sh)"}
                continue
            out = (keep or Path(tmp)) / group
            out.mkdir(parents=True, exist_ok=True)
            result.update(run_group(group, py, out))
    failures = _print(result, verbose)
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=2))
    if not any(res.get("cases") for res in result.values()):
        print("no case ran (every side venv skipped or crashed): not a pass")
        return 1
    return 1 if failures else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--make", metavar="OUTDIR", help="(internal) write the peers' dumps; run by a side venv")
    ap.add_argument(
        "--group", choices=sorted(GROUPS), action="append", help="side venv(s) to run (default all)"
    )
    ap.add_argument(
        "--peers-root",
        default=str(PEERS_ROOT),
        help="folder of the side venvs (default $REFPPO_PEERS_ROOT or /work/peervenv)",
    )
    ap.add_argument("--keep", metavar="DIR", help="keep the dumps in DIR")
    ap.add_argument("--verbose", action="store_true", help="print every quantity's error")
    ap.add_argument("--json-out", metavar="FILE", help="write the results as JSON")
    args = ap.parse_args()
    if args.make:
        return make(Path(args.make), (args.group or ["verl-openrlhf"])[0])
    return validate(
        args.group or sorted(GROUPS),
        Path(args.peers_root),
        Path(args.keep) if args.keep else None,
        args.verbose,
        Path(args.json_out) if args.json_out else None,
    )


if __name__ == "__main__":
    raise SystemExit(main())
