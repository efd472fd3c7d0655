"""``--detect`` finds the peers' conventions without being told.

``tools/peers detect [--dumps DIR] [--venv V] [--only SUBSTR] [--case NAME]``
(``tests/peers/test_peer_detect.py``). For every dump ``tools/peers presets`` makes with a peer's OWN
code (the makers of :mod:`peers.makers`) and every dump of
:func:`peers.makers.trl_ppo.make_detect_cases` (TRL 1.12.0's whole ``PPOTrainer.train``, venv
``trl``), run :func:`refppo.oracle.detect.detection.detect` from refppo's DEFAULT conventions with the dump's
sidecar (exactly ``refppo diff DUMP --detect``, no ``--preset``) and check that the case's
generating convention (``--preset PEER`` + the case's ``--set``, resolved as
:func:`refppo.oracle.run.check_step` resolves them) is among ``detected``.

Verdicts per case:

* ``found``: an entry of ``detected`` equals the generating convention on every key except those
  ``--detect`` reports as ``undetermined`` (and the solved clip ranges equal the run's).
* ``equivalent``: the nearest entry differs only on keys this dump does not pin down and on none of
  the case's ``--set`` keys (the options the case exercises; unless the option provably acts on
  nothing in this dump, :func:`_inert_by_construction`), checked: the
  generating convention with those keys set to the entry's values still reproduces the dump through
  :func:`refppo.oracle.check.diagnose.check` (the verified pipeline). The keys are named.
* ``not found``: neither; ``nearest``, ``unmatched_stages`` and the differing keys are reported.
* ``excluded``: not found, and named in :data:`EXCLUDED` with the reason.

Each case also records ``preset_match``: whether the generating convention itself reproduces the
dump through the pipeline (a case whose own convention does not match proves nothing).

``--dumps DIR`` reads the dumps of a ``tools/peers presets --keep DIR`` folder (``DIR/VENV/``, with
its ``status.json``) instead of making them. A case passes when found, equivalent or excluded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peers.checks import dump_file
from peers.harness import Case, Report, Unit, parser, root_of, run_venvs, selected, workdir
from peers.presets import VENVS as PRESET_VENVS

if TYPE_CHECKING:
    from refppo.dump.load import Dump
    from refppo.oracle.check.settings import Setup
    from refppo.oracle.detect.detection import Detection

VENVS: dict[str, dict[str, Unit]] = {
    "verl-openrlhf": PRESET_VENVS["verl-openrlhf"],
    "skyrl-areal": PRESET_VENVS["skyrl-areal"],
    "trl": {"trl": Unit("trl", "peers.makers.trl_ppo:make_detect_cases")},
}
"""Side venv → the units whose dumps are detected: those of ``tools/peers presets`` and five more
TRL 1.12.0 runs (its whole ``PPOTrainer.train``)."""
WITH_REFPPO = {"trl"}

EXCLUDED: dict[str, str] = {}
"""Case name → why ``--detect`` cannot list its generating convention (out of scope, named)."""


def _json(v: Any) -> Any:
    v = getattr(v, "value", v)
    return list(v) if isinstance(v, tuple) else v


def _sidecar_settings(dump: Dump) -> dict[str, Any]:
    """The dump's sidecar conventions and hyperparameters, parsed (its scoring keys left out)."""
    from refppo.dump.keys import SIDECAR_SCORING_KEYS
    from refppo.oracle.check.settings import parse_value

    return {k: parse_value(k, v) for k, v in dump.hparams.items() if k not in SIDECAR_SCORING_KEYS}


