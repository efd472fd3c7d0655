"""``iteration`` without a critic: the rollout step gets ``old_values=None``, never zeros.

``score_rollout`` keeps a zero stand-in for the values of a critic-free rollout; before, the
iteration handed those zeros to ``rollout_quantities`` as if they were a critic's values, so a
``gae`` convention with no critic silently ran GAE on V = 0, and the rollout metrics logged a
``value_mean`` of 0 that no model computed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from refppo.errors import ConventionError
from refppo.models.batch import left_pad
from refppo.models.roles import make_reference
from refppo.models.rollout import RolloutConfig
from refppo.models.tiny import tiny_actor
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import rollout_quantities
from refppo.train import iteration as m_iteration
from refppo.train.iteration import iteration
from refppo.train.update_config import PPOUpdateConfig

VOCAB = 32
PROMPTS = [[1, 5, 6], [1, 7, 8, 9], [1, 5, 6], [1, 7, 8, 9]]
GROUPS = torch.tensor([0, 1, 0, 1])


def _kw(conv: Convention) -> dict[str, Any]:
    return {
        "rollout_cfg": RolloutConfig(max_new_tokens=4),
        "update_cfg": PPOUpdateConfig(ppo_epochs=1, num_minibatches=1),
        "hp": Hyperparams(kl_coef=0.05),
        "conv": conv,
        "generator": torch.Generator().manual_seed(0),
        "group_index": GROUPS,
    }


def _run(conv: Convention) -> dict[str, float]:
    actor = tiny_actor("gpt2", VOCAB, seed=0, hidden=32)
    ref = make_reference(actor)
    pids, pm = left_pad(PROMPTS, 0)
    opt = torch.optim.SGD(actor.parameters(), lr=1e-3)
    reward = lambda p, r: float(sum(r) % 5) / 5.0  # noqa: E731
    return iteration(actor, ref, None, reward, opt, None, pids, pm, **_kw(conv)).metrics


def test_critic_free_iteration_passes_no_values(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[object] = []
    real = rollout_quantities

    def spy(**kw: Any) -> Any:
        seen.append(kw["old_values"])
        return real(**kw)

    monkeypatch.setattr(m_iteration, "rollout_quantities", spy)
    metrics = _run(Convention.of(advantage="grpo", whiten_advantages="none"))  # type: ignore[arg-type]  # parsed
    assert seen == [None]
    assert "value_mean" not in metrics  # no critic, no value statistic
    assert {"advantage_mean", "return_mean", "pg_loss"} <= set(metrics)


def test_gae_without_a_critic_is_refused_not_run_on_zero_values() -> None:
    with pytest.raises(ConventionError, match="advantage=gae needs old_values"):
        _run(Convention())
