"""Dumps whose outputs come from the naive twins (``oracle_helpers.naive_dump``: token by token,
``refppo.pipeline.naive`` on the ``refppo.core.*_naive`` steps), not from the recompute the oracle
checks with: under every member of every convention enum (one key at a time off refppo's
defaults, on holed masks for the hole conventions, with groups for the critic-free estimators)
such a dump matches with every output compared, and the same dump mismatches when a key it
changes is checked at another value. The two conventions the naive twins lack
(``advantage=reinforce++``, ``group_kl=to_go``) are refused by the helper, never built another way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from oracle_helpers import make_inputs, naive_dump, naive_outputs, save, setup_for

from refppo.conventions import AdvantageEstimator
from refppo.dump.load import load_dump
from refppo.errors import ConventionError
from refppo.group_conventions import GroupKL
from refppo.oracle.check.diagnose import check
from refppo.pipeline.settings import enum_keys

LACKING = {("advantage", AdvantageEstimator.REINFORCE_PP.value), ("group_kl", GroupKL.TO_GO.value)}
"""(key, value) pairs with no naive twin (``refppo/pipeline/naive.py``'s supported subset)."""
REFUSED = {(k, "prompt-mean") for k in ("value_loss_agg", "kl_loss_agg", "kl_metric_agg")}
"""(key, value) pairs the Convention refuses (prompt-mean is the policy's and entropy's only)."""
ELSEWHERE = {
    ("truncated_rows", "mask_in_loss"),
    ("truncated_rows", "drop"),
    ("rollout_rs_effect", "drop_mask"),
}
"""(key, value) pairs this helper's token-by-token restatement does not take: rows out of the loss are
proven against their naive twin ``kept_rows_aggregate_naive`` and TRL's formulas in
``tests/core/test_kept_rows.py``, the update walk against the core in ``tests/pipeline/test_loss_rows.py``,
and through ``check()`` on a ``StepRecorder`` dump in ``tests/capture/test_capture_truncated_rows.py``;
the gate that rewrites the mask against a hand-worked truth table, verl's GAE loop and the naive walk
in ``tests/pipeline/test_rollout_rs_drop.py`` (and verl 0.9.1's own code in the peer test)."""
GROUP_KEYS = ("group_std", "group_std_level", "group_eps", "group_singleton", "group_kl")
HOLE_KEYS = ("gae_holes", "whiten_holes")


def _enum_cases() -> list[tuple[str, Any]]:
    """Every member of the enum of every enum-valued flat convention key (``X | None`` keys: their
    enum's members), the (key, value) pairs of :data:`LACKING` left out."""
    return [
        (key, m.value)
        for key, enum in enum_keys().items()
        for m in enum.__members__.values()
        if (key, m.value) not in LACKING | REFUSED | ELSEWHERE
    ]


OTHER_CASES: list[tuple[str, Any]] = [
    ("dual_clip", 3.0),
    ("log_ratio_clamp", 0.4),  # binds: |log ρ| reaches 0.9 with lp_noise=0.3
    ("kl_value_clamp", 0.05),
    ("kl_log_ratio_clamp", (-0.2, 0.2)),
    ("score_clip", 1.0),  # binds: scores ~ N(0, 9)
    ("score_bias", 0.5),
    ("score_scale", 2.0),
    ("group_eps", 1e-2),
]
CASES = _enum_cases() + OTHER_CASES


def holed(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tool-output holes at positions 2-3 of every row long enough (never its last valid token)."""
    m = x["response_mask"].bool()
    holes = torch.zeros_like(m)
    holes[:, 2:4] = True
    holes &= torch.arange(m.shape[1]) < m.sum(dim=1, keepdim=True) - 1
    return {**x, "response_mask": (m & ~holes).to(torch.uint8)}


def inputs_and_conv(key: str, value: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The inputs (seeded per case) and the convention keys of one case."""
    x = make_inputs(B=8, T=12, seed=len(key) + 7)
    conv: dict[str, Any] = {key: value}
    group = key in GROUP_KEYS or (key == "advantage" and value != "gae")
    if group:
        conv.setdefault("advantage", "grpo")
        x = {k: v for k, v in x.items() if k not in ("old_values", "values")}
        # a lone prompt (group 3) where the convention says what it gets, whole groups otherwise
        lone = key == "group_singleton" and value != "error"
        x["group_index"] = torch.tensor([0, 0, 1, 1, 1, 2, 2, 3 if lone else 2])
    if value == "prompt-mean":  # loss_agg / entropy_agg: the prompts, the value term another mode
        x["group_index"] = torch.tensor([4, 1, 4, 2, 1, 4, 2, 2])
        conv["value_loss_agg"] = "token-mean"
    if key in HOLE_KEYS:
        x = holed(x)
    if key.startswith("rollout_is"):  # the correction on, with the behaviour log-probs it reads
        g = torch.Generator().manual_seed(11)
        x["rollout_logprobs"] = x["old_logprobs"] + 0.4 * torch.randn(x["old_logprobs"].shape, generator=g)
        conv.setdefault("rollout_is", "sequence" if key == "rollout_is_agg" else "token")
        conv.update(rollout_is_low=0.7, rollout_is_high=1.5)  # both bind (|d| ~ 0.4)
    if key.startswith("rollout_rs"):  # a gate on (a sequence gate where the reduction is the key)
        g = torch.Generator().manual_seed(11)
        x["rollout_logprobs"] = x["old_logprobs"] + 0.4 * torch.randn(x["old_logprobs"].shape, generator=g)
        conv.setdefault("rollout_rs", "sequence" if key == "rollout_rs_reduce" else "token")
        high = 1.2 if conv.get("rollout_rs_stat", "ratio") == "ratio" else 0.1
        conv.update(rollout_rs_low=None, rollout_rs_high=high)
    if key == "gae_bootstrap":  # row 0 fills the frame (truncated); the others' values are not read
        x["bootstrap_values"] = torch.linspace(-1.5, 2.0, x["scores"].shape[0], dtype=torch.float64)
    return x, conv


@pytest.mark.parametrize(("key", "value"), CASES, ids=[f"{k}={v}" for k, v in CASES])
def test_a_naive_twin_dump_matches_under_its_convention(tmp_path: Path, key: str, value: Any) -> None:
    x, conv = inputs_and_conv(key, value)
    s = setup_for(None, conv)
    res = check(load_dump(save(tmp_path, naive_dump(x, s), s)), s)
    assert res.match, (key, value, res.diagnosis)
    assert set(res.quantities) == set(naive_outputs(x, s)), "an output was not compared"


def test_every_enum_member_is_a_case() -> None:
    """The grid follows the enums: a member added to one is a case here (or named in LACKING)."""
    keys = {k for k, _ in _enum_cases()}
    assert {"kl_estimator", "whiten_advantages", "loss_agg", "advantage", "gae_holes", "policy_loss"} <= keys
    assert ("advantage", "flash-reinforce") in CASES and ("loss_agg", "token-sum") in CASES
    assert ("approx_kl", "neg_k1") in CASES and ("vf_mask", "response") in CASES
    assert ("advantage", "reinforce++") not in CASES


@pytest.mark.parametrize(("key", "value"), sorted(REFUSED))
def test_the_convention_refuses_prompt_mean_off_the_policy(key: str, value: str) -> None:
    with pytest.raises(ConventionError, match=f"^{key}=prompt-mean is not supported"):
        setup_for(None, {key: value})


@pytest.mark.parametrize(("key", "value"), sorted(LACKING))
def test_the_helper_refuses_what_the_naive_twins_lack(key: str, value: str) -> None:
    x, conv = inputs_and_conv(key, value)
    with pytest.raises(ConventionError, match="critic-free supports"):
        naive_outputs(x, setup_for(None, conv))


MISMATCHES = [
    ({"whiten_advantages": "none"}, {}, "advantages"),
    ({"score_at": "after_last_valid"}, {}, "token_rewards"),
    ({"kl_estimator": "k3"}, {}, "kl"),
    ({"loss_agg": "seq-mean-token-mean"}, {}, "pg_loss"),
    ({"vf_mask": "response", "score_at": "after_last_valid"}, {"score_at": "after_last_valid"}, "vf_loss"),
    ({"advantage": "rloo"}, {"advantage": "grpo"}, "advantages"),
]


@pytest.mark.parametrize(("made", "checked", "first"), MISMATCHES)
def test_a_naive_twin_dump_mismatches_under_another_convention(
    tmp_path: Path, made: dict[str, Any], checked: dict[str, Any], first: str
) -> None:
    key, value = next(iter(made.items()))
    x, _ = inputs_and_conv(key, value)
    s_made, s_checked = setup_for(None, made), setup_for(None, checked)
    res = check(load_dump(save(tmp_path, naive_dump(x, s_made), s_made)), s_checked)
    assert not res.match and res.first_divergence == first, (res.first_divergence, res.diagnosis)
