"""``--detect`` lists the peers' rollout correction on dumps made by their own code (issue #22).

Side venv ``verl-openrlhf`` (skipped with the reason without it): :mod:`peers.makers.verl_correction`
writes one full-step dump per case, its policy term verl 0.9.1's ``compute_policy_loss_vanilla``
with the weights of ``compute_rollout_correction_weights`` (token / sequence, TIS caps 2, 1.5, 1.8,
IcePop ``"0.5_2.0"``); :mod:`peers.makers.openrlhf_correction` OpenRLHF 0.11.2's ``PolicyLoss``
with its token-level IS correction (``clip`` [0.5, 1.5], [0.5, 1.7]; ``mask`` [0.5, 2]).
From refppo's defaults, ``--detect`` must list each generating correction
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

import pytest
from _peers import REPO, TOOLS, require

from refppo.dump.load import load_dump
from refppo.oracle.check.diagnose import check
from refppo.oracle.detect.detection import detect, setup_from_json

KEYS = ("rollout_is", "rollout_is_agg", "rollout_is_mode", "rollout_is_low", "rollout_is_high")


def _rc(c: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(c.get(k, "product" if k == "rollout_is_agg" else None) for k in KEYS)


MAKERS = {"verl": ("verl_correction", 5), "openrlhf": ("openrlhf_correction", 3)}
"""Preset → (its maker module under ``peers.makers``, the number of cases)."""


@pytest.mark.parametrize("preset", list(MAKERS))
def test_detect_lists_the_peers_rollout_correction(tmp_path: Path, preset: str) -> None:
    py = require("verl-openrlhf")
    module, n_cases = MAKERS[preset]
    code = (
        f"import sys; from pathlib import Path; from peers.makers.{module} import make; "
        "make(Path(sys.argv[1]))"
    )
    env = {**os.environ, "PYTHONPATH": str(TOOLS)}
    subprocess.run([str(py), "-c", code, str(tmp_path)], check=True, cwd=REPO, env=env, timeout=600)
    import sys

    sys.path.insert(0, str(TOOLS))
    from peers.checks import dump_file
    from peers.detect import _setups

    names = sorted(p.name.removesuffix(".set.json") for p in tmp_path.glob("*.set.json"))
    assert len(names) == n_cases, names
    convs = {n: json.loads((tmp_path / f"{n}.set.json").read_text()) for n in names}
    for n in names:
        dump = load_dump(dump_file(tmp_path, n))
        expected, base = _setups(dump, preset, convs[n])
        assert check(dump, expected, explain_divergence=False).match, n  # the peer's own dump, its preset
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
