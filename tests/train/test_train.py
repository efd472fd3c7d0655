"""`refppo train` end to end on the embedded task (tiny test-size config), and its bad-input errors."""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from refppo.models.readout import reward_scores
from refppo.models.roles import RewardModel
from refppo.models.tiny import tiny_gpt2, tiny_reward_model
from refppo.train.cli import main as train_main
from refppo.train.config.schema import TrainConfig
from refppo.train.loop import Trainer
from refppo.train.runlog import read_metrics
from refppo.train.runtime import TrainingError
from refppo.train.tasks.presets import TEST, preset
from refppo.train.tasks.words import build_tokenizer, rule_reward

pytestmark = pytest.mark.e2e


def _argv(out: Path, *extra: str, keep_policy: bool = True) -> list[str]:
    sets = [s for s in TEST if keep_policy or not s.startswith("model.policy=")]
    argv = ["--out", str(out)]
    for s in sets:
        argv += ["--set", s]
    return argv + list(extra)


def _save_tiny_lm(path: Path, *, pad: bool = True) -> Path:
    tok = build_tokenizer()
    if not pad:
        tok.pad_token = None
    lm = tiny_gpt2(len(tok), hidden=32, layers=1, heads=2, max_positions=24)
    lm.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_cli_run_writes_metrics_plot_samples_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    rc = train_main(_argv(out, "--set", "run.plot=true", "--set", "run.sample_every=1"))
    assert rc == 0
    text = capsys.readouterr().out
    assert "--- samples at iteration 1 ---" in text and "--- samples at iteration 2 ---" in text
    recs = read_metrics(out / "metrics.jsonl")
    assert [r["iteration"] for r in recs] == [1, 2]
    for key in (
        "rollout/score",
        "rollout/kl",
        "ppo/loss",
        "ppo/pg_loss",
        "ppo/vf_loss",
        "ppo/pg_clipfrac",
        "ppo/vf_clipfrac",
        "rollout/old_entropy",
        "kl_coef",
        "time/iteration",
        "time/peak_rss_mb",
    ):
        assert key in recs[0] and math.isfinite(recs[0][key]), key
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ck = out / "checkpoints" / "iter_000002"
    for name in (
        "policy.safetensors",
        "reference.safetensors",
        "critic.safetensors",
        "reward.safetensors",
        "optim_policy.pt",
        "optim_critic.pt",
        "rng_rank0.pt",
        "state.json",
        "COMPLETE",
    ):
        assert (ck / name).exists(), name
    saved = json.loads((out / "config.json").read_text())
    assert TrainConfig.from_dict(saved) == TrainConfig().with_overrides(
        [*TEST, f"run.out_dir={out}", "run.plot=true", "run.sample_every=1"]
    )


def test_reward_model_path_trains_a_real_reward_model(tmp_path: Path) -> None:
    cfg = preset(
        "test", f"run.out_dir={tmp_path}", "task.rm_steps=60", "task.rm_pairs=256", "task.rm_lr=3e-3"
    )
    t = Trainer(cfg)
    assert isinstance(t.reward, RewardModel)
    assert t.setup_info["rm_heldout_accuracy"] >= 0.75  # the hidden rule, learned from preference pairs
    record, result, _ = t.step(0)
    scores = result.scored.raw_scores
    assert torch.isfinite(scores).all() and float(scores.std()) > 0
    assert "rollout/rule_score" in record  # the true objective is logged next to the learned reward


def test_rule_reward_path_scores_are_the_rule(tmp_path: Path) -> None:
    t = Trainer(preset("test", f"run.out_dir={tmp_path}", "task.reward=rule"))
    assert not isinstance(t.reward, RewardModel)
    _, result, _ = t.step(0)
    b = result.scored.batch
    want = []
    for i in range(b.batch_size):
        p, r = b.unpadded(i)
        s = rule_reward(
            t.tokenizer.decode(p, skip_special_tokens=True), t.tokenizer.decode(r, skip_special_tokens=True)
        )
        want.append(s - (0.0 if bool(result.scored.has_eos[i]) else 1.0))  # missing_eos_penalty = 1
    assert result.scored.scores.tolist() == pytest.approx(want, abs=1e-6)


