"""`refppo train` with a critic-free ``ppo.advantage`` (issue #13 item 5).

No critic model, no critic optimizer, no value loss, no critic files in checkpoints; the rows are
``rollout.group_size`` consecutive responses per prompt and the advantages the trainer uses are
the core's naive twin on those scores and groups; ``--resume`` continues exactly; bad
combinations are refused in one line (exit 2 from the CLI).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from refppo.conventions import AdvantageEstimator
from refppo.core.group_naive import group_advantages_naive, reinforce_pp_advantages_naive
from refppo.group_conventions import GroupKL
from refppo.train import checkpointing
from refppo.train.cli import main as train_main
from refppo.train.config.sections import ConfigError
from refppo.train.loop import Trainer
from refppo.train.runlog import deterministic, read_metrics
from refppo.train.tasks.presets import preset
from refppo.train.tasks.words import verify_reward

pytestmark = pytest.mark.e2e

G = 4
GROUPED = ("rollout.group_size=4", "task.reward=rule")  # TEST: 8 rows = 2 prompts x 4


@pytest.mark.parametrize("adv", [e.value for e in AdvantageEstimator if e is not AdvantageEstimator.GAE])
def test_critic_free_step_has_no_critic_and_the_core_advantages(tmp_path: Path, adv: str) -> None:
    t = Trainer(preset("test", *GROUPED, f"ppo.advantage={adv}", f"run.out_dir={tmp_path}"))
    assert t.critic is None and t.critic_opt is None and "critic" not in checkpointing.models(t)
    record, result, texts = t.step(0)
    assert texts[:G] == [texts[0]] * G and texts[G:] == [texts[G]] * G and texts[0] != texts[G]
    critic_keys = {"ppo/vf_loss", "ppo/vf_clipfrac", "ppo/critic_grad_norm", "rollout/value_mean"}
    assert not critic_keys & set(record), sorted(critic_keys & set(record))  # nothing of a critic logged
    assert {"ppo/pg_loss", "ppo/actor_grad_norm", "ppo/pg_clipfrac"} <= set(record)
    sc, q = result.scored, result.quantities
    m = sc.batch.response_mask
    hp, conv = t.cfg.ppo.hp, t.cfg.ppo.convention
    assert conv.adv.group_kl is GroupKL.FOLD
    kl = (sc.old_logprobs - sc.ref_logprobs).double() * m  # k1, in the reward (the defaults)
    if adv == "reinforce++":
        rewards = -hp.kl_coef * kl
        last = m.long().sum(1) - 1
        rewards[torch.arange(len(last)), last] += sc.scores.double()
        want = reinforce_pp_advantages_naive(rewards, m, gamma=hp.gamma, whiten_eps=hp.whiten_eps)
        got = q.advantages
    else:
        s = sc.scores.double() - hp.kl_coef * kl.sum(1)
        gi = torch.arange(2).repeat_interleave(G)
        want = group_advantages_naive(
            s, gi, m, estimator=adv, eps=conv.adv.group_eps, whiten_eps=hp.whiten_eps
        )
        got = q.advantages if adv == "reinforce++-baseline" else q.advantages_raw
    assert float((got.double() - want.double()).abs().max()) <= 1e-5, adv
    assert float(got.abs().max()) > 1e-3  # the scores differ within a group: a real signal


def test_grpo_run_checkpoints_without_critic_and_resumes_exactly(tmp_path: Path) -> None:
    common = (*GROUPED, "ppo.advantage=grpo", "ppo.whiten_advantages=none", "run.iterations=4")
    straight, split = tmp_path / "straight", tmp_path / "split"
    Trainer(preset("test", *common, f"run.out_dir={straight}")).train()
    Trainer(preset("test", *common, f"run.out_dir={split}", "run.iterations=2")).train()
    resumed = Trainer(preset("test", *common, f"run.out_dir={split}"), resume=True)
    assert resumed.start_iteration == 2
    resumed.train()
    a = [deterministic(r) for r in read_metrics(straight / "metrics.jsonl")]
    b = [deterministic(r) for r in read_metrics(split / "metrics.jsonl")]
    assert [r["iteration"] for r in b] == [1, 2, 3, 4] and a == b
    ck = straight / "checkpoints" / "iter_000004"
    names = {p.name for p in ck.iterdir()}
    assert {"policy.safetensors", "optim_policy.pt", "state.json", "COMPLETE"} <= names
    assert not {n for n in names if "critic" in n}, names  # no critic weights, no critic optimizer
    for name in ("policy", "reference"):
        wa, wb = (
            load_file(ck / f"{name}.safetensors"),
            load_file(split / ck.relative_to(straight) / f"{name}.safetensors"),
        )
        assert all(bool((wa[k] == wb[k]).all()) for k in wa), name
    w0 = load_file(straight / "checkpoints" / "iter_000004" / "reference.safetensors")
    w4 = load_file(ck / "policy.safetensors")
    assert any(not bool((w0[k] == w4[k]).all()) for k in w0)  # the policy moved


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (["ppo.advantage=grpo"], "ppo.advantage=grpo needs rollout.group_size >= 2"),
        (["ppo.advantage=rloo", "rollout.group_size=3"], "is not a multiple of rollout.group_size=3"),
        (["ppo.advantage=reinforce++", "optimizer.critic_lr=1e-3"], "optimizer.critic_lr is set but"),
        (["ppo.advantage=dr-grpo", "rollout.group_size=2", "model.critic_init=reward", "task.reward=model"],
         "model.critic_init='reward' is set but ppo.advantage=dr-grpo has no critic"),
        (["ppo.advantage=opo"], "ppo.advantage=opo needs rollout.group_size >= 2"),
        # a batch baseline (flash-reinforce's mean, gpg's α) over a minibatch's dump is not the trainer's
        (["ppo.advantage=flash-reinforce", "ppo.whiten_advantages=none", "ppo.minibatches=2",
          "run.dump_iteration=1", "run.iterations=1"],
         "run.dump_iteration needs ppo.minibatches=1 (got 2) with ppo.advantage=flash-reinforce"),
        (["ppo.advantage=gpg", *GROUPED, "ppo.whiten_advantages=none", "ppo.minibatches=2",
          "run.dump_iteration=1", "run.iterations=1"],
         "run.dump_iteration needs ppo.minibatches=1 (got 2) with ppo.advantage=gpg"),
        # only grpo's and grpo-passk's σ read the std level: elsewhere it would be silently ignored
        (["ppo.group_std_level=batch"], "ppo.group_std_level=batch is set but ppo.advantage=gae"),
        (["ppo.advantage=dr-grpo", *GROUPED, "ppo.group_std_level=batch-centred"],
         "ppo.group_std_level=batch-centred is set but ppo.advantage=dr-grpo takes no group std"),
        (["ppo.advantage=rloo", *GROUPED, "ppo.group_std_level=batch"],
         "ppo.group_std_level=batch is set but ppo.advantage=rloo takes no group std"),
        (["ppo.advantage=gpg", *GROUPED, "ppo.group_std_level=batch"],
         "ppo.group_std_level=batch is set but ppo.advantage=gpg takes no group std"),
    ],
)  # fmt: skip
def test_bad_group_configs_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sets: list[str], needle: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)):
        preset("test", *sets)
    argv = ["--out", str(tmp_path)]
    for s in sets:
        argv += ["--set", s]
    assert train_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_groups_split_over_ranks_are_refused() -> None:
    """torchrun: every rank holds whole groups (the per-rank batch is a multiple of the group size)."""
    cfg = preset("test", *GROUPED, "ppo.advantage=grpo")
    cfg.check_world_size(2)  # 8 rows / 2 ranks = 4 = one group each
    with pytest.raises(ConfigError, match=r"4 responses per rank is not a multiple of rollout\.group_size=8"):
        preset("test", "task.reward=rule", "ppo.advantage=grpo", "rollout.group_size=8").check_world_size(2)


def test_verify_reward_reads_the_prompt() -> None:
    p = "review : the plot was"
    assert verify_reward(p, "good fun plot <eos> bad bad bad") == 1.0  # words after <eos> ignored
    assert verify_reward(p, "good fun film") == 0.5  # positive, another subject
    assert verify_reward(p, "bad plot") == 0.5  # the subject, negative
    assert verify_reward(p, "good bad plot") == 0.5  # a tie is not positive
    assert verify_reward("review : a song", "good plot") == 0.5
    assert verify_reward("review : a song", "awful") == 0.0


def test_grpo_demo_learns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`refppo demo --grpo` meets the PPO demo's bar (exit 0: the hidden-rule score rises by at
    least ``MIN_RULE_GAIN``, first → last 3 iterations) and its verifiable reward rises too.
    Measured: reward +0.268 → +0.474, hidden rule +0.063 → +0.310 (30 iterations, seed 0)."""
    from refppo.train.demo import MIN_RULE_GAIN, main, summarize

    out = tmp_path / "demo"
    assert main(["--grpo", "--out", str(out), "--set", "run.progress=false", "--set", "run.plot=false"]) == 0
    s = summarize(read_metrics(out / "metrics.jsonl"))
    assert s["rule_last"] - s["rule_first"] >= MIN_RULE_GAIN
    assert s["reward_last"] - s["reward_first"] >= MIN_RULE_GAIN
    assert not (out / "checkpoints" / "iter_000030" / "critic.safetensors").exists()
    assert "GRPO (no critic)" in capsys.readouterr().out


