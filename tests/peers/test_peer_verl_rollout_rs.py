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

import pytest
from _peers import REPO, TOOLS, require

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
