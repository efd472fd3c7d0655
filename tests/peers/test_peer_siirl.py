"""siirl 0.2.0's own PPO functions against ``--preset verl`` (issue #23: a verl fork needs no preset).

:mod:`peers.makers.siirl_ppo` runs, in the ``siirl`` side venv (skipped with the reason without it),
siirl's unmodified ``compute_gae_advantage_return``, ``compute_policy_loss_vanilla``,
``kl_penalty`` / ``agg_loss`` and ``compute_value_loss`` (``siirl/dag_worker/core_algos.py``) on
random ragged batches with junk on the padding, and writes v2 dumps (``grad_logprobs`` by autograd
through siirl's losses). Two cases: no KL in the reward (siirl's default) under ``token-mean``
(control ``loss_agg=seq-mean-token-mean``); the clamped k3 as a loss under ``seq-mean-token-mean``
with clip 0.2/0.28 (control ``gae_padding=through``: siirl's GAE, as verl's, stops at the
padding). Each matches under ``--preset verl`` plus its ``--set`` (max abs error bounded) and its
control mismatches. siirl 0.2.0's ``apply_kl_penalty`` (``use_kl_in_reward``) cannot run: the
maker records the ``TypeError`` it raises.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _peers import REPO, TOOLS, require

from refppo.dump.load import load_dump
from refppo.oracle.check.diagnose import check
from refppo.oracle.detect.detection import setup_from_json

CASES = ("no_kl_token_mean", "k3_loss_seq_mean")
MAX_ERR = 1e-9


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    py = require("siirl")
    out = tmp_path_factory.mktemp("siirl")
    code = "import sys, pathlib; from peers.makers.siirl_ppo import make; make(pathlib.Path(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": str(TOOLS)}
    subprocess.run([str(py), "-c", code, str(out)], check=True, cwd=REPO, env=env, timeout=600)
    return out


@pytest.mark.parametrize("name", CASES)
def test_siirls_own_step_matches_the_verl_preset_and_the_control_does_not(made: Path, name: str) -> None:
    sys.path.insert(0, str(TOOLS))
    from peers.detect import _setups

    conv = json.loads((made / f"siirl_{name}.set.json").read_text())
    dump = load_dump(made / f"siirl_{name}.pt")
    expected, _ = _setups(dump, "verl", conv)
    res = check(dump, expected, explain_divergence=False)
    assert res.match, (name, res.first_divergence)
    assert {"grad_logprobs", "advantages", "token_rewards", "pg_loss", "vf_loss"} <= set(res.quantities)
    err = max(q.max_abs_err for q in res.quantities.values())
    print(f"siirl {name}: match under --preset verl, max abs error {err:.2e}")
    assert err < MAX_ERR, (name, err)
    flip = json.loads((made / f"siirl_{name}.control.json").read_text())
    trial = {**{k: getattr(v, "value", v) for k, v in expected.convention_dict().items()}, **flip}
    assert not check(dump, setup_from_json(expected, trial), explain_divergence=False).match, (name, flip)


def test_siirls_kl_in_reward_cannot_run(made: Path) -> None:
    """``apply_kl_penalty(batch, ctrl, config.algorithm.kl_penalty)`` as ``dagworker.py`` calls it: the
    string parameter ``kl_penalty`` shadows the module's function of that name."""
    facts = json.loads((made / "siirl_facts.json").read_text())
    assert facts["apply_kl_penalty"] == "TypeError: 'str' object is not callable", facts
