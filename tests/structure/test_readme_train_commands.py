"""Every ``refppo train`` command of README.md works as written (#20 item 7, #21 item 9), run with
the tiny sizes of ``readme_helpers.TINY`` for the keys the command leaves alone."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from readme_helpers import SCENARIOS, blocks, metrics, run, save_local_models, train


def test_train_help_and_print_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cmds = SCENARIOS["help"]
    r = run(cmds[0], tmp_path, capsys)
    assert r.rc == 0 and "ppo.cliprange  (float, default 0.2)" in r.out and "[run]" not in r.out
    r = run(cmds[1], tmp_path, capsys)
    assert r.rc == 0 and json.loads(r.out)["ppo"]["minibatches"] == 4


def test_train_config_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """my.toml (the README's block) is read; --set after it wins; the KL controller and the GRPO
    command run, the latter with the demo's critic-free setting."""
    (tmp_path / "my.toml").write_text(blocks("toml")[0])
    toml_cmd, adaptive, grpo = SCENARIOS["config"]
    conf = json.loads(run("refppo train --config my.toml --print-config", tmp_path, capsys).out)
    assert (conf["ppo"]["kl_coef"], conf["ppo"]["loss_agg"], conf["run"]["iterations"]) == (
        0.1,
        "seq-mean-token-mean",
        50,
    )
    conf = json.loads(run(toml_cmd + " --print-config", tmp_path, capsys).out)
    assert (conf["ppo"]["cliprange"], conf["ppo"]["loss_agg"]) == (0.1, "seq-mean-token-sum")
    for cmd, out in ((toml_cmd, "runs/refppo"), (adaptive, "runs/kl"), (grpo, "runs/grpo")):
        train(cmd + f" --out {out}", tmp_path, capsys)
    kl = [r["kl_coef"] for r in metrics(tmp_path / "runs/kl/metrics.jsonl")]
    assert kl[0] != kl[1], "kl.adaptive=true left β fixed"
    assert len(metrics(tmp_path / "runs/grpo/metrics.jsonl")) == 2
    conf = json.loads((tmp_path / "runs/grpo/config.json").read_text())
    assert (conf["ppo"]["advantage"], conf["ppo"]["whiten_advantages"], conf["rollout"]["group_size"]) == (
        "grpo",
        "none",
        8,
    )


def test_readme_grpo_command_is_the_demo_setting() -> None:
    """#21 item 9: the README's GRPO command sets what `refppo demo --grpo` sets (no whitening)."""
    from refppo.train.tasks.presets import DEMO, DEMO_GRPO

    grpo = dict(kv.split("=", 1) for kv in DEMO_GRPO if kv not in DEMO)
    cmd = shlex.split(SCENARIOS["config"][2])
    readme = dict(cmd[i + 1].split("=", 1) for i, a in enumerate(cmd) if a == "--set")
    assert readme == {k: v for k, v in grpo.items() if not k.startswith("task.")}
    assert readme["ppo.whiten_advantages"] == "none"


def test_train_local_model_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_local_models(tmp_path)
    rm_cmd, fn_cmd = SCENARIOS["local"]
    train(rm_cmd + " --out runs/rm", tmp_path, capsys)
    train(fn_cmd + " --out runs/fn", tmp_path, capsys)
    for run_dir in ("runs/rm", "runs/fn"):
        recs = metrics(tmp_path / run_dir / "metrics.jsonl")
        assert len(recs) == 2 and "rollout/rule_score" not in recs[0]  # not the embedded task
    conf = json.loads((tmp_path / "runs/fn/config.json").read_text())
    assert (conf["task"]["reward"], conf["model"]["policy"]) == ("myrewards:score", "./my-sft-model")


def test_run_folder_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Checkpoint, resume to run.iterations=40, overwrite — in the README's order, one folder."""
    first, resume, overwrite = SCENARIOS["run_folder"]
    train(first, tmp_path, capsys)
    out = tmp_path / "runs/a"
    assert (out / "checkpoints/iter_000002/COMPLETE").exists() and (out / "run.json").exists()
    train(resume, tmp_path, capsys)
    assert [r["iteration"] for r in metrics(out / "metrics.jsonl")] == list(range(1, 41))
    (out / "notes.txt").write_text("mine")
    train(overwrite, tmp_path, capsys)
    assert [r["iteration"] for r in metrics(out / "metrics.jsonl")] == [1, 2]
    assert (out / "notes.txt").read_text() == "mine"


def test_dump_iteration_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """#21 item 9: the README's dump command runs, and `refppo diff` on the path it names matches."""
    train_cmd, diff_cmd = SCENARIOS["dump"]
    train(train_cmd, tmp_path, capsys)
    r = run(diff_cmd, tmp_path, capsys)
    assert r.rc == 0 and "MATCH" in r.out and "grad_logprobs" in r.out, r.out + r.err


def test_dump_iteration_without_one_minibatch_exits_2_naming_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Why the README's command sets ppo.minibatches=1 (the default is 4)."""
    cmd = SCENARIOS["dump"][0].replace(" --set ppo.minibatches=1", "")
    r = run(cmd, tmp_path, capsys, "--set", "ppo.minibatches=4")
    assert r.rc == 2 and "ppo.minibatches=1" in r.err
