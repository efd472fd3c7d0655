"""torchtune 0.6.1's own PPO recipe step against ``--preset torchtune`` (issue #23).

:mod:`peers.makers.torchtune_ppo` runs, in the ``torchtune`` side venv (skipped with the reason
without it), the unmodified ``PPOFullFinetuneRecipeSingleDevice.generate_trajectory`` and
``ppo_step`` of ``recipes/ppo_full_finetune_single_device.py`` with tiny random torchtune models,
and ``rlhf.get_rewards_ppo`` / ``rlhf.estimate_advantages`` as ``train`` calls them; each case is a
v2 dump (gradients from the recipe's own ``loss.backward()``).

- ``ragged`` (three stop tokens, ``penalise_no_eos``), ``ragged_epoch2`` (non-default γ, λ, β, ε,
  ε_v, vf_coef, ``min_response_length``, captured after an optimizer step so both clip branches
  fire) and ``full`` (no stop token, every row full width, second epoch) match under
  ``--preset torchtune`` on every dumped quantity (max abs error bounded); each case's control
  (``whiten_advantages=masked``: torchtune's ``whiten`` adds the mean back; ``approx_kl=k1``;
  ``value_loss=unclipped``) mismatches; ``--detect`` from refppo's defaults lists the generating
  convention (``score_at``, ``whiten_advantages``, ``approx_kl``) and each listed entry re-checks.
- ``one_token_row`` (a row whose first token is a stop token): torchtune scores it at position 0
  (``value_seq_idxs`` needs ``seq_lens > 0``: ``recipes/ppo_full_finetune_single_device.py::
  PPOFullFinetuneRecipeSingleDevice.generate_trajectory``, step 6.1), the preset's
  ``score_at=after_last_valid_unless_first``: it matches; its control, plain ``after_last_valid``
  (one slot after), mismatches first at ``token_rewards``.
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

MATCHING = ("ragged", "ragged_epoch2", "full", "one_token_row")
WANT = {
    "score_at": ("after_last_valid",),  # unless_first is tried only on a dump with a one-token row
    "whiten_advantages": ("masked_no_shift",),
    "approx_kl": ("k2_all_positions",),
}
MAX_ERR = 1e-5


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    py = require("torchtune")
    out = tmp_path_factory.mktemp("torchtune")
    code = "import sys, pathlib; from peers.makers.torchtune_ppo import make; make(pathlib.Path(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": str(TOOLS)}
    subprocess.run([str(py), "-c", code, str(out)], check=True, cwd=REPO, env=env, timeout=600)
    return out


def _setups(folder: Path, name: str) -> tuple[Any, Any, Any]:
    import sys

    sys.path.insert(0, str(TOOLS))
    from peers.detect import _setups as setups

    dump = load_dump(folder / f"torchtune_{name}.pt")
    expected, base = setups(dump, "torchtune", {})
    return dump, expected, base


@pytest.mark.parametrize("name", MATCHING)
def test_torchtunes_own_step_matches_its_preset_and_the_control_does_not(made: Path, name: str) -> None:
    dump, expected, _ = _setups(made, name)
    res = check(dump, expected, explain_divergence=False)
    assert res.match, (name, res.first_divergence)
    assert {"grad_logprobs", "grad_values", "advantages", "approx_kl", "vf_loss"} <= set(res.quantities)
    err = max(q.max_abs_err for q in res.quantities.values())
    print(f"torchtune {name}: match, max abs error {err:.2e}")
    assert err < MAX_ERR, (name, err)
    flip = json.loads((made / f"torchtune_{name}.control.json").read_text())
    trial = {**{k: getattr(v, "value", v) for k, v in expected.convention_dict().items()}, **flip}
    assert not check(dump, setup_from_json(expected, trial), explain_divergence=False).match, (name, flip)


@pytest.mark.parametrize("name", ("ragged", "ragged_epoch2", "one_token_row"))
def test_detect_lists_torchtunes_convention(made: Path, name: str) -> None:
    dump, _, base = _setups(made, name)
    det = detect(dump, base, limit=100000)
    want = {**WANT, "score_at": ("after_last_valid_unless_first",)} if name == "one_token_row" else WANT
    listed = [e for e in det.detected if all(e.get(k) in v for k, v in want.items())]
    assert listed, (name, det.detected[:3])
    for e in listed[:3]:
        assert check(dump, setup_from_json(base, e), explain_divergence=False).match, (name, e)


def test_a_one_token_response_is_scored_at_its_only_token(made: Path) -> None:
    facts = json.loads((made / "torchtune_one_token_row.facts.json").read_text())
    one = [i for i, n in enumerate(facts["response_lengths"]) if n == 1]
    assert one and all(facts["value_seq_idxs"][i] == 0 for i in one), facts
    dump, expected, _ = _setups(made, "one_token_row")
    assert expected.convention_dict()["score_at"] == "after_last_valid_unless_first"
    t = dump.tensors
    beta = float(dump.hparams["kl_coef"])
    score_part = t["token_rewards"] + beta * t["kl"]  # the score alone, where torchtune added it
    lengths = t["response_mask"].sum(1).long().tolist()
    T = t["response_mask"].shape[1]
    for i, n in enumerate(lengths):  # one-token rows at position 0; the others one past the last valid
        slot = 0 if n == 1 else min(n, T - 1)
        assert abs(float(score_part[i, slot] - t["scores"][i])) < 1e-5, (i, n, slot)
    assert check(dump, expected, explain_divergence=False).match
    plain = {**{k: getattr(v, "value", v) for k, v in expected.convention_dict().items()}}
    plain["score_at"] = "after_last_valid"  # the one-token row's score one slot after torchtune's
    res = check(dump, setup_from_json(expected, plain), explain_divergence=False)
    assert not res.match and res.first_divergence == "token_rewards", res.first_divergence
