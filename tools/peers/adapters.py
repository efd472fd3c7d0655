"""``refppo.capture.adapters`` against the peers' OWN installed code.

``tools/peers adapters [--peer P]`` (``tests/peers/test_adapters.py``). A ``files`` request of
:mod:`peers.harness` per peer, in its side venv with the repository on the path (the adapters
are what is tested):

1. The peer's half: :mod:`peers.makers.adapters` builds the peer's container by running the peer's
   code (verl's ``DataProto`` through ``apply_kl_penalty``/``compute_advantage`` and
   ``ppo_loss``/``value_loss``; OpenRLHF's ``Experience`` through
   ``compute_advantages_and_returns`` and ``PolicyLoss``/``ValueLoss``; one TRL ``PPOTrainer``
   step), turns it into a dump with the adapter, and writes it with its controls (one field of the
   container corrupted each).
2. refppo's half: ``refppo diff DUMP --preset P --set <the adapter's convention>`` on every dump
   (must match, exit 0) and on every control (must mismatch, exit 1, first at the corrupted
   quantity). When the installed oracle has no dump v2 (no ``refppo.dump.load.GRAD_KEYS``) the
   makers leave the gradients out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from peers.checks import diff
from peers.harness import Case, Control, Report, Unit, parser, root_of, run_venvs, workdir

PEERS: dict[str, tuple[str, Unit]] = {
    "verl": ("verl-openrlhf", Unit("verl", "peers.makers.adapt_verl:make")),
    "openrlhf": ("verl-openrlhf", Unit("openrlhf", "peers.makers.adapt_openrlhf:make")),
    "trl": ("trl", Unit("trl", "peers.makers.adapt_trl:make")),
}
"""Peer → (its side venv, its maker). Each peer runs in its own interpreter."""


def oracle_has_v2() -> bool:
    """The installed oracle reads dump v2 (its loader has ``GRAD_KEYS``)."""
    import importlib

    for module in ("refppo.dump.load", "refppo.dump.load"):  # the layered layout, the flat one
        try:
            return hasattr(importlib.import_module(module), "GRAD_KEYS")
        except ImportError:
            continue
    return False


def check(peer: str, out: Path, made: dict[str, Any], v2: bool) -> Case:
    """One adapter dump under ``--preset peer`` (must match) and its controls (caught at the field)."""
    name = made["name"]
    conv = json.loads((out / f"{name}.set.json").read_text())
    d = diff(out / f"{name}.safetensors", peer, conv)
    controls = []
    for i, quantity in enumerate(made["controls"]):
        c = diff(out / f"{name}.control{i}.safetensors", peer, conv)
        caught = c.rc == 1 and c.first == quantity
        what = "caught" if caught else f"NOT CAUGHT (exit {c.rc}, first {c.first})"
        controls.append(Control(f"{quantity} corrupted (must first diverge there)", caught, what))
    quantities = {q: [r["max_abs_err"], r["tol"], r["ok"]] for q, r in d.report.get("quantities", {}).items()}
    notes = [d.command]
    if d.rc != 0:
        notes += [f"{q:<14} max_abs_err={e:.3e} tol={t:.1e} ok={ok}" for q, (e, t, ok) in quantities.items()]
        notes += [f"! {x}" for x in d.report.get("diagnosis", [])] + ([f"! {d.error}"] if d.error else [])
    info = {
        "first_divergence": d.first,
        "diagnosis": d.report.get("diagnosis", []),
        "dtype": d.report.get("dump", {}).get("dtype"),
        "quantities": quantities,
        "keys": made["keys"],
        "command": d.command,
        "v2": v2,
    }
    return Case(peer, name, d.rc == 0, {"abs": d.max_abs_err}, controls, info, notes)


def main(argv: list[str] | None = None) -> int:
    ap = parser("adapters", __doc__, sorted({venv for venv, _ in PEERS.values()}))
    ap.add_argument("--peer", choices=sorted(PEERS), action="append", help="peer(s) to check (default all)")
    args = ap.parse_args(argv)
    report = Report("adapters")
    v2 = oracle_has_v2()
    peers = [p for p in args.peer or PEERS if not args.venv or PEERS[p][0] in args.venv]
    with workdir(args.keep) as work:
        for peer in peers:
            venv, unit = PEERS[peer]
            runs = run_venvs(
                report, {venv: {peer: unit}}, root_of(args), work / peer, with_refppo=True, options={"v2": v2}
            )
            for _, out, st in runs:
                for made in st["result"]:
                    report.add(check(peer, out, made, v2))
    return report.finish(args.json_out)