def detect_case(dump_path: Path, preset: str, conv: dict[str, Any], limit: int = 100000) -> dict[str, Any]:
    """Detect from refppo's defaults; compare with ``preset`` + ``conv`` (the case's ``--set``)."""
    from refppo.dump.load import load_dump
    from refppo.oracle.check.diagnose import check
    from refppo.oracle.detect.detection import detect, setup_from_json

    dump = load_dump(dump_path)
    expected, base = _setups(dump, preset, conv)
    det = detect(dump, base, limit=limit)
    target = _Target.of(expected, det)
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
        res.update(verdict="not found", nearest=det.nearest, differs=target.differs(det.nearest or {}))
        return res
    diffs = [target.differs(e) for e in det.detected]
    # nearest: fewest differences on the options the case exercises (its --set), then in all
    best = min(range(len(diffs)), key=lambda i: (len(set(diffs[i]) & set(conv)), len(diffs[i])))
    if not diffs[best]:
        res.update(verdict="found", differs={})
        return res
    # Does the dump pin the differing keys? Set them to the entry's values in the generating
    # convention and re-check through the verified pipeline. A difference on an option the case
    # exercises is never "equivalent": the table's option itself was not listed.
    entry = det.detected[best]
    trial = {**target.conv, **target.hp, **{k: entry[k] for k in diffs[best]}}
    still = check(dump, setup_from_json(expected, trial), explain_divergence=False).match
    inert = _inert_by_construction(dump, expected)
    ok = still and not (set(diffs[best]) & set(conv)) - inert
    res.update(verdict="equivalent" if ok else "not found", nearest=entry, differs=diffs[best])
    res["inert"] = sorted(inert)
    return res


def _setups(dump: Dump, preset: str, conv: dict[str, Any]) -> tuple[Setup, Setup]:
    """The generating convention (``preset`` with the case's ``conv`` over the dump's sidecar, as
    ``refppo diff --preset P --set ...`` resolves it) and ``--detect``'s base (refppo's defaults
    with the sidecar)."""
    from refppo.oracle.check.settings import build_setup, parse_value
    from refppo.oracle.presets.registry import resolve_preset

    sidecar = _sidecar_settings(dump)
    parsed = {k: parse_value(k, v) for k, v in conv.items()}
    est = parsed.get("kl_estimator", sidecar.get("kl_estimator"))
    adv = parsed.get("advantage", sidecar.get("advantage"))
    loss_est = parsed.get("kl_loss_estimator", sidecar.get("kl_loss_estimator"))
    p_conv, p_hp = resolve_preset(  # as refppo diff resolves it (refppo.oracle.run)
        preset,
        None if est is None else str(est),
        None if adv is None else str(adv),
        None if loss_est is None else str(loss_est),
    )
    expected = build_setup(preset_conv=p_conv, preset_hp=p_hp, sidecar=sidecar, overrides=parsed)
    base = build_setup(preset_conv=None, preset_hp=None, sidecar=sidecar, overrides={})
    return expected, base


@dataclass(frozen=True)
class _Target:
    """The generating convention as ``--detect`` entries spell it: ``conv`` (key → JSON value),
    ``hp`` (the solved hyperparameters, ``HP_KEYS``), ``undet`` (keys not compared) and ``twins``
    (``kl_estimator`` undetermined only between value twins ``k3``/``k3+``: compared up to the ``+``)."""

    conv: dict[str, Any]
    hp: dict[str, Any]
    undet: frozenset[str]
    twins: bool

    @classmethod
    def of(cls, expected: Setup, det: Detection) -> _Target:
        from refppo.oracle.detect.detection import HP_KEYS

        undet = set(det.undetermined)
        # kl_estimator undetermined only between value twins (k3/k3+: detect's note, no grad_logprobs):
        # still compare it, up to the "+" (a wrong base estimator must not pass as undetermined)
        twins = "kl_estimator" in undet and len({e.get("kl_estimator") for e in det.detected}) == 1
        if twins:
            undet.discard("kl_estimator")
        conv = {k: _json(v) for k, v in expected.convention_dict().items()}
        return cls(conv, {k: getattr(expected.hp, k) for k in HP_KEYS}, frozenset(undet), twins)

    def _same(self, k: str, got: Any, want: Any) -> bool:
        if self.twins and k == "kl_estimator" and isinstance(got, str) and isinstance(want, str):
            return got.removesuffix("+") == want.removesuffix("+")
        return bool(got == want)

    def differs(self, entry: dict[str, Any]) -> dict[str, Any]:
        """Key → ``[generating value, entry's value]`` where ``entry`` differs (hyperparameters: > 1e-9)."""
        exp, exp_hp = self.conv, self.hp
        out = {
            k: [exp[k], entry.get(k)]
            for k in exp
            if k not in self.undet and not self._same(k, entry.get(k), exp[k])
        }
        for k in exp_hp:
            given = k in entry and entry[k] is not None and exp_hp[k] is not None
            if given and abs(float(entry[k]) - float(exp_hp[k])) > 1e-9:
                out[k] = [exp_hp[k], entry[k]]
        return out