def test_reward_function_from_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_reward_mod.py").write_text(
        "def length_reward(prompt: str, response: str) -> float:\n    return float(len(response.split()))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    t = Trainer(
        preset(
            "test",
            f"run.out_dir={tmp_path / 'o'}",
            "task.reward=my_reward_mod:length_reward",
            "rollout.missing_eos_penalty=none",
            "task.reward_special_tokens=true",  # every sampled token is one word, EOS included
        )
    )
    _, result, _ = t.step(0)
    assert result.scored.raw_scores.tolist() == result.scored.batch.response_lengths.double().tolist()


def test_bad_reward_function_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert train_main(_argv(tmp_path, "--reward", "no_such_module_xyz:f")) == 2
    assert "cannot import module 'no_such_module_xyz'" in capsys.readouterr().err
    assert train_main(_argv(tmp_path, "--reward", "refppo.train.tasks.words:nope")) == 2
    assert "has no callable 'nope'" in capsys.readouterr().err


def test_local_model_dir_and_reward_model_dir(tmp_path: Path) -> None:
    """--model DIR (AutoModelForCausalLM + AutoTokenizer from a saved dir) and --reward-model DIR."""
    policy = _save_tiny_lm(tmp_path / "policy")
    tok = build_tokenizer()
    rm = tiny_reward_model("gpt2", len(tok), hidden=32, layers=1, heads=2, max_positions=24)
    rm.model.save_pretrained(tmp_path / "rm")
    out = tmp_path / "run"
    rc = train_main(
        _argv(
            out,
            *("--model", str(policy), "--reward-model", str(tmp_path / "rm"), "--embedded-prompts"),
            keep_policy=False,
        )
    )
    assert rc == 0
    recs = read_metrics(out / "metrics.jsonl")
    assert len(recs) == 2 and "rollout/rule_score" not in recs[0]  # not the embedded task: no hidden rule
    # the loaded reward model scores exactly as the one saved
    t = Trainer(
        preset(
            "test",
            f"model.policy={policy}",
            f"model.reward_model={tmp_path / 'rm'}",
            "task.sft_steps=0",
            "task.embedded_prompts=true",
            f"run.out_dir={tmp_path / 'o2'}",
        )
    )
    _, result, _ = t.step(0)
    assert result.scored.raw_scores.tolist() == pytest.approx(
        reward_scores(rm, result.scored.batch).tolist(), abs=1e-6
    )


def test_missing_model_dir_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = train_main(
        _argv(
            tmp_path,
            "--model",
            str(tmp_path / "nope"),
            "--reward",
            "refppo.train.tasks.words:rule_reward",
            keep_policy=False,
        )
    )
    assert rc == 2
    assert "no such directory" in capsys.readouterr().err


def test_tokenizer_without_pad_token_is_a_clear_error(tmp_path: Path) -> None:
    policy = _save_tiny_lm(tmp_path / "policy", pad=False)
    cfg = preset(
        "test",
        f"model.policy={policy}",
        "task.reward=rule",
        "task.embedded_prompts=true",
        f"run.out_dir={tmp_path / 'o'}",
    )
    with pytest.raises(TrainingError, match="no pad token"):
        Trainer(cfg)


def test_prompt_longer_than_context_is_a_clear_error(tmp_path: Path) -> None:
    # context 9 − 6 new tokens leaves 3 prompt tokens; every prompt has ≥ 4 ("review : the film")
    short = ("model.n_positions=9", "task.reward=rule", f"run.out_dir={tmp_path}")
    t = Trainer(preset("test", *short, "task.sft_steps=0"))
    with pytest.raises(TrainingError, match="longer than the 3 allowed"):
        t.step(0)
    with pytest.raises(TrainingError, match="leaves no room for a prompt"):
        Trainer(preset("test", *short, "task.sft_steps=0", "rollout.max_new_tokens=9"))
    with pytest.raises(TrainingError, match="warm-start / reward-model samples reach 18 tokens"):
        Trainer(preset("test", *short))  # 2 + 5 prompt words + 10 response words + <eos> > 9


