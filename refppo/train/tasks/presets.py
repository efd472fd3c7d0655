"""Named config presets for the embedded task (``--set`` overrides on top of the defaults).

* :data:`DEMO` — what ``make demo`` runs: learns visibly within a few minutes on 2 CPU cores.
* :data:`DEMO_GRPO` — the same, critic-free (GRPO, groups of 8) against a verifiable reward.
* :data:`TEST` — the smallest run that exercises every part (seconds; used by the test suite).
"""

from __future__ import annotations

from refppo.train.config.schema import TrainConfig

DEMO: tuple[str, ...] = (
    "model.policy=tiny_gpt2",
    "model.n_embd=64",
    "model.n_layer=2",
    "model.n_head=4",
    "model.n_positions=32",
    "model.threads=1",  # tiny models: intra-op threads only add contention
    "task.reward=model",
    "task.sft_steps=150",
    "task.rm_steps=150",
    "task.rm_pairs=2048",
    "rollout.batch_size=64",
    "rollout.max_new_tokens=12",
    "ppo.epochs=4",
    "ppo.minibatches=4",
    "optimizer.lr=3e-4",
    "ppo.kl_coef=0.1",
    "run.iterations=30",
    "run.sample_every=10",
)

DEMO_GRPO: tuple[str, ...] = (
    *DEMO,
    "task.reward=refppo.train.tasks.words:verify_reward",  # verifiable: no reward model is trained
    "ppo.advantage=grpo",
    "rollout.group_size=8",  # 64 responses = 8 prompts × 8
    "ppo.whiten_advantages=none",  # GRPO's group normalisation is the only one (verl, OpenRLHF)
)
"""``refppo demo --grpo``: the DEMO run, critic-free, against
:func:`refppo.train.tasks.words.verify_reward`."""

TEST: tuple[str, ...] = (
    "model.policy=tiny_gpt2",
    "model.n_embd=32",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_positions=24",
    "model.threads=1",
    "model.device=cpu",
    "task.sft_steps=5",
    "task.sft_batch_size=8",
    "task.rm_steps=5",
    "task.rm_pairs=32",
    "task.rm_batch_size=16",
    "rollout.batch_size=8",
    "rollout.max_new_tokens=6",
    "ppo.epochs=2",
    "ppo.minibatches=2",
    "ppo.micro_batches=2",
    "run.iterations=2",
    "run.sample_every=0",
    "run.progress=false",
    "run.plot=false",
)


def preset(name: str, *more: str) -> TrainConfig:
    """``TrainConfig`` defaults + the preset ``name`` (``demo``/``demo-grpo``/``test``) + ``more``."""
    base = {"demo": DEMO, "demo-grpo": DEMO_GRPO, "test": TEST}[name]
    return TrainConfig().with_overrides([*base, *more])