@pytest.mark.parametrize("adv", ["grpo", "rloo"])
def test_critic_free_dump_iteration_matches_the_oracle(tmp_path: Path, adv: str) -> None:
    """`run.dump_iteration` on a critic-free run: a dump without any value quantity, with
    ``group_index``, that `refppo diff` matches under the critic-free convention; control: a
    group reassignment (rows of two prompts swapped) mismatches the advantages."""
    import contextlib
    import io
    import json

    from safetensors.torch import load_file, save_file

    from refppo.oracle.cli import main as refppo_diff

    extra = (*GROUPED, f"ppo.advantage={adv}", "ppo.whiten_advantages=none", "ppo.minibatches=1")
    Trainer(preset("test", *extra, "run.dump_iteration=2", f"run.out_dir={tmp_path}")).train()
    path = tmp_path / "dumps" / "iter_000002.safetensors"
    d = load_file(str(path))
    assert not {"old_values", "values", "grad_values", "vf_loss"} & set(d)
    assert sorted(d["group_index"].tolist()) == [0] * 4 + [1] * 4  # every row of the step, both prompts

    def diff(p: Path) -> tuple[int, dict[str, Any]]:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = refppo_diff([str(p), "--json"])
        return code, json.loads(buf.getvalue())

    code, rep = diff(path)
    assert code == 0, rep
    assert {"advantages", "grad_logprobs", "loss"} <= set(rep["quantities"])
    gi = d["group_index"].clone()
    i, j = int((gi == 0).nonzero()[0]), int((gi == 1).nonzero()[0])
    gi[i], gi[j] = 1, 0  # one row of each prompt moved to the other group
    bad = tmp_path / "bad.safetensors"
    save_file(dict(d, group_index=gi), str(bad))
    Path(f"{bad}.json").write_text(Path(f"{path}.json").read_text())
    code, rep = diff(bad)
    assert code == 1 and not rep["quantities"]["advantages"]["ok"]


@pytest.mark.parametrize("advantage", ["grpo", "grpo-passk"])
@pytest.mark.parametrize("level", ["batch", "batch-centred"])
def test_group_std_level_is_accepted_where_the_estimator_reads_it(advantage: str, level: str) -> None:
    cfg = preset("test", f"ppo.advantage={advantage}", *GROUPED, f"ppo.group_std_level={level}")
    assert cfg.ppo.convention.adv.group_std_level.value == level