def test_nan_loss_raises_or_is_skipped_with_weights_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a finite reward (a NaN one is refused at the reward since issue 12) whose square overflows
    # float32: the value loss goes non-finite
    (tmp_path / "nan_reward_mod.py").write_text(
        "def f(prompt: str, response: str) -> float:\n    return 3e38\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    base = ("task.reward=nan_reward_mod:f", f"run.out_dir={tmp_path / 'o'}")
    with pytest.raises(TrainingError, match="non-finite"):
        Trainer(preset("test", *base)).step(0)
    # adaptive β: a skipped update must not move the controller either (with the default fixed
    # controller the β check below could not fail)
    t = Trainer(preset("test", *base, "run.on_nan=skip", "kl.adaptive=true", "kl.target=0.001"))
    before = {f"actor.{k}": v.clone() for k, v in t.actor.state_dict().items()}
    before.update({f"critic.{k}": v.clone() for k, v in t.critic.state_dict().items()})
    record, _, _ = t.step(0)
    assert record["skipped"] == 1
    after = {f"actor.{k}": v for k, v in t.actor.state_dict().items()}
    after.update({f"critic.{k}": v for k, v in t.critic.state_dict().items()})
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert t.kl_ctl.value == t.cfg.ppo.hp.kl_coef


def test_tensorboard_missing_is_skipped_cleanly(tmp_path: Path) -> None:
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        with pytest.warns(UserWarning, match="tensorboard is not installed"):
            rc = train_main(_argv(tmp_path, "--set", "run.tensorboard=true", "--set", "run.iterations=1"))
        assert rc == 0
        assert len(read_metrics(tmp_path / "metrics.jsonl")) == 1
    else:
        assert train_main(_argv(tmp_path, "--set", "run.tensorboard=true", "--set", "run.iterations=1")) == 0
        assert any((tmp_path / "tensorboard").iterdir())


def test_adaptive_kl_controller_in_the_loop(tmp_path: Path) -> None:
    cfg = preset(
        "test",
        "kl.adaptive=true",
        "kl.target=0.001",
        "kl.horizon=10",
        "ppo.kl_coef=0.1",
        "task.reward=rule",
        f"run.out_dir={tmp_path}",
        "run.iterations=3",
    )
    t = Trainer(cfg)
    recs = t.train()
    coefs = [r["kl_coef"] for r in recs]
    assert coefs[0] == 0.1
    # β follows the Ziegler et al. update from each iteration's measured KL (n = global batch = 8)
    beta = 0.1
    for r, c in zip(recs, coefs, strict=True):
        assert c == pytest.approx(beta, rel=1e-12)
        beta *= 1 + min(max(r["rollout/kl"] / 0.001 - 1, -0.2), 0.2) * 8 / 10


def test_bfloat16_autocast_run_on_cpu(tmp_path: Path) -> None:
    """dtype=bfloat16: fp32 master weights, bf16 autocast for rollout and update; metrics stay finite."""
    t = Trainer(preset("test", "model.dtype=bfloat16", "task.reward=rule", f"run.out_dir={tmp_path}"))
    assert t.dtype == torch.bfloat16 and next(t.actor.parameters()).dtype == torch.float32
    record, _, _ = t.step(0)
    assert record["skipped"] == 0 and math.isfinite(record["ppo/loss"])


def test_bfloat16_with_cuda_autocast_dtypes_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's autocast puts log_softmax on its float32 list (linear stays bf16), so on a GPU the
    log-probs come out float32 and the critic's values bf16. The readouts promote both to float32,
    so the core sees one dtype on every device. Emulated on CPU (whose autocast keeps log_softmax in
    bf16) by returning the log-probs in float32; before the promotion the first step with a critic
    stopped with ``DtypeError: ... scores=torch.bfloat16, kl=torch.float32``."""
    from refppo.core.logprobs import logprobs_from_logits as real

    def like_cuda(*a: Any, **k: Any) -> torch.Tensor:
        out: torch.Tensor = real(*a, **k).float()
        return out

    monkeypatch.setattr("refppo.core.logprobs.logprobs_from_logits", like_cuda)
    t = Trainer(preset("test", "model.dtype=bfloat16", "task.reward=rule", f"run.out_dir={tmp_path}"))
    assert t.critic is not None
    record, _, _ = t.step(0)
    assert record["skipped"] == 0
    assert math.isfinite(record["ppo/loss"]) and math.isfinite(record["ppo/vf_loss"])


@pytest.mark.gpu
def test_cuda_bfloat16_run(tmp_path: Path) -> None:
    """--device cuda (bf16 autocast by default on GPU): two iterations and a checkpoint."""
    rc = train_main(_argv(tmp_path, "--device", "cuda", "--set", "model.device=cuda"))
    assert rc == 0
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert len(recs) == 2 and all(math.isfinite(r["ppo/loss"]) for r in recs)


def test_prompts_file_with_a_local_model(tmp_path: Path) -> None:
    """--prompts FILE: prompts drawn from the file (checked against the context up front)."""
    policy = _save_tiny_lm(tmp_path / "policy")
    f = tmp_path / "prompts.txt"
    f.write_text("review : the film\n\nreview : my song was\n")
    t = Trainer(
        preset(
            "test",
            f"model.policy={policy}",
            "task.sft_steps=0",
            "task.reward=rule",
            f"task.prompts_file={f}",
            f"run.out_dir={tmp_path / 'o'}",
        )
    )
    _, _, texts = t.step(0)
    assert set(texts) <= {"review : the film", "review : my song was"} and len(texts) == 8
    f.write_text("review : " + " ".join(["the"] * 30) + "\n")
    with pytest.raises(TrainingError, match="longer than the 18 allowed"):
        Trainer(
            preset(
                "test",
                f"model.policy={policy}",
                "task.sft_steps=0",
                "task.reward=rule",
                f"task.prompts_file={f}",
                f"run.out_dir={tmp_path / 'o'}",
            )
        )


def test_trainer_step_is_ppo_iteration(tmp_path: Path) -> None:
    """The trainer adds no PPO math: its step equals `refppo.train.iteration.iteration` (the goldens'
    path) run directly from the same state — same metrics, same weights, bit for bit."""
    import copy

    from refppo.train.iteration import iteration

    t = Trainer(preset("test", "task.reward=rule", f"run.out_dir={tmp_path}"))
    actor, critic = copy.deepcopy(t.actor), copy.deepcopy(t.critic)
    o = t.cfg.optimizer
    a_opt = torch.optim.AdamW(
        actor.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
    )
    c_opt = torch.optim.AdamW(
        critic.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
    )
    gen = torch.Generator()
    gen.set_state(t.generator.get_state())
    record, _, texts = t.step(0)
    prompt_ids, prompt_mask = t.encode_prompts(texts)
    direct = iteration(
        actor, t.reference, critic, t.reward, a_opt, c_opt, prompt_ids, prompt_mask,
        rollout_cfg=t.rollout_cfg, update_cfg=t.update_cfg, hp=t.cfg.ppo.hp, conv=t.cfg.ppo.convention,
        generator=gen,
    )  # fmt: skip
    for k, v in direct.metrics.items():
        key = ("rollout/" if f"rollout/{k}" in record else "ppo/") + k
        assert record[key] == v, key
    assert all(torch.equal(a, b) for a, b in zip(actor.parameters(), t.actor.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(critic.parameters(), t.critic.parameters(), strict=True))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("def f(prompt, response):\n    return 'good'\n", "expected a number, got str 'good'"),
        ("def f(prompt, response):\n    return None\n", "expected a number, got NoneType"),
        ("def f(prompt):\n    return 1.0\n", "f(prompt) cannot be called as f(prompt: str, response: str)"),
    ],
    ids=["string", "none", "arity"],
)
def test_bad_reward_function_result_is_a_clear_error(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    body: str,
    message: str,
) -> None:
    mod = f"bad_reward_{zlib.crc32(body.encode())}"
    (tmp_path / f"{mod}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert train_main(_argv(tmp_path / "o", "--reward", f"{mod}:f")) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_out_dir_that_is_a_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "afile"
    out.write_text("x")
    assert train_main(_argv(out, "--set", "task.reward=rule")) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
