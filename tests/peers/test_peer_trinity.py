"""trinity-rft 0.6.0's own PPO functions against ``--preset trinity`` (issue #23).

:mod:`peers.makers.trinity_ppo` runs, in the ``trinity`` side venv (skipped with the reason
without it), trinity's unmodified ``to_data_proto`` (the score slot), ``KLFn`` penalty and loss,
``PPOAdvantageFn`` and ``PPOPolicyLossFn`` on random ragged batches with junk on the padding, and
writes v2 dumps (``grad_logprobs`` by autograd through trinity's losses). Three cases: trinity's
PPO defaults (k2 KL loss; control ``gae_padding=masked``: trinity's GAE runs through the padding
with the critic's values as given), an unclamped ``K3Fn`` penalty in the reward with
``seq-mean-token-mean`` and an asymmetric clip (control ``dual_clip`` off: trinity's dual clip is
always on), verl's clamped ``LowVarKLFn`` in the reward (control ``score_at=after_last_valid``).
Each matches under ``--preset trinity`` plus its ``--set`` (max abs error bounded), its control
mismatches, and ``--detect`` from refppo's defaults lists the generating ``gae_padding`` and
``dual_clip``, each listed entry re-checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _peers import REPO, TOOLS, require

from refppo.dump.load import load_dump
from refppo.oracle.check.diagnose import check
from refppo.oracle.detect.detection import detect, setup_from_json

CASES = ("default_k2_loss", "k3_reward_seqmean", "low_var_kl_reward")
MAX_ERR = 1e-5


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    py = require("trinity")
    out = tmp_path_factory.mktemp("trinity")
    code = "import sys, pathlib; from peers.makers.trinity_ppo import make; make(pathlib.Path(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": str(TOOLS)}
    subprocess.run([str(py), "-c", code, str(out)], check=True, cwd=REPO, env=env, timeout=600)
    return out


def _setups(folder: Path, name: str) -> tuple[Any, Any, Any, dict[str, Any]]:
    sys.path.insert(0, str(TOOLS))
    from peers.detect import _setups as setups

    conv = json.loads((folder / f"trinity_{name}.set.json").read_text())
    dump = load_dump(folder / f"trinity_{name}.pt")
    expected, base = setups(dump, "trinity", conv)
    return dump, expected, base, conv


@pytest.mark.parametrize("name", CASES)
def test_trinitys_own_step_matches_its_preset_and_the_control_does_not(made: Path, name: str) -> None:
    dump, expected, _, _ = _setups(made, name)
    res = check(dump, expected, explain_divergence=False)
    assert res.match, (name, res.first_divergence)
    assert {"grad_logprobs", "advantages", "token_rewards", "pg_loss"} <= set(res.quantities)
    err = max(q.max_abs_err for q in res.quantities.values())
    print(f"trinity {name}: match, max abs error {err:.2e}")
    assert err < MAX_ERR, (name, err)
    flip = json.loads((made / f"trinity_{name}.control.json").read_text())
    trial = {**{k: getattr(v, "value", v) for k, v in expected.convention_dict().items()}, **flip}
    assert not check(dump, setup_from_json(expected, trial), explain_divergence=False).match, (name, flip)


@pytest.mark.parametrize("name", CASES[:2])
def test_detect_lists_trinitys_convention(made: Path, name: str) -> None:
    dump, _, base, conv = _setups(made, name)
    want = {"gae_padding": "through", "dual_clip": 3.0, "kl_in": "loss", "loss_agg": "token-mean", **conv}
    keys = ("gae_padding", "dual_clip", "kl_in", "loss_agg")
    det = detect(dump, base, limit=100000)
    listed = [e for e in det.detected if all(e.get(k) == want[k] for k in keys)]
    assert listed, (name, det.detected[:3])
    for e in listed[:3]:
        assert check(dump, setup_from_json(base, e), explain_divergence=False).match, (name, e)
