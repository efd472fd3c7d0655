"""The rollout correction's classic bugs, injected into dumps made by verl 0.9.1's and OpenRLHF
0.11.2's own code, are caught at the right first divergence and named (issue #22, "Done when").

Side venv ``verl-openrlhf`` (skipped with the reason without it): :mod:`peers.makers.verl_correction_bugs`
calls verl's ``compute_rollout_correction_weights`` and ``compute_policy_loss_vanilla`` with each
bug's input (the sequence level that sums, IcePop where truncation is checked and the converse, the
threshold on the log scale, old := the engine's log-probs, the current policy's log-ratio, the weight
not detached with its gradient, a stale token through a multiplied band). Each dump, checked under
the convention the trainer meant (verl's preset and the case's ``--set``), must diverge first where
the bug acts and name that bug — and no other — with every quantity matching under it; the clean
case (the peer's own correction, no bug) matches and names nothing.
:mod:`peers.makers.openrlhf_correction_bugs` injects, through OpenRLHF's ``PolicyLoss``, the bugs
its function can carry (the modes swapped both ways, the bounds on the log scale, old := the
engine's log-probs).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from _peers import REPO, TOOLS, require

from refppo.dump.load import load_dump
from refppo.oracle.check.diagnose import check


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both makers' dumps, in one folder (one interpreter start)."""
    py = require("verl-openrlhf")
    out = tmp_path_factory.mktemp("rollout_bugs")
    code = (
        "import sys; from pathlib import Path; from peers.makers import verl_correction_bugs as v, "
        "openrlhf_correction_bugs as o; v.make(Path(sys.argv[1])); o.make(Path(sys.argv[1]))"
    )
    env = {**os.environ, "PYTHONPATH": str(TOOLS)}
    subprocess.run([str(py), "-c", code, str(out)], check=True, cwd=REPO, env=env, timeout=600)
    return out


VERL = [
    "is_sum_not_mean", "truncate_mask_swapped", "truncate_mask_swapped_tis", "cap_on_log_ratio",
    "old_is_behaviour", "is_weight_against_current", "is_weight_not_detached", "nonfinite_through_mask",
    "clean",
]  # fmt: skip
OPENRLHF = [
    "truncate_mask_swapped",
    "truncate_mask_swapped_clip",
    "cap_on_log_ratio",
    "old_is_behaviour",
    "clean",
]
CASES = [("verl", c) for c in VERL] + [("openrlhf", c) for c in OPENRLHF]


@pytest.mark.parametrize(("peer", "case"), CASES, ids=[f"{p}-{c}" for p, c in CASES])
def test_a_bug_injected_into_a_peers_own_step_is_named(made: Path, peer: str, case: str) -> None:
    import sys

    sys.path.insert(0, str(TOOLS))
    from peers.checks import dump_file
    from peers.detect import _setups

    name = f"{peer}_correction_bug_{case}"
    want = json.loads((made / f"{name}.bug.json").read_text())
    conv = json.loads((made / f"{name}.set.json").read_text())
    dump = load_dump(dump_file(made, name))
    setup, _ = _setups(dump, peer, conv)
    res = check(dump, setup)
    bugs = [f["bug"] for f in res.explained_by if f["kind"] == "bug"]
    if want["bug"] is None:  # the control: the peer's own corrected step, no bug
        assert res.match and not bugs, (res.first_divergence, res.diagnosis)
        return
    assert res.first_divergence == want["first"], (case, res.first_divergence, res.diagnosis)
    assert bugs == [want["bug"]], (case, res.diagnosis)
    entry = next(f for f in res.explained_by if f.get("bug") == want["bug"])
    assert entry["all_match"], (case, res.diagnosis)
