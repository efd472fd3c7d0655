"""`refppo train` / `refppo demo` as a new user meets them (issue 12, items 4–7 and 10–15): errors
that tell the truth, defaults that fit the machine, output a person reads. Tiny models are saved
with ``save_pretrained`` in tmp dirs; nothing is downloaded."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torchrun_helpers import torchrun_train

from refppo.cli import main as refppo_main
from refppo.models.batch import left_pad
from refppo.models.roles import RewardModel, RewardModelError
from refppo.models.rollout import RolloutConfig, generate_rollout
from refppo.models.tiny import Arch, tiny_actor, tiny_llama, tiny_reward_model
from refppo.train import setup as train_setup
from refppo.train.cli import main as train_main
from refppo.train.config.schema import TrainConfig
from refppo.train.demo import main as demo_main
from refppo.train.loop import Trainer
from refppo.train.reward_fn import RewardFunctionError
from refppo.train.runlog import SERIES_LABELS, plot_figure
from refppo.train.runtime import TrainingError
from refppo.train.tasks.presets import DEMO, TEST, preset
from refppo.train.tasks.words import build_tokenizer

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def _argv(out: Path, *extra: str) -> list[str]:
    """The TEST preset as --set flags (without its model.policy when --model is given: --set wins)."""
    argv = ["--out", str(out)]
    for s in TEST:
        if not ("--model" in extra and s.startswith("model.policy=")):
            argv += ["--set", s]
    return argv + list(extra)


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, body: str) -> str:
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _save_lm(path: Path, arch: Arch = "gpt2") -> Path:
    tok = build_tokenizer()
    lm = tiny_actor(arch, len(tok), hidden=32, layers=1, heads=2, max_positions=24)
    lm.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _prompts(path: Path, *lines: str) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


# ------------------------------------------------------------------------ 4, 5: reward-function errors


def test_reward_function_bug_names_iteration_prompt_and_user_frames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A KeyError inside the reward: exit 2, the iteration, the prompt and the user's own line —
    not a raw refppo traceback (before issue 12 the KeyError escaped train_main)."""
    mod = _module(
        tmp_path, monkeypatch, "ux_keyerr_mod", "def f(prompt, response):\n    return {}[response]\n"
    )
    assert train_main(_argv(tmp_path / "o", "--reward", f"{mod}:f")) == 2
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert first.startswith(
        "refppo train: error: iteration 1: reward function ux_keyerr_mod:f raised KeyError"
    )
    assert "on the prompt 'review :" in first
    assert f'File "{tmp_path / "ux_keyerr_mod.py"}", line 2, in f' in err
    assert "/refppo/" not in err  # no frame of refppo itself


def test_numpy_float32_reward_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    mod = _module(
        tmp_path,
        monkeypatch,
        "ux_np32_mod",
        "import numpy as np\n\ndef f(prompt, response):\n    return np.float32(len(response.split()) / 10)\n",
    )
    assert train_main(_argv(tmp_path / "o", "--reward", f"{mod}:f")) == 0, capsys.readouterr().err


def test_nan_reward_is_refused_with_the_prompt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    mod = _module(tmp_path, monkeypatch, "ux_nan_mod", "def f(prompt, response):\n    return float('nan')\n")
    assert train_main(_argv(tmp_path / "o", "--reward", f"{mod}:f")) == 2
    err = capsys.readouterr().err
    assert re.search(r"iteration 1: reward function ux_nan_mod:f returned nan on the prompt 'review : ", err)
    assert "non-finite" not in err  # caught at the reward, not later as a loss