def _inert_by_construction(dump: Dump, setup: Setup) -> set[str]:
    """Options of ``setup`` that provably change nothing on this dump (not within a tolerance).

    ``score_clip``: no mapped score ``(s + b)·k`` reaches ``±C`` (AReaL's default ``C = 20``).
    """
    sm = setup.conv.score
    if sm.clip is None:
        return set()
    mapped = (dump.tensors["scores"].double() + sm.bias) * sm.scale
    return {"score_clip"} if float(mapped.abs().max()) <= sm.clip else set()


def make_dumps(
    report: Report, venvs: dict[str, dict[str, Unit]], root: Path, out: Path
) -> list[tuple[str, Path, str]]:
    """Run the makers of ``venvs`` into ``out/VENV``; ``(unit, folder, case)`` of every dump made
    (skips and failures go to ``report``)."""
    made = []
    for venv, units in venvs.items():
        for unit, folder, st in run_venvs(report, {venv: units}, root, out, with_refppo=venv in WITH_REFPPO):
            made += [(unit, folder, name) for name in st["result"]]
    return made


def read_dumps(report: Report, dumps: Path) -> list[tuple[str, Path, str]]:
    """``(unit, folder, case)`` of every dump the ``DIR/*/status.json`` files list as made; a unit
    recorded as raised is a failure in ``report``."""
    made = []
    for status_file in sorted(dumps.glob("*/status.json")):
        for unit, st in json.loads(status_file.read_text()).items():
            if "error" in st:
                report.fail(unit, f"raised {st['error']}", st.get("tb"))
                continue
            made += [(unit, status_file.parent, name) for name in st["result"]]
    return made


def check(unit: str, folder: Path, name: str) -> Case:
    conv = json.loads((folder / f"{name}.set.json").read_text())
    r = detect_case(dump_file(folder, name), unit.split(":")[0], conv)
    r["peer"], r["set"] = unit, conv
    if r["verdict"] == "not found" and name in EXCLUDED:
        r["verdict"], r["why"] = "excluded", EXCLUDED[name]
    diff = " ".join(f"{k}: {a}->{b}" for k, (a, b) in r["differs"].items())
    notes = [f"{r['verdict']} n={r['n_detected']} {diff}".rstrip()]
    if r["verdict"] == "not found":
        notes.append(f"unmatched stages: {r['unmatched_stages']}; fitted: {r['fitted']}")
    return Case(unit, name, r["verdict"] != "not found", {}, [], r, notes)


def main(argv: list[str] | None = None) -> int:
    ap = parser("detect", __doc__, list(VENVS))
    ap.add_argument("--dumps", type=Path, metavar="DIR", help="a `tools/peers presets --keep` folder")
    ap.add_argument("--only", metavar="SUBSTR", help="only the cases whose name contains SUBSTR")
    ap.add_argument("--case", metavar="NAME", help="only the case named exactly NAME")
    args = ap.parse_args(argv)
    report = Report("detect")
    if args.dumps is not None and not args.dumps.is_dir():
        from peers.harness import bad_input

        return bad_input("tools/peers detect", f"--dumps: no folder {args.dumps}")
    with workdir(args.keep) as work:
        if args.dumps is not None:
            made = read_dumps(report, args.dumps)
        else:
            made = make_dumps(report, selected(args, VENVS), root_of(args), work)
        for unit, folder, name in made:
            if (args.only and args.only not in name) or (args.case and args.case != name):
                continue
            report.add(check(unit, folder, name))
    verdicts = [c.info["verdict"] for c in report.cases]
    print(
        "verdicts: "
        + ", ".join(f"{v} {verdicts.count(v)}" for v in ("found", "equivalent", "excluded", "not found"))
    )
    return report.finish(args.json_out)
