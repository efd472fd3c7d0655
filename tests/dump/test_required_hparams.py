"""Issue #23 item 4: a hyperparameter is required only where a stage reads it under the setting.

A critic-free sidecar without a preset need not carry ``gamma``, ``lam``, ``cliprange_value`` or
``vf_coef`` (no stage of a group estimator reads them); the value loss's ``cliprange_value`` and the
total's ``vf_coef`` are required with a critic (``advantage=gae``, or a critic-free dump that holds a
critic's ``values`` and ``old_values``). A missing one is one line naming it, the stage and the setting.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from refppo.errors import HyperparameterError
from refppo.oracle.check.settings import build_setup
from refppo.oracle.run import check_step


def _grpo_dump() -> dict[str, torch.Tensor]:
    """A critic-free step without a critic: GRPO advantages by hand, (s − mean)/(std + 1e-6) per group."""
    mask = torch.ones(4, 3, dtype=torch.float64)
    mask[1, 2] = 0
    old = -torch.linspace(0.1, 2.0, 12, dtype=torch.float64).reshape(4, 3)
    s = torch.tensor([1.0, 0.0, 0.5, 0.25], dtype=torch.float64)
    g = torch.tensor([0, 0, 1, 1])
    adv = torch.zeros(4, 3, dtype=torch.float64)
    for grp in (0, 1):
        rows = (g == grp).nonzero().flatten()
        adv[rows] = ((s[rows] - s[rows].mean()) / (s[rows].std() + 1e-6))[:, None] * mask[rows]
    return {"response_mask": mask, "old_logprobs": old, "scores": s, "group_index": g, "advantages": adv}


GRPO = {"advantage": "grpo", "whiten_advantages": "none"}


def test_a_critic_free_sidecar_needs_only_kl_coef_and_cliprange() -> None:
    out = check_step(_grpo_dump(), overrides=GRPO, hparams={"kl_coef": 0.0, "cliprange": 0.2})
    assert out.passed and "advantages" in out.result.quantities


def test_a_critic_free_sidecar_still_needs_what_the_policy_reads() -> None:
    with pytest.raises(HyperparameterError) as exc:
        check_step(_grpo_dump(), overrides=GRPO, hparams={"kl_coef": 0.0})
    msg = str(exc.value)
    assert "\n" not in msg
    head = "missing hyperparameters ['cliprange'] (missing required hyperparameter 'cliprange'"
    assert msg.startswith(head)
    assert "read by the policy stage under policy_loss=" in msg


def test_a_critic_free_dump_with_a_critics_values_needs_the_value_loss_hyperparameters() -> None:
    t = _grpo_dump()
    t["old_values"] = torch.zeros(4, 3, dtype=torch.float64)
    t["values"] = torch.full((4, 3), 0.5, dtype=torch.float64)
    with pytest.raises(HyperparameterError) as exc:
        check_step(t, overrides=GRPO, hparams={"kl_coef": 0.0, "cliprange": 0.2})
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("missing hyperparameters ['cliprange_value', 'vf_coef']")
    assert "'cliprange_value': read by the value stage under a value loss" in msg
    assert "'vf_coef': read by the total stage under a value loss" in msg


POLICY = {"kl_coef": 0.1, "cliprange": 0.2}


def _setup(sidecar: dict[str, Any], **conv: Any) -> Any:
    return build_setup(preset_conv=None, preset_hp=None, sidecar=sidecar, overrides=conv)


@pytest.mark.parametrize(
    ("conv", "given", "missing"),
    [
        ({}, {**POLICY, "gamma": 1.0, "lam": 0.9, "cliprange_value": 0.2}, ["vf_coef"]),
        ({}, {**POLICY, "gamma": 1.0, "vf_coef": 0.1}, ["lam", "cliprange_value"]),
        ({"value_loss": "unclipped"}, {**POLICY, "gamma": 1.0, "lam": 0.9, "vf_coef": 1.0}, []),
        ({"advantage": "reinforce++"}, {"kl_coef": 0.1, "cliprange": 0.2}, ["gamma"]),
        ({"advantage": "rloo"}, {"kl_coef": 0.1, "cliprange": 0.2}, []),
    ],
)
def test_the_required_hyperparameters_follow_the_stage_table(
    conv: dict[str, Any], given: dict[str, float], missing: list[str]
) -> None:
    """GAE reads γ, λ, ε_v (clipped value loss only) and c1; REINFORCE++ γ only; RLOO none of them."""
    if not missing:
        assert _setup(given, **conv).hp.cliprange == 0.2
        return
    head = re.escape(f"missing hyperparameters {missing!r} (")
    with pytest.raises(HyperparameterError, match="^" + head) as exc:
        _setup(given, **conv)
    stage = {"gamma": "advantages", "lam": "advantages", "cliprange_value": "value", "vf_coef": "total"}
    for k in missing:
        assert f"missing required hyperparameter {k!r}: read by the {stage[k]} stage under" in str(exc.value)