def test_non_finite_loss_names_the_checkpoint_only_when_there_is_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A finite reward whose square overflows float32 makes the value loss non-finite: with no
    checkpoint on disk the message must not claim "the last checkpoint is intact"."""
    mod = _module(
        tmp_path,
        monkeypatch,
        "ux_overflow_mod",
        "calls = [0]\n\ndef f(prompt, response):\n"
        "    calls[0] += 1\n    return 0.0 if calls[0] <= 8 else 3e38\n",
    )
    base = (f"task.reward={mod}:f", "task.sft_steps=0", "task.rm_steps=0")
    t = Trainer(preset("test", *base, f"run.out_dir={tmp_path / 'a'}"))
    t.step(0)  # the 8 finite calls of iteration 1 (batch 8)
    with pytest.raises(TrainingError, match="non-finite") as info:
        t.step(1)
    assert "no checkpoint exists yet" in str(info.value) and "intact" not in str(info.value)
    sys.modules[mod].calls[0] = 0
    t = Trainer(preset("test", *base, f"run.out_dir={tmp_path / 'b'}", "run.checkpoint_every=1"))
    with pytest.raises(TrainingError, match="non-finite") as info:
        t.train()
    assert f"the last checkpoint, '{tmp_path / 'b' / 'checkpoints' / 'iter_000001'}', is intact" in str(
        info.value
    )


def test_reward_errors_are_reward_function_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _module(tmp_path, monkeypatch, "ux_str_mod", "def f(prompt, response):\n    return [1.0, 2.0]\n")
    t = Trainer(preset("test", f"task.reward={mod}:f", "task.sft_steps=0", f"run.out_dir={tmp_path / 'o'}"))
    with pytest.raises(
        RewardFunctionError, match=r"iteration 1: reward function .*expected a number, got list"
    ):
        t.step(0)


# --------------------------------------------------------------------------- 6: reward model with no head


def test_causal_lm_as_reward_model_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = _save_lm(tmp_path / "policy")
    causal = _save_lm(tmp_path / "causal", "llama")
    with pytest.raises(RewardModelError, match=r"score head \(score.weight\) is not in the checkpoint"):
        RewardModel.from_pretrained(causal)
    prompts = _prompts(tmp_path / "p.txt", "review : the film")
    capsys.readouterr()
    argv = ["--model", str(policy), "--reward-model", str(causal), "--prompts", str(prompts)]
    assert train_main(_argv(tmp_path / "o", *argv)) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "refppo train: error" in ln]
    assert len(lines) == 1 and "is not in the checkpoint" in lines[0]
    assert "MISSING" not in err  # transformers' load report is replaced by the one line
    # a real reward model (score head saved) still loads
    rm = tiny_reward_model("llama", len(build_tokenizer()), hidden=32, layers=1, heads=2, max_positions=24)
    rm.model.save_pretrained(tmp_path / "rm")
    assert isinstance(RewardModel.from_pretrained(tmp_path / "rm"), RewardModel)


# ----------------------------------------------------------------------------------- 7: prompts checks


def _no_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(path: object) -> None:
        raise AssertionError(f"a model was loaded from {path}")

    monkeypatch.setattr(train_setup, "load_actor", refuse)
    monkeypatch.setattr(train_setup, "load_reward_model", refuse)


def test_local_model_without_prompts_is_refused_before_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = _save_lm(tmp_path / "policy")
    _no_model_loads(monkeypatch)
    assert (
        train_main(
            _argv(tmp_path / "o", "--model", str(policy), "--reward", "refppo.train.tasks.words:rule_reward")
        )
        == 2
    )
    err = capsys.readouterr().err
    assert f"--model {str(policy)!r} needs --prompts FILE" in err and "--embedded-prompts" in err


def test_missing_prompts_file_is_reported_before_any_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = _save_lm(tmp_path / "policy")
    _no_model_loads(monkeypatch)
    missing = tmp_path / "nope.txt"
    argv = ["--model", str(policy), "--reward-model", str(policy), "--prompts", str(missing)]
    assert train_main(_argv(tmp_path / "o", *argv)) == 2
    assert f"task.prompts_file {str(missing)!r} (--prompts): no such file" in capsys.readouterr().err


def test_prompts_file_not_utf8_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A latin-1 prompts file: one line naming the file and the key, exit 2 (not a traceback)."""
    policy = _save_lm(tmp_path / "policy")
    f = tmp_path / "latin.txt"
    f.write_bytes("review : café crème\n".encode("latin-1"))
    argv = ["--model", str(policy), "--reward", "refppo.train.tasks.words:rule_reward", "--prompts", str(f)]
    assert train_main(_argv(tmp_path / "o", *argv)) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "error" in ln.lower()]  # transformers' progress bars aside
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(
        f"refppo train: error: task.prompts_file {str(f)!r} (--prompts): not UTF-8 text"
    )


