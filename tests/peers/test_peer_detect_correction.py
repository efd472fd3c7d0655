"""``--detect`` lists verl 0.9.1's rollout correction on dumps made by verl's own code (issue #22).

:mod:`peers.makers.verl_correction` (side venv ``verl-openrlhf``; skipped with the reason without
it) writes one full-step dump per case, its policy term ``compute_policy_loss_vanilla`` with the
weights of verl's ``compute_rollout_correction_weights`` (token / sequence, TIS caps 2, 1.5, 1.8,
IcePop ``"0.5_2.0"``). From refppo's defaults, ``--detect`` must list each generating correction
exactly (the five ``rollout_is*`` keys), the caps that are not named values solved to them; each
dump is a control for the others (no other case's correction is listed), and the generating
convention with the mode flipped must not reproduce the dump.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from _peers import REPO, TOOLS, require

from refppo.dump.load import load_dump
from refppo.oracle.check.diagnose import check
from refppo.oracle.detect.detection import detect, setup_from_json

KEYS = ("rollout_is", "rollout_is_agg", "rollout_is_mode", "rollout_is_low", "rollout_is_high")


def _rc(c: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(c.get(k, "product" if k == "rollout_is_agg" else None) for k in KEYS)


def test_detect_lists_verls_rollout_correction(tmp_path: Path) -> None:
    py = require("verl-openrlhf")
    code = (
        "import sys; from pathlib import Path; from peers.makers.verl_correction import make; "
        "make(Path(sys.argv[1]))"
    )
    env = {**os.environ, "PYTHONPATH": str(TOOLS)}
    subprocess.run([str(py), "-c", code, str(tmp_path)], check=True, cwd=REPO, env=env, timeout=600)
    import sys

    sys.path.insert(0, str(TOOLS))
    from peers.checks import dump_file
    from peers.detect import _setups

    names = sorted(p.name.removesuffix(".set.json") for p in tmp_path.glob("*.set.json"))
    assert len(names) == 5, names
    convs = {n: json.loads((tmp_path / f"{n}.set.json").read_text()) for n in names}
    for n in names:
        dump = load_dump(dump_file(tmp_path, n))
        expected, base = _setups(dump, "verl", convs[n])
        assert check(dump, expected, explain_divergence=False).match, n  # verl's own dump, refppo's preset
        flip = json.loads((tmp_path / f"{n}.control.json").read_text())
        trial = {**{k: getattr(v, "value", v) for k, v in expected.convention_dict().items()}, **flip}
        assert not check(dump, setup_from_json(expected, trial), explain_divergence=False).match, n
        det = detect(dump, base, limit=100000)
        listed = {tuple(e[k] for k in KEYS) for e in det.detected}
        assert _rc(convs[n]) in listed, (n, sorted(listed, key=str)[:12])
        others = [m for m in names if _rc(convs[m]) != _rc(convs[n]) and _rc(convs[m]) in listed]
        assert not others, (n, others)
        high = convs[n]["rollout_is_high"]
        if high not in (2.0, 3.0):  # not a named value: solved from the data
            assert high in det.solved.get("rollout_is_high", []), (n, det.solved)
