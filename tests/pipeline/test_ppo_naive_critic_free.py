"""The naive rollout twin (:func:`refppo.pipeline.step.rollout_quantities_naive`, loops over floats) under
every critic-free estimator it supports, against :func:`refppo.pipeline.step.rollout_quantities`.

Before, the twin refused every estimator but grpo, dr-grpo and rloo.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from oracle_helpers import make_inputs

from refppo.conventions import AdvantageEstimator
from refppo.core._group_checks import GROUP_ESTIMATORS
from refppo.errors import ConventionError
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import rollout_quantities, rollout_quantities_naive

F64 = torch.float64
GROUPS = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2])
ESTIMATORS = [e.value for e in (*GROUP_ESTIMATORS, AdvantageEstimator.FLASH_REINFORCE)]


def _both(conv: Convention, group_index: torch.Tensor | None) -> tuple[Any, Any]:
    x = make_inputs(B=8, T=9, seed=13)
    mask = x["response_mask"].bool()
    kw: dict[str, Any] = dict(
        scores=x["scores"], old_logprobs=x["old_logprobs"], ref_logprobs=x["ref_logprobs"], mask=mask,
        hp=Hyperparams(kl_coef=0.1), conv=conv, group_index=group_index,
    )  # fmt: skip
    got = rollout_quantities(old_values=None, **kw)
    naive = rollout_quantities_naive(old_values=torch.zeros_like(x["old_logprobs"]), **kw)
    return got, naive


@pytest.mark.parametrize("whiten", ["none", "masked"])
@pytest.mark.parametrize("est", ESTIMATORS)
def test_naive_twin_matches_the_pipeline_for_every_critic_free_estimator(est: str, whiten: str) -> None:
    conv = Convention.of(advantage=est, whiten_advantages=whiten)  # type: ignore[arg-type]  # parsed
    got, naive = _both(conv, GROUPS.clone())
    m = got.value_mask.bool() | naive.value_mask.bool()
    for name in ("token_rewards", "advantages", "returns"):
        a, b = getattr(got, name), getattr(naive, name)
        err = float(torch.where(m, a - b, torch.zeros((), dtype=F64)).abs().max())
        assert err <= 1e-12, (name, err)
    assert float(got.advantages.abs().max()) > 0


def test_flash_reinforce_needs_no_group_index() -> None:
    got, naive = _both(Convention.of(advantage="flash-reinforce", whiten_advantages="none"), None)  # type: ignore[arg-type]  # parsed
    assert float((got.advantages - naive.advantages).abs().max()) <= 1e-12


def test_group_estimators_still_need_a_group_index() -> None:
    with pytest.raises(ConventionError, match="group_index"):
        _both(Convention.of(advantage="opo"), None)  # type: ignore[arg-type]  # parsed