def test_over_long_prompt_names_the_file_and_line(tmp_path: Path) -> None:
    policy = _save_lm(tmp_path / "policy")
    f = _prompts(tmp_path / "p.txt", "review : the film", "", "review : " + " ".join(["the"] * 30))
    cfg = preset(
        "test", f"model.policy={policy}", "task.sft_steps=0", "task.reward=rule", f"task.prompts_file={f}"
    )
    with pytest.raises(
        TrainingError, match=re.escape(f"{f}:3: prompt of 32 tokens is longer than the 18 allowed")
    ):
        Trainer(cfg.with_overrides([f"run.out_dir={tmp_path / 'o'}"]))


# ------------------------------------------------------------------------------ 10: default thread count


def test_auto_threads_use_one_thread_for_a_small_cpu_model(tmp_path: Path) -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        t = Trainer(
            preset(
                "test",
                "model.threads=0",
                "task.reward=rule",
                "task.sft_steps=0",
                f"run.out_dir={tmp_path / 'a'}",
            )
        )
        assert t.threads == 1 and torch.get_num_threads() == 1
        t = Trainer(
            preset(
                "test",
                "model.threads=2",
                "task.reward=rule",
                "task.sft_steps=0",
                f"run.out_dir={tmp_path / 'b'}",
            )
        )
        assert t.threads == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------- 11: module in the current dir


def test_reward_module_in_the_current_directory_under_the_console_script(tmp_path: Path) -> None:
    """`refppo train --reward mod:fn` from a directory holding mod.py, run through the installed
    console script (its sys.path[0] is the venv's bin/, not the cwd): found, as under python -m."""
    script = Path(sys.executable).parent / "refppo"
    assert script.exists(), f"console script {script} not installed (pip install -e .)"
    (tmp_path / "cwd_reward_mod.py").write_text("def score(prompt, response):\n    return 1.0\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    argv = [
        str(script),
        "train",
        *_argv(tmp_path / "o", "--reward", "cwd_reward_mod:score"),
        "--set",
        "run.iterations=1",  # --set wins over the TEST preset's run.iterations=2 (--iterations would not)
    ]
    r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "done: 1 iterations, final reward" in r.stdout


# ------------------------------------------------------------------- 12: what the reward function sees


def test_reward_function_sees_no_special_tokens_unless_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mod = _module(
        tmp_path,
        monkeypatch,
        "ux_record_mod",
        "seen = []\n\ndef f(prompt, response):\n    seen.append(response)\n    return 0.0\n",
    )
    tok = build_tokenizer()
    seen_list = importlib.import_module(mod).seen
    for keep in (False, True):
        seen_list.clear()
        t = Trainer(
            preset(
                "test",
                f"task.reward={mod}:f",
                f"task.reward_special_tokens={str(keep).lower()}",
                "rollout.max_new_tokens=10",
                f"run.out_dir={tmp_path / str(keep)}",
            )
        )
        _, result, _ = t.step(0)
        b = result.scored.batch
        seen = list(seen_list)
        assert len(seen) == b.batch_size
        for i in range(b.batch_size):
            ids = b.unpadded(i)[1]
            words = tok.convert_ids_to_tokens(ids)
            if keep:
                assert seen[i].split() == words
            else:
                assert seen[i].split() == [w for w in words if w not in (tok.eos_token, tok.pad_token)]
        if not keep:
            assert any(bool(e) for e in result.scored.has_eos)  # the test saw an EOS to strip
            assert all(tok.eos_token not in s and tok.pad_token not in s for s in seen)


# ------------------------------------------------------------------------------------------- 13: plot


