#!/usr/bin/env python3
"""Show that the ``verl`` and ``openrlhf`` presets reproduce the peers' OWN code. Not part of CI.

Two halves, two interpreters:

1. ``--make OUTDIR`` runs in a separate "peers" virtual environment holding verl 0.9.1 and
   OpenRLHF 0.11.2 (installed ``--no-deps``, plus torch==2.13.0 and the few small modules their
   loss/advantage modules import). It draws random right-padded inputs (junk in the padding) and
   computes every quantity with the peers' functions, then writes one ``.pt`` dump + sidecar per case.
   It imports nothing from refppo.
2. Without ``--make`` (run with refppo's own interpreter) it starts half 1 with ``--peers-python``
   (default ``$REFPPO_PEERS_PYTHON`` or ``/tmp/peers-venv/bin/python``) and runs the oracle
   (``refppo diff --preset <peer> --json``) on each dump, printing the max errors per quantity.

Peer functions called (as of verl 0.9.1 / OpenRLHF 0.11.2):

- verl ``verl/trainer/ppo/core_algos.py``: ``kl_penalty``, ``compute_gae_advantage_return`` (GAE +
  masked whitening), ``compute_policy_loss_vanilla``, ``compute_value_loss``, ``agg_loss``. The reward
  assembly of ``ray_trainer.apply_kl_penalty`` (``scores − β·KL·mask``) is one line restated here,
  because the real function wants a ``DataProto`` batch.
- OpenRLHF ``openrlhf/models/utils.py``: ``compute_approx_kl``, ``compute_reward``;
  ``openrlhf/trainer/ppo_utils/experience_maker.py``: ``get_advantages_and_returns`` (a method that
  does not use ``self``); ``openrlhf/models/loss.py``: ``PolicyLoss``, ``ValueLoss`` (built as
  ``trainer/ray/ppo_critic.py`` builds it, ``ValueLoss(value_clip)``: token-level whatever the
  actor's ``loss_agg_mode``, which the preset's ``value_loss_agg=token-mean`` expresses). The batch-level
  whitening of ``compute_advantages_and_returns`` (masked mean, population variance,
  ``clamp(var, 1e-8).rsqrt()``) is restated, because the real method wants a list of ``Experience``.

Import workarounds (nothing from them is called): the packages' ``__init__`` files pull in Ray actors,
vLLM, DeepSpeed and PEFT, so the package directories are mounted as bare namespace modules, and
``deepspeed`` plus ``openrlhf.trainer.ray.launcher`` are replaced by empty stand-in modules.

Exit codes: 0 every case matches (or the peers are not installed: a SKIPPED message), 1 a mismatch.
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
    "verl-openrlhf": ("verl", "openrlhf"),
    "skyrl-areal": ("skyrl", "areal"),
}
"""Side venv (``tools/build_peer_venvs.sh``) → the peers whose dump makers run in it."""


# ------------------------------------------------------------------------------------------------
# Half 1: runs in a peer's environment (tools/peer_makers; imports nothing from refppo).
# ------------------------------------------------------------------------------------------------


def make(out: Path, group: str) -> int:
    from peer_makers.common import run_peers

    makers: dict[str, Callable[[Path], list[str]]] = {}
    if group == "verl-openrlhf":
        from peer_makers import verl_openrlhf

        makers = {"verl": verl_openrlhf.make_verl, "openrlhf": verl_openrlhf.make_openrlhf}
    elif group == "skyrl-areal":
        from peer_makers import areal, skyrl

        makers = {"skyrl": skyrl.make, "areal": areal.make}
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

    Returns ``{peer: {"skipped": why} | {"cases": [{name, ok, max_abs_err, quantities, command}]}}``.
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
            p: {"skipped": f"the {group} interpreter could not run the dump makers ({tail})"}
            for p in GROUPS[group]
        }
    status = json.loads(status_file.read_text())
    result: dict[str, Any] = {}
    for peer, st in status.items():
        if "skipped" in st:
            result[peer] = {"skipped": st["skipped"], "tb": st.get("tb", [])}
            continue
        cases = []
        for name in st["made"]:
            conv = json.loads((out / f"{name}.set.json").read_text())
            argv = _reproduce(out / f"{name}.pt", peer, conv)
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                rc = diff_main([*argv, "--json"])
            rep = json.loads(buf.getvalue())
            quantities = {q: (r["max_abs_err"], r["tol"], r["ok"]) for q, r in rep["quantities"].items()}
            cases.append(
                {
                    "name": name,
                    "ok": rc == 0,
                    "first_divergence": rep.get("first_divergence"),
                    "diagnosis": rep.get("diagnosis", []),
                    "max_abs_err": max((e for e, _, _ in quantities.values()), default=0.0),
                    "quantities": quantities,
                    "command": "refppo diff " + " ".join(argv[1:]),
                }
            )
        result[peer] = {"cases": cases}
    return result


def _print(result: dict[str, Any], verbose: bool) -> int:
    failures = 0
    for peer, res in result.items():
        if "skipped" in res:
            print(f"{peer}: SKIPPED ({res['skipped']})")
            for line in res.get("tb", []):
                print(f"    {line}")
            continue
        for c in res["cases"]:
            verdict = "MATCH" if c["ok"] else f"MISMATCH at {c['first_divergence']}"
            n = len(c["quantities"])
            print(
                f"{peer:<9} {c['name']:<52} {verdict}  ({n} quantities, max abs err {c['max_abs_err']:.2e})"
            )
            print(f"    {c['command']}")
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
