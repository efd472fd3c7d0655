"""verl 0.9.1's rollout rejection sampling (``rollout_rs``) against verl's OWN installed code (issue #22).

Side venv ``verl-openrlhf`` (skipped with the reason without it): :mod:`peers.makers.verl_rollout_rs`
writes, per case, a v1 dump (scalars) and a v2 dump (with ``grad_logprobs``) of one verl step whose
``response_mask`` is the mask of ``compute_rollout_correction_and_rejection_mask`` from GAE on (token
``token_k1`` "0.6_1.6", ``token_k2`` 0.12 with token TIS 2.0, sequence ``seq_mean_k3`` 0.15 and
``seq_max_k2`` 0.8; the sequence cases reject whole rows). Each must match under ``--preset verl`` +
its ``--set`` (``rollout_rs_effect=drop_mask``); the control ``rollout_rs_effect=weight`` (the gate as
a weight, rejected tokens still counted) must not. The capture adapter maps verl's config to the
same keys.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from _peers import REPO, TOOLS, require

from refppo.core.rollout_correction import gate_statistic
from refppo.dump.load import Dump, load_dump

CASES = {  # the maker's cases: verl's (rollout_rs, rollout_rs_threshold, rollout_is)
    "token_k1": ("token_k1", "0.6_1.6", None),
    "seq_mean_k3": ("seq_mean_k3", 0.15, None),
    "seq_max_k2": ("seq_max_k2", 0.8, None),
    "token_k2_tis": ("token_k2", 0.12, "token"),
}


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    py = require("verl-openrlhf")
    out = tmp_path_factory.mktemp("verl_rollout_rs")
    code = "import sys; from pathlib import Path; from peers.makers.verl_rollout_rs import make_both; "
    code += "make_both(Path(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": str(TOOLS)}
    subprocess.run([str(py), "-c", code, str(out)], check=True, cwd=REPO, env=env, timeout=600)
    return out


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("case", list(CASES))
def test_verl_rollout_rs_matches_under_drop_mask_and_not_as_a_weight(
    dumps: Path, case: str, version: str
) -> None:
    from peers.checks import preset_case

    name = f"verl_rollout_rs_{case}_{version}"
    c = preset_case("verl", dumps, name, "verl", verbose=True)
    assert c.info["verdict"] == "MATCH", c.notes
    errs = {q: v[0] for q, v in c.info["quantities"].items()}
    assert max(errs.values()) <= 1e-7, errs  # float32 dumps: verl's own float32 arithmetic
    assert ("grad_logprobs" in errs) == (version == "v2")
    assert [ctl.ok for ctl in c.controls] == [True], c.controls  # rollout_rs_effect=weight mismatches
    sets = json.loads((dumps / f"{name}.set.json").read_text())
    assert sets["rollout_rs_effect"] == "drop_mask"


@pytest.mark.parametrize("case", list(CASES))
def test_the_verl_adapter_maps_rollout_rs_to_the_cases_keys(dumps: Path, case: str) -> None:
    from refppo.capture.adapters.verl import verl_correction

    rs, thr, tis = CASES[case]
    sets = json.loads((dumps / f"verl_rollout_rs_{case}_v1.set.json").read_text())
    cfg = {"rollout_rs": rs, "rollout_rs_threshold": thr, "rollout_is": tis, "rollout_is_threshold": 2.0}
    got = verl_correction(cfg)
    assert got == {k: v for k, v in sets.items() if k.startswith("rollout_")}


MODES = {  # verl's option as refppo's gate keys that fix its mask (the order is unread by k2)
    "token_k1": {"rollout_rs": "token", "rollout_rs_stat": "ratio", "rollout_rs_order": "behaviour"},
    "seq_mean_k3": {
        "rollout_rs": "sequence", "rollout_rs_stat": "k3", "rollout_rs_order": "behaviour",
        "rollout_rs_reduce": "mean",
    },
    "seq_max_k2": {"rollout_rs": "sequence", "rollout_rs_stat": "k2", "rollout_rs_reduce": "max"},
    "token_k2_tis": {"rollout_rs": "token", "rollout_rs_stat": "k2", "rollout_is": "token"},
}  # fmt: skip


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("case", list(CASES))
def test_detect_lists_verl_drop_mask_gate_from_refppos_defaults(
    dumps: Path, case: str, version: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--detect`` from refppo's defaults (issue #22 item 6): every listed entry names
    ``rollout_rs_effect=drop_mask``; one has verl's mode, its thresholds within the interval of
    observed statistics around verl's; a listed entry matches under ``refppo diff`` and its control
    (the same gate as a weight) does not."""
    monkeypatch.syspath_prepend(str(TOOLS))
    from peers.checks import dump_file
    from peers.detect import _setups

    from refppo.oracle.check.diagnose import check
    from refppo.oracle.detect.detection import detect, setup_from_json

    name = f"verl_rollout_rs_{case}_{version}"
    sets = json.loads((dumps / f"{name}.set.json").read_text())
    dump = load_dump(dump_file(dumps, name))
    _, base = _setups(dump, "verl", sets)
    det = detect(dump, base, limit=100000)
    assert det.detected, (det.unmatched_stages, det.nearest)
    assert all(e.get("rollout_rs_effect") == "drop_mask" for e in det.detected)
    mode = [e for e in det.detected if all(e.get(k) == v for k, v in MODES[case].items())]
    assert mode, [{k: e.get(k) for k in MODES[case]} for e in det.detected[:8]]
    u = _statistic(dump, sets)
    for key in ("rollout_rs_low", "rollout_rs_high"):
        want = sets.get(key)
        got = {e.get(key) for e in mode if e.get("rollout_rs_stat") == sets["rollout_rs_stat"]}
        if want is None:
            assert None in got, (key, got)
            continue
        # every threshold between the observed statistics around verl's keeps the same tokens
        lo, hi = float(u[u < want].max()), float(u[u > want].min())
        assert any(v is not None and lo <= v <= hi for v in got), (key, lo, hi, got)
    e = mode[0]
    assert check(dump, setup_from_json(base, e), explain_divergence=False).match, e
    ctl = check(dump, setup_from_json(base, {**e, "rollout_rs_effect": "weight"}), explain_divergence=False)
    assert not ctl.match, e


def _statistic(dump: Dump, sets: dict[str, Any]) -> torch.Tensor:
    """verl's gate statistic on the dump's valid tokens (refppo's core, under the case's keys)."""
    t, m = dump.tensors, dump.mask
    u = gate_statistic(
        t["old_logprobs"], t["rollout_logprobs"], m, stat=sets["rollout_rs_stat"],
        order=sets["rollout_rs_order"], level=sets["rollout_rs"],
        reduce=sets.get("rollout_rs_reduce", "mean"),
    )  # fmt: skip
    return u[m].double()
