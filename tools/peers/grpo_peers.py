"""TRL GRPOTrainer's and AReaL's GRPO family, run as dumps: preset reproduction and ``--detect``.

``tools/peers grpo_peers [--venv V] [--no-detect] [--case NAME] [--dumps DIR]``
(``tests/peers/test_peer_grpo_trl_areal.py``). A ``files`` request of :mod:`peers.harness` per venv:

1. The peer's half: ``trl`` (TRL 1.12.0) and ``trl-grpo`` (TRL 1.16.0) run
   :mod:`peers.makers.trl_grpo` (TRL's own advantage block of
   ``GRPOTrainer._generate_and_score_completions`` for every ``scale_rewards`` form, and
   ``GRPOTrainer._compute_loss`` for the case's ``loss_type``); ``skyrl-areal`` (AReaL 1.0.4) runs
   :mod:`peers.makers.areal_grpo` (``PPOActor._compute_advantages`` with a group-mean
   ``reward_norm``, std level group or batch). Nothing from refppo is imported there.
2. refppo's half, for every dump:

   * ``refppo diff DUMP --preset PEER --set K=V ...`` (the case's keys) must MATCH;
   * the case's control (one key flipped) must MISMATCH (else the case proves nothing);
   * ``--detect`` from refppo's defaults (:func:`peers.detect.detect_case`: the same verdicts)
     must list the generating convention (``found``, or ``equivalent``: differing only on keys the
     dump does not pin, re-checked through the pipeline).

   A case in :data:`DETECT_GAPS` may miss the third check (reported with the reason).
   ``--no-detect`` leaves the third check out (``detect: "not run"``): ``--detect`` costs minutes
   per case on TRL GRPO dumps, so ``tests/peers/test_peer_grpo_trl_areal.py`` runs the first two on
   every case and ``--detect`` per case (``--case NAME``, each its own run) on a representative
   subset. A case whose ``--set`` names a key refppo does not have is reported NOT EXPRESSIBLE: the
   same diff without that key must MISMATCH (the form is really different); it fails only if it
   matches. (TRL ``scale_rewards="batch"`` was one until ``group_std_level=batch`` existed; AReaL
   ``std_level: batch`` under ``mean_level: group`` is ``group_std_level=batch-centred``.)

``--dumps DIR``: the peers' dumps in ``DIR/VENV``, made there once and reused by every later run
with the same ``DIR`` while the request, the venv's interpreter and the ``tools/peers`` code are
the same (:func:`peers.harness.run_peer`, ``reuse``); the test makes each venv's dumps once per
session this way, not once per case.
"""

from __future__ import annotations

import json
from pathlib import Path

from peers.checks import diff, dump_file, preset_case
from peers.harness import Case, Report, Unit, parser, root_of, run_venvs, selected, workdir

VENVS: dict[str, dict[str, Unit]] = {
    "trl": {"trl": Unit("trl", "peers.makers.trl_grpo:make")},
    "trl-grpo": {"trl-grpo": Unit("trl", "peers.makers.trl_grpo:make")},
    "skyrl-areal": {"skyrl-areal": Unit("areal", "peers.makers.areal_grpo:make")},
}
"""Side venv → its unit (named after the venv) → (distribution, maker)."""
PRESET: dict[str, str] = {"trl": "trl", "trl-grpo": "trl", "skyrl-areal": "areal"}
"""Side venv → the preset its dumps are checked under."""
DETECT_GAPS: dict[str, str] = {}
"""Case name → why ``--detect`` does not list its generating convention (named, reported; the
preset reproduction and the control are still required)."""


def not_expressible(unit: str, folder: Path, name: str, preset: str, unknown: list[str]) -> Case:
    """The case's ``--set`` without the keys refppo lacks: must NOT reproduce the dump."""
    sets = json.loads((folder / f"{name}.set.json").read_text())
    d = diff(dump_file(folder, name), preset, {k: v for k, v in sets.items() if k not in unknown})
    info = {"verdict": "not expressible", "unknown_keys": unknown, "first_divergence": d.first}
    notes = [
        f"NOT EXPRESSIBLE (no key {', '.join(unknown)}); nearest form mismatches at {d.first}",
        d.command,
    ]
    return Case(unit, name, d.rc == 1, {}, [], info, notes)


def check(unit: str, folder: Path, name: str, preset: str, keys: set[str], detect: bool) -> Case:
    """Diff, control and (unless ``detect`` is False) ``--detect`` of one dump (module docstring)."""
    from peers.detect import detect_case

    sets = json.loads((folder / f"{name}.set.json").read_text())
    unknown = sorted(set(sets) - keys)
    if unknown:
        return not_expressible(unit, folder, name, preset, unknown)
    case = preset_case(unit, folder, name, preset)
    det = detect_case(dump_file(folder, name), preset, sets) if detect else {"verdict": "not run"}
    found = det["verdict"] in ("found", "equivalent", "not run")
    gap = DETECT_GAPS.get(name) if not found else None
    case.ok = case.ok and (found or gap is not None)
    differs = ", ".join(sorted(det.get("differs", {}))) or "-"
    case.info.update(detect=det["verdict"], detect_differs=det.get("differs", {}), detect_gap=gap)
    case.info["detect_n"] = det.get("n_detected")
    case.notes.insert(0, f"--detect: {det['verdict']} (differs only on: {differs})")
    if gap:
        case.notes.append(f"--detect gap (named): {gap}")
    return case


def main(argv: list[str] | None = None) -> int:
    ap = parser("grpo_peers", __doc__, list(VENVS))
    ap.add_argument("--only", metavar="SUBSTR", help="check only the cases whose name contains SUBSTR")
    ap.add_argument("--case", metavar="NAME", help="check only the case named exactly NAME")
    ap.add_argument(
        "--no-detect", action="store_true", help="skip the --detect check (preset and control only)"
    )
    ap.add_argument(
        "--dumps", type=Path, metavar="DIR", help="make the peers' dumps in DIR once; later runs reuse them"
    )
    args = ap.parse_args(argv)
    from refppo.oracle.check.settings import ALL_KEYS

    report = Report("grpo_peers")
    with workdir(args.dumps or args.keep) as work:
        chosen = selected(args, VENVS)
        for unit, folder, st in run_venvs(report, chosen, root_of(args), work, reuse=args.dumps is not None):
            for name in st["result"]:
                if (args.only and args.only not in name) or (args.case and args.case != name):
                    continue
                report.add(check(unit, folder, name, PRESET[unit], set(ALL_KEYS), not args.no_detect))
    return report.finish(args.json_out)