def test_missing_eos_penalty_is_logged_and_plotted_as_its_own_series(tmp_path: Path) -> None:
    t = Trainer(
        preset("test", "task.reward=rule", "rollout.max_new_tokens=3", f"run.out_dir={tmp_path / 'a'}")
    )
    record, result, _ = t.step(0)
    s = result.scored
    want = float((s.raw_scores.double() - s.scores.double()).mean())
    assert want > 0  # 3 tokens: some responses truncated
    assert record["rollout/missing_eos_penalty"] == pytest.approx(want, abs=1e-6)
    assert want == pytest.approx(
        1.0 * float((~s.has_eos).double().mean()), abs=1e-6
    )  # penalty 1.0 × truncated
    t_off = Trainer(
        preset(
            "test", "task.reward=rule", "rollout.missing_eos_penalty=none", f"run.out_dir={tmp_path / 'b'}"
        )
    )
    record_off, _, _ = t_off.step(0)
    assert "rollout/missing_eos_penalty" not in record_off
    import matplotlib.pyplot as plt

    for records, shown in (([record], True), ([record_off], False)):
        fig = plot_figure(records)
        try:
            axes = [ax for ax in fig.axes if ax.get_title()]  # the panels (the rule score's axis apart)
            assert len(axes) == 6
            for ax in axes:
                assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
            reward_ax = axes[0]
            labels = [t.get_text() for t in reward_ax.get_legend().get_texts()]
            assert (SERIES_LABELS["rollout/missing_eos_penalty"] in labels) is shown
            assert SERIES_LABELS["rollout/score"] in labels and SERIES_LABELS["rollout/raw_score"] in labels
            assert "rule_score" in " ".join(labels)
            assert "iteration" in reward_ax.get_xlabel() and "reward" in reward_ax.get_ylabel()
            assert "nats" in axes[1].get_ylabel()
        finally:
            plt.close(fig)


def _records(n: int, critic: bool = True) -> list[dict[str, float]]:
    """``n`` hand-made records (no missing-EOS penalty: ``score`` = ``raw_score``)."""
    out = []
    for i in range(1, n + 1):
        r = {"iteration": i, "rollout/score": 0.1 * i, "rollout/raw_score": 0.1 * i, "rollout/kl": 0.01}
        r.update({"rollout/rule_score": 0.05 * i, "ppo/pg_loss": -0.01, "ppo/pg_clipfrac": 0.1})
        r.update({"rollout/old_entropy": 3.0})
        if critic:
            r.update({"ppo/vf_loss": 0.3, "ppo/vf_clipfrac": 0.02})
        out.append(r)
    return out


@pytest.mark.parametrize("n", [2, 3, 7])
def test_plot_rule_score_on_its_own_axis_score_apart_integer_ticks(n: int) -> None:
    """The hidden-rule score (a score in [−1, 1]) has its own y-axis on the reward panel; the
    solid ``score`` and the dashed, crossed ``raw_score`` stay apart where they coincide; every
    panel's iteration ticks are whole numbers."""
    import matplotlib.pyplot as plt

    from refppo.train.runlog import RULE_AXIS_LABEL

    fig = plot_figure(_records(n), kl_estimator="k3")
    try:
        panels = [ax for ax in fig.axes if ax.get_title()]
        reward = panels[0]
        twins = [ax for ax in fig.axes if not ax.get_title()]
        assert [ax.get_ylabel() for ax in twins] == [RULE_AXIS_LABEL]
        assert [ln.get_label() for ln in twins[0].lines] == [SERIES_LABELS["rollout/rule_score"]]
        by_label = {ln.get_label(): ln for ln in reward.lines}
        assert SERIES_LABELS["rollout/rule_score"] not in by_label  # not on the reward's axis
        score, raw = by_label[SERIES_LABELS["rollout/score"]], by_label[SERIES_LABELS["rollout/raw_score"]]
        assert list(score.get_ydata()) == list(raw.get_ydata())  # the case where they would hide
        assert score.get_linestyle() != raw.get_linestyle() and score.get_marker() != raw.get_marker()
        for ax in panels:
            lo, hi = ax.get_xlim()
            ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
            assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)
        kl_labels = [t.get_text() for t in panels[1].get_legend().get_texts()]
        assert any("k3" in t for t in kl_labels), kl_labels
    finally:
        plt.close(fig)


