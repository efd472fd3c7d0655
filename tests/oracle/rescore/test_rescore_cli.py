"""``refppo diff DUMP --actor DIR --ref DIR --critic DIR --reward-model DIR`` as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from oracle_helpers import HP, make_inputs, refppo_dump, setup_for
from rescore_helpers import (
    TAU,
    make_rows,
    save_actor,
    save_reward,
    save_token_critic,
    trainer_logprobs,
    trainer_scores,
    trainer_values,
)

from refppo.dump.write import write_dump

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[3]
HANG_GUARD_S = 900
"""Only a guard against a hang (see tests/oracle/test_diff_cli.py), not a speed check."""
ROWS = make_rows()


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "refppo", "diff", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=HANG_GUARD_S)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("ckpts")
    save_actor(tmp, "gpt2")
    save_actor(tmp, "gpt2", seed=5, name="ref")
    save_token_critic(tmp, "gpt2")
    save_reward(tmp, "gpt2")
    return tmp


def _full_dump(tmp: Path, ckpts: Path, actor_bug: str | None, name: str) -> Path:
    """A whole PPO step (outputs from refppo's pipeline) whose inputs came from the trainer's pass."""
    inputs = make_inputs(B=5, T=6, seed=1, lengths=[6, 2, 4, 5, 3])
    inputs["old_logprobs"] = trainer_logprobs(ckpts / "actor", ROWS, actor_bug).double()
    inputs["ref_logprobs"] = trainer_logprobs(ckpts / "ref", ROWS).double()
    inputs["old_values"] = trainer_values(ckpts / "critic", ROWS).double()
    inputs["scores"] = trainer_scores(ckpts / "rm", ROWS).double()
    s = setup_for()
    tensors = {**refppo_dump(inputs, s, dtype=torch.float32), **ROWS}
    p = tmp / name
    write_dump(p, tensors, hparams={**HP, "temperature": TAU})
    return p


def _models(ckpts: Path) -> list[str]:
    return [
        "--actor",
        str(ckpts / "actor"),
        "--ref",
        str(ckpts / "ref"),
        "--critic",
        str(ckpts / "critic"),
        "--reward-model",
        str(ckpts / "rm"),
    ]


def test_correct_step_matches_tensors_and_rescore(ckpts: Path, tmp_path: Path) -> None:
    p = _full_dump(tmp_path, ckpts, None, "ok.safetensors")
    plain = _run(str(p))  # the sidecar's temperature does not disturb the tensor check
    assert plain.returncode == 0, plain.stdout + plain.stderr
    r = _run(str(p), *_models(ckpts), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(r.stdout)
    assert rep["match"] is True and rep["rescore"]["match"] is True
    assert [(i["role"], i["key"]) for i in rep["rescore"]["items"]] == [
        ("actor", "old_logprobs"),
        ("ref", "ref_logprobs"),
        ("critic", "old_values"),
        ("reward-model", "scores"),
    ]
    assert all(i["ok"] and i["max_abs_err"] < 1e-4 for i in rep["rescore"]["items"])


def test_temperature_bug_exit_1_and_named(ckpts: Path, tmp_path: Path) -> None:
    p = _full_dump(tmp_path, ckpts, "no_temperature", "notemp.safetensors")
    assert _run(str(p)).returncode == 0  # the tensors alone cannot see it
    r = _run(str(p), "--actor", str(ckpts / "actor"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "explained: temperature not applied: the sidecar says τ=0.7" in r.stdout
    assert "RE-SCORE MISMATCH." in r.stdout and "precision dump_vs_float32" in r.stdout


def test_inputs_only_dump_is_checked_by_rescore(ckpts: Path, tmp_path: Path) -> None:
    from rescore_helpers import write_rows

    p = write_rows(tmp_path, ROWS, old_logprobs=trainer_logprobs(ckpts / "actor", ROWS, "labels_off_by_one"))
    r = _run(str(p), "--actor", str(ckpts / "actor"), "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    (item,) = json.loads(r.stdout)["rescore"]["items"]
    assert [e["name"] for e in item["explained_by"]] == ["labels_shifted_+1"]
    assert item["explained_by"][0]["recheck"]["ok"] is True
    # issue #21: transformers' loading bars are not mixed into the report, and a named explanation
    # that is not the temperature is not followed by a solved τ̂ (it was: "τ̂=4.46763")
    assert "Loading" not in r.stderr and "it/s" not in r.stderr, r.stderr
    assert not any("temperature solved" in n for n in item["notes"]), item["notes"]


@pytest.mark.parametrize(
    ("flag", "target", "message"),
    [
        ("--actor", "nowhere", "--actor nowhere: not a local Hugging Face model directory"),
        ("--critic", "actor", "--critic"),
        # a classifier as the actor: its language-model head would be random (was a silent mismatch)
        ("--actor", "rm", "expected a causal language model"),
        ("--ref", "critic", "expected a causal language model"),
    ],
)
def test_bad_model_dir_exit_2_one_line(
    ckpts: Path, tmp_path: Path, flag: str, target: str, message: str
) -> None:
    from rescore_helpers import write_rows

    p = write_rows(tmp_path, ROWS)
    path = target if target == "nowhere" else str(ckpts / target)
    r = _run(str(p), flag, path)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("refppo diff: error:") and message in lines[0], r.stderr


def test_model_flag_without_sequences_exit_2(ckpts: Path, tmp_path: Path) -> None:
    p = _full_dump(tmp_path, ckpts, None, "noseq.safetensors")
    from safetensors.torch import load_file, save_file

    data = {k: v for k, v in load_file(str(p)).items() if k not in ("input_ids", "attention_mask")}
    save_file(data, str(p))
    r = _run(str(p), "--actor", str(ckpts / "actor"))
    assert r.returncode == 2 and "re-scoring needs input_ids and attention_mask" in r.stderr


def test_plain_diff_does_not_import_transformers(ckpts: Path, tmp_path: Path) -> None:
    p = _full_dump(tmp_path, ckpts, None, "plain.safetensors")
    code = (
        "import sys\nfrom refppo.oracle.cli import main\n"
        f"rc = main([{str(p)!r}])\n"
        "assert 'transformers' not in sys.modules, 'transformers imported'\nsys.exit(rc)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=HANG_GUARD_S
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_gpu_check_script_runs_on_cpu() -> None:
    """tools/rescore_gpu_check.py (the GPU variant in tools/gpu_check.sh), run with --device cpu."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, str(REPO / "tools" / "rescore_gpu_check.py"), "--device", "cpu"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=HANG_GUARD_S)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rescore check on cpu: OK" in r.stdout
    assert r.stdout.count("named ['temperature_not_applied']") == 2
    assert r.stdout.count("bf16 pass, dump_vs_float32") == 2


def test_ids_the_model_cannot_embed_exit_2_one_line(ckpts: Path, tmp_path: Path) -> None:
    # token ids beyond the actor's vocabulary (another tokenizer) were a raw IndexError traceback
    from rescore_helpers import write_rows

    vocab = json.loads((ckpts / "actor" / "config.json").read_text())["vocab_size"]
    rows = {**ROWS, "input_ids": ROWS["input_ids"].clone()}
    rows["input_ids"][1, -1] = vocab + 3
    r = _run(str(write_rows(tmp_path, rows)), "--actor", str(ckpts / "actor"))
    assert r.returncode == 2 and r.stdout == "", r.stderr
    last = r.stderr.strip().splitlines()[-1]  # (transformers' weight-loading progress precedes it)
    assert last.startswith("refppo diff: error:") and f"vocabulary has {vocab} tokens" in last, r.stderr
    assert "rows [1]" in last and "Traceback" not in r.stderr, r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where CUDA is absent")
def test_cuda_device_without_cuda_exit_2_one_line(ckpts: Path, tmp_path: Path) -> None:
    from rescore_helpers import write_rows

    r = _run(str(write_rows(tmp_path, ROWS)), "--actor", str(ckpts / "actor"), "--device", "cuda")
    lines = r.stderr.strip().splitlines()  # refused before any checkpoint loads: one line
    assert r.returncode == 2 and len(lines) == 1 and "CUDA is not available" in lines[0], r.stderr
