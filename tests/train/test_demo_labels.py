"""The demo's summary labels the reward by ``task.reward``, not by the estimator: a critic-free
estimator on the demo's learned reward model used to print "verifiable" and drop the reward model
from the wall-time line."""

from __future__ import annotations

from refppo.train.demo import _reward_kind
from refppo.train.tasks.presets import preset


def test_reward_label_follows_task_reward() -> None:
    assert _reward_kind(preset("demo", "ppo.advantage=reinforce++")).startswith("learned RM")
    assert _reward_kind(preset("demo")).startswith("learned RM")
    grpo = preset("demo-grpo")
    assert grpo.task.reward != "model" and _reward_kind(grpo).startswith("verifiable")