@pytest.mark.parametrize(
    ("sets", "label"),
    [((), "KL(k1)"), (("ppo.kl_estimator=k3", "ppo.advantage=grpo", "rollout.group_size=4",
                       "task.reward=rule", "ppo.whiten_advantages=none"), "KL(k3)")],
    ids=["ppo-k1", "grpo-k3"],
)  # fmt: skip
def test_the_training_log_names_the_kl_estimator_and_a_critic_free_run_logs_no_critic(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sets: tuple[str, ...], label: str
) -> None:
    """Every iteration line and the summary say which estimator the KL is (a k1 sum can be
    negative); a critic-free run's metrics.jsonl holds nothing of a critic."""
    from refppo.train.runlog import read_metrics

    argv = ["--out", str(tmp_path / "run")]
    for x in (*TEST, *sets):
        argv += ["--set", x]
    assert train_main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    its = [ln for ln in lines if re.match(r"iteration \d+/2: reward", ln)]
    done = [ln for ln in lines if ln.startswith("done: ")]
    assert len(its) == 2 and len(done) == 1, lines
    for ln in (*its, *done):
        assert f" {label} " in ln and " KL " not in ln, ln
    recs = read_metrics(tmp_path / "run" / "metrics.jsonl")
    critic_keys = {"ppo/vf_loss", "ppo/vf_clipfrac", "ppo/critic_grad_norm", "rollout/value_mean"}
    for r in recs:
        assert (critic_keys <= set(r)) is (not sets), sorted(critic_keys & set(r))
        assert not sets or not critic_keys & set(r)


def test_plot_of_a_critic_free_run_has_no_value_panel() -> None:
    import matplotlib.pyplot as plt

    for critic in (True, False):
        fig = plot_figure(_records(3, critic=critic))
        try:
            titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
            assert any(t.startswith("Value loss") for t in titles) is critic, titles
            legends = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().texts]
            assert (SERIES_LABELS["ppo/vf_clipfrac"] in legends) is critic, legends
            assert "not logged" not in [t.get_text() for ax in fig.axes for t in ax.texts]
        finally:
            plt.close(fig)


# ------------------------------------------------------------------------------------------- 14: noise


def test_cache_deprecation_warning_is_silenced_and_nothing_else() -> None:
    from transformers.utils import logging as hf_logging

    tok = build_tokenizer()
    actor = tiny_llama(len(tok), hidden=32, layers=1, heads=2, max_positions=24)
    other = "an unrelated FutureWarning from inside the model"
    inner_forward = actor.forward

    def forward(*args: object, **kw: object) -> object:
        warnings.warn(other, FutureWarning, stacklevel=2)
        return inner_forward(*args, **kw)

    actor.forward = forward  # type: ignore[method-assign]  # wrap to emit a second, unrelated warning
    hf_logging.warning_once.cache_clear()  # the deprecation log line is emitted once per process
    logged: list[str] = []

    class Collect(__import__("logging").Handler):
        def emit(self, record: object) -> None:
            logged.append(record.getMessage())  # type: ignore[attr-defined]

    handler = Collect()
    logger = __import__("logging").getLogger("transformers.utils.generic")
    logger.addHandler(handler)
    pid, pmask = left_pad([tok("review : the film", add_special_tokens=False)["input_ids"]], tok.pad_token_id)
    cfg = RolloutConfig(max_new_tokens=3, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            generate_rollout(actor, pid, pmask, cfg, torch.Generator().manual_seed(0))
    finally:
        logger.removeHandler(handler)
    texts = [str(w.message) for w in caught]
    assert not [t for t in texts if "past_key_values" in t], texts
    assert not [m for m in logged if "past_key_values" in m], logged
    assert texts.count(other) == 3  # one per generation step: other warnings still get through


def test_no_progress_prints_one_plain_line_per_iteration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert train_main(_argv(tmp_path / "o", "--set", "task.reward=rule", "--no-progress")) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("iteration ")]
    assert [ln.split(":")[0] for ln in lines] == ["iteration 1/2", "iteration 2/2"]
    assert all("reward" in ln and "KL" in ln and "loss" in ln for ln in lines)


