"""--resume of a run whose checkpoints an older refppo wrote (one without config keys added since).

The older checkpoint is made faithfully: a short run, then every config key added since the
previous release, commit 61be225 (``ppo.group_std_level``, ``ppo.score_bias/score_scale/score_clip``:
:data:`ADDED`, derived from that release's pinned key list) is removed from each checkpoint's saved
config, from ``config.json`` and the hashes are recomputed as the older refppo computed them
(:func:`refppo.train.rundir.config_hash` of the reduced config) in ``state.json`` and ``run.json``; the
``COMPLETE`` manifest gets the new file size. Such a run resumes (twice) to exactly the
uninterrupted run; an added key set to another value than its default, and a saved key this
refppo does not know, are each refused in one line naming them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from refppo.train import rundir
from refppo.train.checkpointing import RESUMABLE_KEYS
from refppo.train.config.schema import TrainConfig
from refppo.train.loop import Trainer
from refppo.train.runlog import deterministic, read_metrics
from refppo.train.runtime import TrainingError
from refppo.train.tasks.presets import preset

pytestmark = pytest.mark.e2e

N = 4
COMMON = (
    "run.iterations=4",
    "kl.adaptive=true",
    "kl.target=0.01",
    "kl.horizon=50",
    "rollout.temperature=0.9",
)
RELEASE_61BE225_KEYS: dict[str, list[str]] = {
    "model": [
        "critic_init",
        "device",
        "dtype",
        "n_embd",
        "n_head",
        "n_layer",
        "n_positions",
        "policy",
        "reward_model",
        "threads",
        "vocab_size",
    ],
    "task": [
        "add_special_tokens",
        "embedded_prompts",
        "name",
        "prompt_words",
        "prompts_file",
        "response_words",
        "reward",
        "reward_special_tokens",
        "rm_batch_size",
        "rm_lr",
        "rm_pairs",
        "rm_steps",
        "sft_batch_size",
        "sft_lr",
        "sft_steps",
    ],
    "rollout": [
        "batch_size",
        "group_size",
        "max_new_tokens",
        "max_prompt_tokens",
        "missing_eos_penalty",
        "temperature",
        "top_k",
        "top_p",
        "use_cache",
    ],
    "ppo": [
        "advantage",
        "cliprange",
        "cliprange_high",
        "cliprange_value",
        "dual_clip",
        "ent_coef",
        "entropy_agg",
        "epochs",
        "gae_holes",
        "gae_padding",
        "gamma",
        "group_eps",
        "group_kl",
        "group_singleton",
        "group_std",
        "horizon",
        "kl_coef",
        "kl_estimator",
        "kl_in",
        "kl_log_ratio_clamp",
        "kl_loss_agg",
        "kl_value_clamp",
        "lam",
        "log_ratio_clamp",
        "loss_agg",
        "max_grad_norm",
        "micro_batches",
        "minibatches",
        "policy_loss",
        "score_at",
        "value_clip_form",
        "value_loss",
        "value_loss_agg",
        "vf_coef",
        "whiten_advantages",
        "whiten_eps",
        "whiten_eps_at",
        "whiten_holes",
        "whiten_rewards",
        "whiten_variance",
    ],
    "optimizer": ["betas", "critic_lr", "eps", "lr", "weight_decay"],
    "kl": ["adaptive", "horizon", "target"],
    "run": [
        "checkpoint_every",
        "dump_iteration",
        "iterations",
        "on_nan",
        "out_dir",
        "plot",
        "progress",
        "sample_every",
        "seed",
        "tensorboard",
    ],
}
"""Every config key of the previous release, per section: data pinned from commit 61be225
(``git archive 61be225 refppo``, then ``TrainConfig().to_dict()`` of its ``refppo/train/config.py``;
``git show 61be225:refppo/train/config.py`` shows the dataclasses). Not derived from the code under test."""
ADDED = tuple(
    (section, key)
    for section, keys in TrainConfig().to_dict().items()
    for key in keys
    if key not in RELEASE_61BE225_KEYS.get(section, ())
)
"""The keys added since that release, which an older run's configs lack (measured at the time of
writing: ``ppo.group_std_level``, ``ppo.score_bias``, ``ppo.score_clip``, ``ppo.score_scale``)."""

Edit = Callable[[dict[str, Any]], None]


def _drop_added(config: dict[str, Any]) -> None:
    for section, key in ADDED:
        del config[section][key]
    for section in [s for s in config if s not in RELEASE_61BE225_KEYS]:  # a section added since
        del config[section]


def _rewrite_run(out: Path, edit: Edit) -> str:
    """Rewrite the run in ``out`` as if a refppo with the config keys that ``edit`` leaves had written
    it: every checkpoint's ``state.json`` (config, hash) and ``COMPLETE`` size, ``config.json`` and
    ``run.json``'s hash. Returns that hash."""
    ckpts = sorted((out / "checkpoints").glob("iter_*"))
    assert ckpts
    new_hash = None
    for path in ckpts:
        state = json.loads((path / "state.json").read_text())
        edit(state["config"])
        new_hash = rundir.config_hash(state["config"], RESUMABLE_KEYS)
        state["config_hash"] = new_hash
        text = json.dumps(
            state, indent=2, sort_keys=True
        )  # as refppo.train.checkpoint.save_checkpoint writes it
        (path / "state.json").write_text(text)
        manifest = json.loads((path / "COMPLETE").read_text())
        manifest["files"]["state.json"] = len(text.encode("utf-8"))
        (path / "COMPLETE").write_text(json.dumps(manifest) + "\n")
    assert new_hash is not None
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    ident = json.loads((out / "run.json").read_text())
    ident["config_hash"] = new_hash
    (out / "run.json").write_text(json.dumps(ident, indent=2) + "\n")
    return new_hash


