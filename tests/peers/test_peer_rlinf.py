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
clamped ratio: ``approx_kl=k1_clamped`` matches it, ``k1`` (control) does not. The FSDP actor's
swapped ``kl_penalty`` arguments are run and named (out of scope, spec/conventions.md).
``--detect`` from refppo's defaults lists RLinf's score slot and GAE padding.
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
    """Under a binding clamp κ RLinf logs −mean(clamp(l − l_old, ±κ)): ``approx_kl=k1_clamped`` (the
    preset's) reproduces it through the pipeline; ``k1`` (the unclamped mean) is the control."""
    facts = json.loads((made / "rlinf_gae_dual_clip_clamp.facts.json").read_text())
    dump, expected, _, _ = _setups(made, "gae_dual_clip_clamp")
    lr = (dump.tensors["logprobs"] - dump.tensors["old_logprobs"])[dump.mask.bool()]
    assert (lr.abs() > facts["clamp"]).any()  # the clamp binds
    res = check(dump, expected, explain_divergence=False)
    assert res.match and "approx_kl" in res.quantities, res.first_divergence
    err = res.quantities["approx_kl"].max_abs_err
    print(f"rlinf approx_kl k1_clamped: max abs error {err:.2e}")
    assert err < MAX_ERR
    trial = {**{k: getattr(v, "value", v) for k, v in expected.convention_dict().items()}, "approx_kl": "k1"}
    control = check(dump, setup_from_json(expected, trial), explain_divergence=False)
    assert not control.match and control.quantities["approx_kl"].max_abs_err > 1e-3


def test_rlinfs_fsdp_actor_swaps_the_kl_arguments(made: Path) -> None:
    """RLinf's FSDP actor calls ``kl_penalty(ref_logprobs, logprobs, type)`` (its Megatron actor
    ``kl_penalty(logprobs, ref_logprobs, type)``). Run: it is refppo's estimator with π and π_ref
    exchanged (``token_kl(ref, l)``), which equals the Megatron order for the symmetric ``k2`` and
    ``abs`` and differs for ``k1`` (negated) and ``k3`` (``exp(d) − d − 1``): out of scope
    (spec/conventions.md, RLinf)."""
    from refppo.core.kl import token_kl
    from refppo.oracle.presets.kl_clamps import verl_kl_clamps

    d = torch.load(made / "rlinf_fsdp_kl.pt", weights_only=True)
    m = d["response_mask"].bool()
    lp, ref = d["logprobs"].double(), d["ref_logprobs"].double()
    errs = {}
    for kind, est in (("k1", "k1"), ("k2", "k2"), ("low_var_kl", "k3"), ("abs", "abs")):
        clamps = verl_kl_clamps(est)
        kw = {"log_ratio_clamp": clamps["kl_log_ratio_clamp"], "value_clamp": clamps["kl_value_clamp"]}
        fsdp, megatron = d[f"fsdp_{kind}"].double()[m], d[f"megatron_{kind}"].double()[m]
        swapped, forward = token_kl(ref, lp, m, est, **kw)[m], token_kl(lp, ref, m, est, **kw)[m]
        errs[kind] = float((fsdp - swapped).abs().max())
        assert errs[kind] < 1e-4, (kind, errs[kind])  # float32 values up to the clamp 10
        assert float((megatron - forward).abs().max()) < 1e-4, kind
        moved = float((fsdp - forward).abs().max())  # the control: the forward order
        assert moved < 1e-4 if kind in ("k2", "abs") else moved > 1e-2, (kind, moved)
    print(f"rlinf fsdp swapped kl: max abs error {max(errs.values()):.2e}")


def test_detect_lists_rlinfs_score_slot_and_gae_padding(made: Path) -> None:
    dump, _, base, _ = _setups(made, "gae_k3_loss")
    want = {"score_at": "last_position", "gae_padding": "through", "kl_in": "loss"}
    det = detect(dump, base, limit=100000)
    listed = [e for e in det.detected if all(e.get(k) == v for k, v in want.items())]
    assert listed, det.detected[:3]
    for e in listed[:3]:
        assert check(dump, setup_from_json(base, e), explain_divergence=False).match, e