def test_torchrun_prints_loading_and_summary_lines_once(tmp_path: Path) -> None:
    """Under `torchrun --nproc-per-node 2`: transformers' "Loading weights" bar and the final
    "done:" line once (rank 0), not once per rank. ``--standalone``: the rendezvous store binds a
    free port itself (a port found free and released first can be taken meanwhile; issue 12 item 17)."""
    policy = _save_lm(tmp_path / "policy")
    prompts = _prompts(tmp_path / "p.txt", "review : the film", "review : my song was")
    args = _argv(tmp_path / "o", "--model", str(policy), "--prompts", str(prompts))
    args += ["--set", "task.reward=rule", "--set", "run.iterations=1"]
    out, err = tmp_path / "torchrun.out", tmp_path / "torchrun.err"
    torchrun_train(out, *args, err=err, timeout=600)
    stdout = out.read_text(errors="replace")
    both = stdout + err.read_text(errors="replace")
    assert both.count("Loading weights: 100%") == 1, both[-3000:]
    assert stdout.count("done: 1 iterations") == 1, stdout[-3000:]
    assert stdout.count("iteration 1/1:") == 1


# -------------------------------------------------------------------------------------------- 15: CLI


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert refppo_main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"refppo {importlib.metadata.version('refppo')}"


def test_demo_help_is_plain_text_with_the_presets_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        demo_main(["--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps nothing (raw text), but be safe
    assert "``" not in out and not re.search(r":(data|class|func|mod):`", out)
    d = dict(s.split("=", 1) for s in DEMO)  # the preset's own strings, not the help's formatting
    cfg = TrainConfig().with_overrides(list(DEMO))
    assert f"{d['task.sft_steps']} supervised steps of {cfg.task.sft_batch_size} samples" in out
    assert f"for {d['task.rm_steps']} steps on {d['task.rm_pairs']} preference pairs" in out
    assert f"{d['run.iterations']} PPO iterations of {d['rollout.batch_size']} prompts" in out
    assert f"at most {d['rollout.max_new_tokens']} new tokens" in out
    assert (
        f"{d['ppo.epochs']} epochs x {d['ppo.minibatches']} minibatches, KL coefficient {d['ppo.kl_coef']}"
        in out
    )


def test_help_config_describes_every_set_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert train_main(["--help-config"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    data = TrainConfig().to_dict()
    keys = [f"{section}.{key}" for section, values in data.items() for key in values]
    assert len(keys) > 60
    for key in keys:
        idx = [i for i, ln in enumerate(lines) if ln.startswith(f"  {key}  (")]
        assert len(idx) == 1, key
        description = lines[idx[0] + 1]
        assert (
            description.startswith("      ") and description.strip() and "(undocumented)" not in description
        ), key
    assert "  model.threads  (int, default 0)" in out and "  ppo.cliprange  (float, default 0.2)" in out
    assert (
        "  ppo.loss_agg  ({token-mean|" in out
        and "  rollout.missing_eos_penalty  (float | none, default 1.0)" in out
    )
    assert "``" not in out and ":class:`" not in out
    assert train_main(["--help-config", "kl"]) == 0
    assert "kl.target" in capsys.readouterr().out
    assert train_main(["--help-config", "nope"]) == 2


def test_help_config_names_checkpoints_and_dumps_as_they_are_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The names in ``--help-config`` are those the trainer writes (six-digit iterations), not a
    pattern a user has to decode (``iter_<N>`` read as ``iter_2``)."""
    from refppo.atomic import TMP_PREFIX
    from refppo.train.checkpoint import staging_dir
    from refppo.train.dump import dump_path

    assert train_main(["--help-config", "run"]) == 0
    out = capsys.readouterr().out
    ckpt = staging_dir(tmp_path, 2).name.removeprefix(TMP_PREFIX)
    dump = dump_path(tmp_path, 2).name
    assert (ckpt, dump) == ("iter_000002", "iter_000002.safetensors")
    assert ckpt in out
    assert dump in out and "iter_<N>" not in out


def test_the_progress_bar_names_the_kl_estimator() -> None:
    from refppo.train.runlog import Progress, kl_label

    bar = Progress(3, 0, True, bar=True, kl_label=kl_label("k3"))
    try:
        bar.update({"iteration": 1, "rollout/score": 0.5, "rollout/kl": 0.1, "ppo/loss": 0.2})
        assert bar.bar.postfix == "reward=0.500, KL(k3)=0.100, loss=0.200"
    finally:
        bar.close()
