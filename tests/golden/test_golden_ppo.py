"""Golden PPO trajectories (spec/golden/ppo_*.{json,safetensors}, written by tools/make_golden.py).

- replay on CPU: same seed → same trajectory (tolerances ``refppo.golden.cases.CPU_REPLAY``);
- the naive step-by-step path (per-prefix read-outs, a real π_old snapshot network, the core's
  naive twins) reproduces it from the golden tokens (``refppo.golden.cases.NAIVE``);
- sensitivity: the check fails when ε, γ, λ, β or the aggregation mode is changed (and, for the
  corrected run ``seam_gpt2``, the TIS cap, the correction, the engine's staleness or dtype);
- CUDA replay (``gpu`` marker; ``refppo.golden.cases.CUDA_REPLAY``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from refppo import cpu_numerics
from refppo.golden.cases import CASES, CPU_REPLAY, CUDA_REPLAY, NAIVE, SEAM_TIS_CAP, variant
from refppo.golden.check import compare, max_deviations
from refppo.golden.store import SCHEMA_VERSION, load, paths
from refppo.golden.trajectory import Trajectory, run

GOLDEN_DIR = Path(__file__).resolve().parents[2] / "spec" / "golden"
NAMES = sorted(CASES)


@pytest.fixture(autouse=True, scope="module")
def _deterministic() -> Iterator[None]:
    """As tools/make_golden.py: AVX2 kernels (pinned by tests/conftest.py), one thread (also ~30x
    faster for these tiny models here)."""
    problem = cpu_numerics.pinned_problem()
    assert problem is None, f"golden replay needs the pinned CPU kernels: {problem}"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _load(name: str) -> tuple[Trajectory, dict[str, Any]]:
    return load(GOLDEN_DIR, name)


def test_golden_files_schema_and_size() -> None:
    total = 0
    for name in NAMES:
        jpath, tpath = paths(GOLDEN_DIR, name)
        total += os.path.getsize(jpath) + os.path.getsize(tpath)
        traj, doc = _load(name)
        assert doc["schema_version"] == SCHEMA_VERSION
        case = CASES[name]
        assert doc["case"] == case.to_dict(), "the golden was generated from another configuration"
        assert len(doc["iterations"]) == case.iterations == 3
        for it in range(case.iterations):
            for f in (*case.tensor_fields, "perm"):
                assert f"it{it}.{f}" in traj.tensors
            assert set(doc["iterations"][it]["checksums"]) == set(doc["init_checksums"])
        # the trajectory exercises what the sensitivity test relies on
        lengths = torch.cat([traj.tensors[f"it{i}.response_mask"].sum(1) for i in range(3)])
        assert int(lengths.min()) < int(lengths.max()), "need ragged responses (aggregation modes differ)"
        assert max(it["metrics"]["pg_clipfrac"] for it in doc["iterations"]) > 0, "need clipping (ε matters)"
        assert max(it["metrics"]["kl"] for it in doc["iterations"]) > 0, "need a non-zero KL (β matters)"
    assert total < 2 * 1024 * 1024


@pytest.mark.parametrize("name", NAMES)
def test_golden_replay_cpu(name: str) -> None:
    ref, _ = _load(name)
    got = run(CASES[name])
    dev = max_deviations(ref, got)
    print(f"{name}: CPU replay max deviations {max(dev.values()):.3g}")
    assert compare(ref, got, CPU_REPLAY) == []


@pytest.mark.parametrize("name", NAMES)
def test_golden_naive_path_reproduces(name: str) -> None:
    ref, _ = _load(name)
    got = run(CASES[name], naive_from=ref)
    dev = max_deviations(ref, got)
    print(f"{name}: naive path max deviations {dev}")
    assert compare(ref, got, NAIVE) == []


SENSITIVITY = {
    "cliprange": {"cliprange": 0.1},
    "gamma": {"gamma": 0.9},
    "lam": {"lam": 0.8},
    "kl_coef": {"kl_coef": 0.2},
    "loss_agg": {"loss_agg": "seq-mean-token-mean"},
}


@pytest.mark.parametrize("change", sorted(SENSITIVITY))
def test_golden_check_fails_when_a_hyperparameter_changes(change: str) -> None:
    ref, _ = _load("gpt2")
    case = variant(CASES["gpt2"], **SENSITIVITY[change])
    got = run(case)
    bad = compare(ref, got, CPU_REPLAY)
    # it must fail on a computed quantity, not only on re-sampled tokens
    assert any("response_ids" not in line and "response_mask" not in line for line in bad), bad[:5]


GRPO_SENSITIVITY = {
    "group_std": {"group_std": "population"},
    "group_eps": {"group_eps": 1e-2},
    "advantage": {"advantage": "dr-grpo"},
    "kl_coef": {"kl_coef": 0.2},
    "cliprange": {"cliprange": 0.1},
    "loss_agg": {"loss_agg": "seq-mean-token-mean"},
}
"""One-key changes that must break the GRPO golden (issue #13): the group statistics' own keys
and the shared ones; γ and λ do not enter an outcome-reward GRPO step."""


@pytest.mark.parametrize("change", sorted(GRPO_SENSITIVITY))
def test_grpo_golden_check_fails_when_a_key_changes(change: str) -> None:
    ref, _ = _load("grpo_gpt2")
    case = variant(CASES["grpo_gpt2"], **GRPO_SENSITIVITY[change])
    bad = compare(ref, run(case), CPU_REPLAY)
    assert any("response_ids" not in line and "response_mask" not in line for line in bad), bad[:5]


def test_grpo_golden_is_critic_free_with_groups() -> None:
    """The GRPO golden has no critic parameters, 4 responses per prompt with differing scores in
    a group (so the group statistics matter) and zero value loss."""
    traj, doc = _load("grpo_gpt2")
    assert doc["case"]["group_size"] == 4 and doc["case"]["conv"]["advantage"] == "grpo"
    assert not any(k.startswith("critic.") for k in doc["init_checksums"])
    for it in range(3):
        prompts = traj.tensors[f"it{it}.prompt_ids"].view(4, 4, -1)
        assert bool((prompts == prompts[:, :1]).all())  # consecutive rows answer one prompt
        assert bool((traj.tensors[f"it{it}.scores"].view(4, 4).std(dim=1) > 0).all())
        assert doc["iterations"][it]["metrics"]["vf_loss"] == 0.0


SEAM_SENSITIVITY: dict[str, dict[str, Any]] = {
    "tis_cap": {"rollout_is_high": 1.2},
    "correction_off": {"rollout_is": None},
    "mask_not_truncate": {"rollout_is_mode": "mask"},
    "sequence_level": {"rollout_is": "sequence"},
}
"""One-key changes of the correction that must break the corrected golden in an update of the first
two iterations (whose rollouts do not depend on the correction: the engine of iteration 2 holds the
initial policy)."""


@pytest.mark.parametrize("change", sorted(SEAM_SENSITIVITY))
def test_seam_golden_check_fails_when_the_correction_changes(change: str) -> None:
    ref, _ = _load("seam_gpt2")
    bad = compare(ref, run(variant(CASES["seam_gpt2"], **SEAM_SENSITIVITY[change])), CPU_REPLAY)
    early = [b for b in bad if b.startswith(("it0.", "it1.")) and "response_" not in b]
    assert any("checksums" in b or "pg_loss" in b for b in early), bad[:5]


@pytest.mark.parametrize("seam", [{"staleness": 0}, {"staleness": 2}, {"dtype": "float32"}], ids=str)
def test_seam_golden_check_fails_when_the_engine_changes(seam: dict[str, Any]) -> None:
    """A fresh or older engine, or one in float32, reports other behaviour log-probs or versions."""
    ref, _ = _load("seam_gpt2")
    case = CASES["seam_gpt2"]
    assert case.seam is not None
    bad = compare(ref, run(replace(case, seam=replace(case.seam, **seam))), CPU_REPLAY)
    assert any("rollout_logprobs" in b or "policy_version" in b for b in bad), bad[:5]


def test_seam_golden_is_a_stale_bfloat16_corrected_run() -> None:
    """The corrected golden's layout, read from the stored tensors: every row of iteration i was
    sampled by version max(0, i − 1); the engine's log-probs are not the trainer's (bfloat16 only in
    iteration 1: ≤ 2e-3; stale after: > 0.1 somewhere) and the TIS cap binds on some tokens."""
    traj, doc = _load("seam_gpt2")
    assert doc["case"]["seam"] == {"dtype": "bfloat16", "logprobs": "raw", "staleness": 1}
    assert (
        doc["case"]["conv"]["rollout_is"] == "token"
        and doc["case"]["conv"]["rollout_is_high"] == SEAM_TIS_CAP
    )
    capped = 0
    for it in range(3):
        t = traj.tensors
        assert t[f"it{it}.policy_version"].tolist() == [max(0, it - 1)] * 4
        m = t[f"it{it}.response_mask"].bool()
        d = (t[f"it{it}.old_logprobs"] - t[f"it{it}.rollout_logprobs"])[m]
        assert float(d.abs().max()) > (1e-5 if it == 0 else 0.1)
        assert it > 0 or float(d.abs().max()) < 2e-3
        assert float(t[f"it{it}.rollout_logprobs"][~m].abs().sum()) == 0.0
        capped += int((d.exp() > SEAM_TIS_CAP).sum())
        assert doc["iterations"][it]["metrics"]["seam_staleness"] == float(it > 0)
    assert capped > 0


CUDA_NAMES = [
    pytest.param(
        n,
        marks=pytest.mark.skip(
            reason="a bfloat16 engine's log-probs (and so its sampled tokens) differ between devices by "
            "bfloat16 rounding, beyond CUDA_REPLAY; no tolerance measured yet (no GPU)"
        ),
    )
    if getattr(CASES[n].seam, "dtype", "float32") != "float32"
    else n
    for n in NAMES
]


@pytest.mark.gpu
@pytest.mark.parametrize("name", CUDA_NAMES)
def test_golden_replay_cuda(name: str) -> None:
    ref, _ = _load(name)
    got = run(CASES[name], device="cuda")
    dev = max_deviations(ref, got)
    print(f"{name}: CUDA replay max deviations {dev}")
    assert compare(ref, got, CUDA_REPLAY) == []
