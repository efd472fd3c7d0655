#!/usr/bin/env python3
"""Show that ``--detect`` finds the peers' conventions without being told. Not part of CI.

For every dump ``tools/validate_presets.py`` makes with a peer's OWN code (side venvs, makers in
``tools/peer_makers/``), and every dump ``tools/validate_detect_trl.py`` makes with TRL 1.12.0's
whole ``PPOTrainer.train`` (group ``trl``), run :func:`refppo.oracle.detect.detection.detect` from
refppo's DEFAULT conventions with the dump's sidecar (exactly ``refppo diff DUMP --detect``, no
``--preset``) and check that the case's generating convention (``--preset PEER`` + the case's
``--set``, resolved as :func:`refppo.oracle.run.check_step` resolves them) is among ``detected``.

Verdicts per case:

* ``found``: an entry of ``detected`` equals the generating convention on every key except those
  ``--detect`` reports as ``undetermined`` (and the solved clip ranges equal the run's).
* ``equivalent``: the nearest entry differs only on keys this dump does not pin down and on none of
  the case's ``--set`` keys (the options the case exercises; unless the option provably acts on
  nothing in this dump, :func:`_inert_by_construction`), checked: the
  generating convention with those keys set to the entry's values still reproduces the dump through
  :func:`refppo.oracle.check.diagnose.check` (the verified pipeline). The keys are named.
* ``not found``: neither; ``nearest``, ``unmatched_stages`` and the differing keys are reported.

Each case also records ``preset_match``: whether the generating convention itself reproduces the
dump through the pipeline (a case whose own convention does not match proves nothing).

Usage: ``tools/validate_detect.py --dumps DIR`` (a ``validate_presets.py --keep DIR`` folder), or
without ``--dumps`` it makes the dumps first with the side venvs. Exit 0 when every case is found
or equivalent, or is in :data:`EXCLUDED` (named, with the reason), 1 otherwise. A side venv that is
not built (no ``READY`` stamp) is SKIPPED with the reason; a built one whose makers exit non-zero,
or a maker recorded as raised in a status file, is FAILED (exit 1) whatever the other groups did;
no case at all is exit 1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from validate_presets import GROUPS as PRESET_GROUPS  # noqa: E402
from validate_presets import PEERS_ROOT, peers_python  # noqa: E402

GROUPS: dict[str, tuple[str, ...]] = {**PRESET_GROUPS, "trl": ("trl",)}
"""Side venvs whose peers' code makes the dumps: those of ``tools/validate_presets.py`` and TRL
1.12.0 (its whole ``PPOTrainer.train``, ``tools/validate_detect_trl.py``)."""
MAKER = {"trl": "validate_detect_trl.py"}
"""Groups whose dumps come from another script than ``validate_presets.py --make DIR --group G``."""

EXCLUDED: dict[str, str] = {}
"""Case name → why ``--detect`` cannot list its generating convention (out of scope, named)."""


def _json(v: Any) -> Any:
    v = getattr(v, "value", v)
    return list(v) if isinstance(v, tuple) else v


def detect_case(dump_path: Path, preset: str, conv: dict[str, Any], limit: int = 100000) -> dict[str, Any]:
    """Detect from refppo's defaults; compare with ``preset`` + ``conv`` (the case's ``--set``)."""
    from refppo.dump.load import SIDECAR_SCORING_KEYS, load_dump
    from refppo.oracle.check.diagnose import check
    from refppo.oracle.check.settings import build_setup, parse_value
    from refppo.oracle.detect.detection import HP_KEYS, detect, setup_from_json
    from refppo.oracle.presets.registry import resolve_preset

    dump = load_dump(dump_path)
    sidecar = {k: parse_value(k, v) for k, v in dump.hparams.items() if k not in SIDECAR_SCORING_KEYS}
    parsed = {k: parse_value(k, v) for k, v in conv.items()}
    est = parsed.get("kl_estimator", sidecar.get("kl_estimator"))
    adv = parsed.get("advantage", sidecar.get("advantage"))
    p_conv, p_hp = resolve_preset(
        preset, None if est is None else str(est), None if adv is None else str(adv)
    )
    expected = build_setup(preset_conv=p_conv, preset_hp=p_hp, sidecar=sidecar, overrides=parsed)
    base = build_setup(preset_conv=None, preset_hp=None, sidecar=sidecar, overrides={})
    exp = {k: _json(v) for k, v in expected.convention_dict().items()}
    exp_hp = {k: getattr(expected.hp, k) for k in HP_KEYS}
    det = detect(dump, base, limit=limit)
    undet = set(det.undetermined)
    # kl_estimator undetermined only between value twins (k3/k3+: detect's note, no grad_logprobs):
    # still compare it, up to the "+" (a wrong base estimator must not pass as undetermined)
    twins = "kl_estimator" in undet and len({e.get("kl_estimator") for e in det.detected}) == 1
    if twins:
        undet.discard("kl_estimator")

    def same(k: str, got: Any, want: Any) -> bool:
        if twins and k == "kl_estimator" and isinstance(got, str) and isinstance(want, str):
            return got.removesuffix("+") == want.removesuffix("+")
        return bool(got == want)

    def differs(entry: dict[str, Any]) -> dict[str, Any]:
        out = {k: [exp[k], entry.get(k)] for k in exp if k not in undet and not same(k, entry.get(k), exp[k])}
        for k in HP_KEYS:
            given = k in entry and entry[k] is not None and exp_hp[k] is not None
            if given and abs(float(entry[k]) - float(exp_hp[k])) > 1e-9:
                out[k] = [exp_hp[k], entry[k]]
        return out

    res: dict[str, Any] = {
        # the generating convention itself reproduces the dump (else the case proves nothing)
        "preset_match": check(dump, expected, explain_divergence=False).match,
        "n_detected": det.n_detected,
        "listed": len(det.detected),
        "undetermined": sorted(det.undetermined),
        "unmatched_stages": det.unmatched_stages,
        "fitted": det.fitted,
    }
    if not det.detected:
        res.update(verdict="not found", nearest=det.nearest, differs=differs(det.nearest or {}))
        return res
    diffs = [differs(e) for e in det.detected]
    # nearest: fewest differences on the options the case exercises (its --set), then in all
    best = min(range(len(diffs)), key=lambda i: (len(set(diffs[i]) & set(conv)), len(diffs[i])))
    if not diffs[best]:
        res.update(verdict="found", differs={})
        return res
    # Does the dump pin the differing keys? Set them to the entry's values in the generating
    # convention and re-check through the verified pipeline. A difference on an option the case
    # exercises is never "equivalent": the table's option itself was not listed.
    entry = det.detected[best]
    trial = {**exp, **exp_hp, **{k: entry[k] for k in diffs[best]}}
    still = check(dump, setup_from_json(expected, trial), explain_divergence=False).match
    inert = _inert_by_construction(dump, expected)
    ok = still and not (set(diffs[best]) & set(conv)) - inert
    res.update(verdict="equivalent" if ok else "not found", nearest=entry, differs=diffs[best])
    res["inert"] = sorted(inert)
    return res


def _inert_by_construction(dump: Any, setup: Any) -> set[str]:
    """Options of ``setup`` that provably change nothing on this dump (not within a tolerance).

    ``score_clip``: no mapped score ``(s + b)·k`` reaches ``±C`` (AReaL's default ``C = 20``).
    """
    ex = setup.extras
    if ex.score_clip is None:
        return set()
    mapped = (dump.tensors["scores"].double() + ex.score_bias) * ex.score_scale
    return {"score_clip"} if float(mapped.abs().max()) <= ex.score_clip else set()


def make_dumps(groups: list[str], root: Path, out: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Run the makers of ``groups`` into ``out/GROUP``; return ``(skipped, failed)``, group → why.

    Skipped: the side venv is not built (no ``READY`` stamp). Failed: it is built but its makers
    exited non-zero (a failure, never a skip).
    """
    skipped, failed = {}, {}
    for group in groups:
        py = peers_python(group, root)
        if py is None:
            skipped[group] = f"no side venv {root / group} (run tools/build_peer_venvs.sh)"
            continue
        (out / group).mkdir(parents=True, exist_ok=True)
        script = str(REPO / "tools" / MAKER.get(group, "validate_presets.py"))
        argv = [str(py), script, "--make", str(out / group)] + ([] if group in MAKER else ["--group", group])
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if proc.returncode != 0:
            failed[group] = "the makers failed: " + " | ".join(proc.stderr.strip().splitlines()[-3:])
    return skipped, failed


def maker_crashes(dumps: Path) -> dict[str, str]:
    """``peer → why`` for every peer a status file under ``dumps`` records as not run (it raised)."""
    out = {}
    for status_file in sorted(dumps.glob("*/status-*.json")):
        for peer, st in json.loads(status_file.read_text()).items():
            if "skipped" in st:
                out[peer] = st["skipped"]
    return out


def cases(dumps: Path) -> list[tuple[str, str, Path, dict[str, Any]]]:
    """``(peer, case, dump, --set)`` for every case a status file under ``dumps`` lists as made."""
    out = []
    for status_file in sorted(dumps.glob("*/status-*.json")):
        for peer, st in json.loads(status_file.read_text()).items():
            for name in st.get("made", []):
                d = status_file.parent
                out.append((peer, name, d / f"{name}.pt", json.loads((d / f"{name}.set.json").read_text())))
    return out


def validate(dumps: Path, only: str | None, case: str | None = None) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for peer, name, path, conv in cases(dumps):
        if (only and only not in name) or (case and case != name):
            continue
        r = detect_case(path, peer.split(":")[0], conv)
        r["peer"], r["set"] = peer, conv
        if r["verdict"] == "not found" and name in EXCLUDED:
            r["verdict"] = "excluded"
            r["why"] = EXCLUDED[name]
        results[name] = r
        diff = " ".join(f"{k}: {a}->{b}" for k, (a, b) in r["differs"].items())
        print(f"{peer:<20} {name:<44} {r['verdict']:<10} n={r['n_detected']:<5} {diff}", flush=True)
        if r["verdict"] == "not found":
            print(f"    unmatched stages: {r['unmatched_stages']}; fitted: {r['fitted']}")
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--dumps", metavar="DIR", help="a validate_presets.py --keep folder (else make them)")
    ap.add_argument("--peers-root", default=str(PEERS_ROOT))
    ap.add_argument(
        "--group", choices=sorted(GROUPS), action="append", help="side venv(s) to make dumps with"
    )
    ap.add_argument("--only", metavar="SUBSTR", help="only the cases whose name contains SUBSTR")
    ap.add_argument("--case", metavar="NAME", help="only the case named exactly NAME")
    ap.add_argument("--json-out", metavar="FILE")
    args = ap.parse_args()
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        dumps = Path(args.dumps) if args.dumps else Path(tmp)
        if not args.dumps:
            skipped, failed = make_dumps(args.group or sorted(GROUPS), Path(args.peers_root), dumps)
            for g, why in skipped.items():
                print(f"{g}: SKIPPED ({why})")
        failed.update({p: f"the maker raised: {why}" for p, why in maker_crashes(dumps).items()})
        for g, why in failed.items():
            print(f"{g}: FAILED ({why})")
        results = validate(dumps, args.only, args.case)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2, default=str))
    bad = [n for n, r in results.items() if r["verdict"] == "not found"]
    counts = {
        v: sum(r["verdict"] == v for r in results.values()) for v in ("found", "equivalent", "excluded")
    }
    print(f"{len(results)} cases: {counts}, not found: {len(bad)}, crashed makers: {len(failed)}")
    return 1 if bad or failed or not results else 0


if __name__ == "__main__":
    raise SystemExit(main())
