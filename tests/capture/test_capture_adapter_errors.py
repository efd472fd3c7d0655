"""Bad peer containers and configs get one line naming the field (the adapters' correction configs,
TRL's group size), never a bare KeyError, an unpacking error or a silently short last group."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from refppo.capture.adapters.openrlhf import openrlhf_correction
from refppo.capture.adapters.trl_grpo import from_trl_grpo, trl_grpo_hparams
from refppo.capture.adapters.verl import verl_correction


def _trl_inputs() -> dict[str, Any]:
    mask = torch.ones(3, 2, dtype=torch.int64)
    return {
        "completion_mask": mask,
        "advantages": torch.tensor([0.5, -0.5, 1.0], dtype=torch.float64),
        "old_per_token_logps": torch.full((3, 2), -1.0, dtype=torch.float64),
        "num_items_in_batch": mask.sum(),
    }


@pytest.mark.parametrize("n", [0, 2])
def test_trl_group_size_must_divide_the_batch(n: int) -> None:
    """3 rows: 2 would leave a short last group, 0 a division by zero."""
    scores = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(
        ValueError, match=rf"num_generations={n}: expected an integer >= 1 dividing the batch's 3"
    ):
        from_trl_grpo(_trl_inputs(), scores=scores, num_generations=n)
    assert from_trl_grpo(_trl_inputs(), scores=scores, num_generations=3)["group_index"].tolist() == [0, 0, 0]


def test_trl_unknown_importance_sampling_mode_lists_the_valid_ones() -> None:
    cfg = types.SimpleNamespace(
        beta=0.0, epsilon=0.2, epsilon_high=0.2, scale_rewards=True, loss_type="grpo",
        max_completion_length=2, use_vllm=True, vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_clip",
    )  # fmt: skip
    with pytest.raises(
        ValueError, match=r"vllm_importance_sampling_mode='token_clip': expected one of \['token_t"
    ):
        trl_grpo_hparams(cfg)


def test_verl_threshold_that_is_not_a_pair_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"rollout_is_threshold='0\.5_x': expected a number or 'LOW_HIGH'"):
        verl_correction({"rollout_is": "token", "rollout_is_threshold": "0.5_x"})


def _openrlhf(**adv: Any) -> types.SimpleNamespace:
    return types.SimpleNamespace(algo=types.SimpleNamespace(advantage=types.SimpleNamespace(**adv)))


@pytest.mark.parametrize("thr", [None, [0.5], [0.5, "x"]])
def test_openrlhf_threshold_must_be_a_pair(thr: Any) -> None:
    on: dict[str, Any] = {"is_correction_level": "token", "is_correction_mode": "clip"}
    if thr is not None:
        on["is_correction_threshold"] = thr
    with pytest.raises(ValueError, match=r"is_correction_threshold=.*: expected a pair \[low, high\]"):
        openrlhf_correction(_openrlhf(**on))


def test_openrlhf_missing_mode_is_named() -> None:
    args = _openrlhf(is_correction_level="token", is_correction_threshold=[0.5, 2.0])
    with pytest.raises(ValueError, match="is_correction_mode=None: expected clip or mask"):
        openrlhf_correction(args)