def _older_run(out: Path, *sets: str) -> str:
    Trainer(preset("test", *sets, f"run.out_dir={out}")).train()
    return _rewrite_run(out, _drop_added)


def test_an_older_refppos_run_resumes_twice_to_the_uninterrupted_run(tmp_path: Path) -> None:
    straight, split = tmp_path / "straight", tmp_path / "split"
    Trainer(preset("test", *COMMON, f"run.out_dir={straight}")).train()
    old_hash = _older_run(split, *COMMON, f"run.iterations={N // 2}")
    assert old_hash != rundir.config_hash(preset("test", *COMMON).to_dict(), RESUMABLE_KEYS)

    first = Trainer(preset("test", *COMMON, f"run.out_dir={split}", f"run.iterations={N - 1}"), resume=True)
    assert first.start_iteration == N // 2
    first.train()
    # the checkpoint written after that resume is the run's: the older config and the older hash
    state = json.loads((split / "checkpoints" / f"iter_{N - 1:06d}" / "state.json").read_text())
    assert state["config_hash"] == old_hash == json.loads((split / "run.json").read_text())["config_hash"]
    assert ("ppo", "group_std_level") in ADDED
    assert not any(k in state["config"].get(sec, {}) for sec, k in ADDED)
    assert state["config"]["ppo"]["cliprange"] == 0.2  # the other keys are kept

    second = Trainer(preset("test", *COMMON, f"run.out_dir={split}"), resume=True)
    assert second.start_iteration == N - 1
    second.train()

    a = [deterministic(r) for r in read_metrics(straight / "metrics.jsonl")]
    b = [deterministic(r) for r in read_metrics(split / "metrics.jsonl")]
    assert [r["iteration"] for r in b] == list(range(1, N + 1))
    assert len({r["kl_coef"] for r in a}) > 1  # the adaptive controller moved, so its state mattered
    assert a == b
    for name in ("policy", "critic", "reference", "reward"):
        wa = load_file(straight / "checkpoints" / f"iter_{N:06d}" / f"{name}.safetensors")
        wb = load_file(split / "checkpoints" / f"iter_{N:06d}" / f"{name}.safetensors")
        assert wa.keys() == wb.keys()
        assert all(bool((wa[k] == wb[k]).all()) for k in wa), name


@pytest.fixture(scope="module")
def older_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("older") / "run"
    _older_run(out, "task.reward=rule", "run.iterations=1")
    return out


def _resume(out: Path, *more: str) -> Trainer:
    return Trainer(
        preset("test", f"run.out_dir={out}", "task.reward=rule", "run.iterations=2", *more), resume=True
    )


def test_an_added_key_at_its_default_resumes_and_one_set_otherwise_is_refused(older_run: Path) -> None:
    assert _resume(older_run, "ppo.score_clip=none").start_iteration == 1  # none: the default
    with pytest.raises(TrainingError) as info:
        _resume(older_run, "ppo.score_clip=2.0")
    line = str(info.value)
    assert "\n" not in line
    assert (
        "ppo.score_clip=2.0 is not in the checkpoint's config (written by an older refppo, which had no "
        "such key): resuming would change the run"
    ) in line
    with pytest.raises(TrainingError, match=r"ppo\.score_bias=0\.5, ppo\.score_scale=2\.0 are not in"):
        _resume(older_run, "ppo.score_bias=0.5", "ppo.score_scale=2.0")


def test_a_saved_key_this_refppo_does_not_know_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    Trainer(preset("test", f"run.out_dir={out}", "task.reward=rule", "run.iterations=1")).train()

    def add_unknown(config: dict[str, Any]) -> None:  # a newer refppo's key, at some value
        config["ppo"]["future_knob"] = 1.5

    _rewrite_run(out, add_unknown)
    with pytest.raises(TrainingError) as info:
        _resume(out)
    line = str(info.value)
    assert "\n" not in line
    assert "has ppo.future_knob, which this refppo does not know" in line
