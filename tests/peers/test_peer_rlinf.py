"""RLinf 0.3.0's own reasoning PPO functions against ``--preset rlinf`` (issue #23, beyond the presets).

:mod:`peers.makers.rlinf_ppo` runs, in the ``rlinf`` side venv (skipped with the reason without
it), RLinf's unmodified ``preprocess_reasoning_advantages_inputs`` (the score at the frame's last
slot), ``calculate_adv_and_returns`` (``gae`` with the critic's values, ``grpo``),
``masked_normalization`` (the Megatron worker's Bessel call, the FSDP actor's population default),
``policy_loss`` (``compute_ppo_actor_loss``), ``kl_penalty`` and ``compute_ppo_critic_loss`` on
random ragged batches with junk on the padding, and writes v2 dumps (``grad_logprobs`` by autograd
through RLinf's losses). Four cases: GAE with the clamped-k3 KL loss (control
``score_at=last_valid``), GAE with the dual clip and a binding log-ratio clamp under
``seq-mean-token-sum`` (control ``dual_clip`` off), GRPO with the FSDP normalisation under
``seq-mean-token-mean`` and a k2 KL loss (control ``whiten_variance=unbiased``), plain GRPO (control
``group_std=population``). Each matches under ``--preset rlinf`` plus its ``--set`` (max abs error
bounded) and its control mismatches. RLinf's ``approx_kl`` under a binding log-ratio clamp is of the
clamped ratio, which refppo's ``approx_kl`` does not express: that fact is checked by hand, not
matched. ``--detect`` from refppo's defaults lists RLinf's score slot and GAE padding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _peers import REPO, TOOLS, require

from refppo.dump.load import load_dump
from refppo.oracle.check.diagnose import check
from refppo.oracle.detect.detection import detect, setup_from_json

CASES = ("gae_k3_loss", "gae_dual_clip_clamp", "grpo_fsdp_norm_seqmean", "grpo_plain")
MAX_ERR = 1e-5


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    py = require("rlinf")
    out = tmp_path_factory.mktemp("rlinf")
    code = "import sys, pathlib; from peers.makers.rlinf_ppo import make; make(pathlib.Path(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": str(TOOLS)}
    subprocess.run([str(py), "-c", code, str(out)], check=True, cwd=REPO, env=env, timeout=600)
    return out


def _setups(folder: Path, name: str) -> tuple[Any, Any, Any, dict[str, Any]]:
    sys.path.insert(0, str(TOOLS))
    from peers.detect import _setups as setups

    conv = json.loads((folder / f"rlinf_{name}.set.json").read_text())
    dump = load_dump(folder / f"rlinf_{name}.pt")
    expected, base = setups(dump, "rlinf", conv)
    return dump, expected, base, conv


@pytest.mark.parametrize("name", CASES)
def test_rlinfs_own_step_matches_its_preset_and_the_control_does_not(made: Path, name: str) -> None:
    dump, expected, _, _ = _setups(made, name)
    res = check(dump, expected, explain_divergence=False)
    assert res.match, (name, res.first_divergence)
    assert {"grad_logprobs", "advantages", "pg_loss"} <= set(res.quantities)
    if name.startswith("gae"):
        assert {"token_rewards", "returns", "vf_loss"} <= set(res.quantities)
    err = max(q.max_abs_err for q in res.quantities.values())
    print(f"rlinf {name}: match, max abs error {err:.2e}")
    assert err < MAX_ERR, (name, err)
    flip = json.loads((made / f"rlinf_{name}.control.json").read_text())
    trial = {**{k: getattr(v, "value", v) for k, v in expected.convention_dict().items()}, **flip}
    assert not check(dump, setup_from_json(expected, trial), explain_divergence=False).match, (name, flip)


def test_rlinfs_approx_kl_reads_the_clamped_log_ratio(made: Path) -> None:
    """The gap, stated: under a binding clamp κ RLinf logs −mean(clamp(l − l_old, ±κ)), not the
    unclamped mean refppo's ``approx_kl`` computes (so the case dumps no ``approx_kl``)."""
    facts = json.loads((made / "rlinf_gae_dual_clip_clamp.facts.json").read_text())
    d = torch.load(made / "rlinf_gae_dual_clip_clamp.pt", weights_only=True)
    m = d["response_mask"].bool()
    lr = (d["logprobs"] - d["old_logprobs"])[m].double()
    k = facts["clamp"]
    assert (lr.abs() > k).any()  # the clamp binds
    clamped, unclamped = float(-lr.clamp(-k, k).mean()), float(-lr.mean())
    assert abs(facts["approx_kl"] - clamped) < 1e-6, (facts, clamped)
    assert abs(facts["approx_kl"] - unclamped) > 1e-2, (facts, unclamped)


def test_detect_lists_rlinfs_score_slot_and_gae_padding(made: Path) -> None:
    dump, _, base, _ = _setups(made, "gae_k3_loss")
    want = {"score_at": "last_position", "gae_padding": "through", "kl_in": "loss"}
    det = detect(dump, base, limit=100000)
    listed = [e for e in det.detected if all(e.get(k) == v for k, v in want.items())]
    assert listed, det.detected[:3]
    for e in listed[:3]:
        assert check(dump, setup_from_json(base, e), explain_divergence=False).match, e
