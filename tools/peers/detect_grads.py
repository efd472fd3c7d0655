"""``--detect`` reads the gradient: gradient-only v2 step dumps of the peers' OWN micro-batch code.

``tools/peers detect_grads [--venv V] [--keep DIR]`` (``tests/peers/test_peer_detect_gradients.py``).
The makers of :mod:`peers.makers.grad_only` run verl 0.9.1, OpenRLHF 0.11.2 (venv
``verl-openrlhf``) and SkyRL-train 0.3.1 (``skyrl-areal``) over two ranks × two micro-batches and
write ``grad_logprobs``, ``grad_values``, ``rank``, ``micro_batch`` and the rollout's outputs, with
no scalar loss. Each dump is detected from refppo's DEFAULT conventions with its sidecar
(:func:`peers.detect.detect_case`: exactly ``refppo diff DUMP --detect``) and compared with its
generating convention (``--preset PEER`` + the case's ``--set``):

* a case passes when that convention reproduces the dump (``preset_match``) and ``--detect``
  lists it (``found``, or ``equivalent``: differing only on keys the dump does not pin, re-checked);
* a control (name ending ``__control``: the same peer's code with a per-micro-batch normaliser)
  passes when its generating convention does NOT reproduce it and is NOT listed;
* a case in :data:`EXCLUDED` (named, with the reason) passes when it is NOT listed.

Each line reports the number of listed conventions and the seconds ``--detect`` took.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from peers.checks import dump_file
from peers.detect import detect_case
from peers.harness import Case, Report, Unit, parser, root_of, run_venvs, selected, workdir

CONTROL = "__control"
VENVS: dict[str, dict[str, Unit]] = {
    "verl-openrlhf": {
        "verl:grads": Unit("verl", "peers.makers.grad_only:make_verl"),
        "openrlhf:grads": Unit("openrlhf", "peers.makers.grad_only:make_openrlhf"),
    },
    "skyrl-areal": {"skyrl:grads": Unit("skyrl-train", "peers.makers.grad_only:make_skyrl")},
}
"""Side venv → unit (the preset before ``:``) → the maker."""
EXCLUDED: dict[str, str] = {
    "skyrl_grads_k3_loss_sum_norm": (
        "SkyRL-train 0.3.1's compute_approx_kl (skyrl_train/utils/ppo_utils.py) is @torch.no_grad(): "
        "the KL loss of workers/worker.py::forward_backward (use_kl_loss) adds its value and no gradient; "
        "no refppo convention has a KL loss without a gradient, so the preset reproduces the values of "
        "such a step and not its grad_logprobs"
    ),
}
"""Case → why its generating convention cannot be listed (must still be not found: a stale entry fails)."""


def check(unit: str, folder: Path, name: str) -> Case:
    """Detect one dump (module docstring)."""
    conv = json.loads((folder / f"{name}.set.json").read_text())
    t0 = time.perf_counter()
    r = detect_case(dump_file(folder, name), unit.split(":")[0], conv)
    r["seconds"] = round(time.perf_counter() - t0, 2)
    r["peer"], r["set"], r["control"] = unit, conv, name.endswith(CONTROL)
    listed = r["verdict"] in ("found", "equivalent")
    ok = (not r["preset_match"] and not listed) if r["control"] else (r["preset_match"] and listed)
    if name in EXCLUDED:
        r["why"] = EXCLUDED[name]
        ok = not listed
        r["verdict"] = "excluded" if ok else f"{r['verdict']} (stale EXCLUDED entry)"
    diff = " ".join(f"{k}: {a}->{b}" for k, (a, b) in r.get("differs", {}).items())
    what = "control, must not be listed: " if r["control"] else ""
    notes = [f"{what}{r['verdict']} n={r['n_detected']} in {r['seconds']} s {diff}".rstrip()]
    if r["verdict"] == "not found":
        notes.append(f"unmatched stages: {r['unmatched_stages']}; fitted: {r['fitted']}")
    return Case(unit, name, ok, {}, [], r, notes)


def main(argv: list[str] | None = None) -> int:
    ap = parser("detect_grads", __doc__, list(VENVS))
    args = ap.parse_args(argv)
    report = Report("detect_grads")
    with workdir(args.keep) as work:
        for venv, units in selected(args, VENVS).items():
            for unit, folder, st in run_venvs(report, {venv: units}, root_of(args), work):
                for name in st["result"]:
                    report.add(check(unit, folder, name))
    return report.finish(args.json_out)
