"""Tests for the pipeline survivors of ``tools/mutate.py`` on this batch's changes (issue #23): the
rejection gate (refppo/pipeline/correction.py ``gate_keep``, ``gate_statistic_of``; groups_gate.py),
``score_slot_kl`` and ``gae_bootstrap`` (rollout.py). Expected values are worked out by hand in the
comments, never taken from the code under test.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from refppo.errors import HyperparameterError
from refppo.pipeline.correction import gate_statistic_of
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.stages import BY_NAME

F64 = torch.float64
RC = BY_NAME["rollout_correction"]

# Three rows, T = 3; d = l^prox − l^beh = [0.2, −0.4, ·], [0.1, 0.3, −0.2], [0.5, 0.5, ·] (· padding).
# order=behaviour reads x = −d: [−0.2, 0.4], [−0.1, −0.3, 0.2], [−0.5, −0.5]; k1 is x itself, so the
# row sums are S = 0.2, −0.2, −1.0 and the row means 0.1, −0.2/3, −0.5.
_MASK = torch.tensor([[True, True, False], [True, True, True], [True, True, False]])
_D = torch.tensor([[0.2, -0.4, 0.0], [0.1, 0.3, -0.2], [0.5, 0.5, 0.0]], dtype=F64)
_PROX = torch.full((3, 3), -1.0, dtype=F64)
_Q = {"old_logprobs": _PROX, "rollout_logprobs": torch.where(_MASK, _PROX - _D, 9.0), "mask": _MASK}
_SEQ_K1 = {
    "rollout_rs": "sequence",
    "rollout_rs_stat": "k1",
    "rollout_rs_order": "behaviour",
    "rollout_rs_reduce": "sum",
}


def test_gate_statistic_of_reads_every_gate_setting() -> None:
    # the row sum S_b of x = −d on each valid token, 0 on padding (spec: the statistic --detect solves on)
    conv = Convention.of(**_SEQ_K1, rollout_rs_high=1.0)
    want = torch.tensor([[0.2, 0.2, 0.0], [-0.2, -0.2, -0.2], [-1.0, -1.0, 0.0]], dtype=F64)
    torch.testing.assert_close(gate_statistic_of(_Q, conv), want, rtol=0.0, atol=1e-15)


@pytest.mark.parametrize(
    ("band", "want_rows"),
    [
        ({"rollout_rs_low": -0.25, "rollout_rs_high": 0.15}, (False, True, False)),  # S ∈ [−0.25, 0.15]
        ({"rollout_rs_low": -0.25}, (True, True, False)),  # S ≥ −0.25: only row 2 (−1.0) out
        ({"rollout_rs_high": 0.15}, (False, True, True)),  # S ≤ 0.15: only row 0 (0.2) out
    ],
)
def test_sequence_gate_keeps_whole_rows_by_the_band(
    band: dict[str, Any], want_rows: tuple[bool, ...]
) -> None:
    # a sequence gate keeps or rejects a row whole; a token gate, the mean or the proximal order
    # would keep row 0's first token (x = −0.2), row 0 (mean 0.1) or row 0 (S = −0.2) instead
    out = RC.run(_Q, Convention.of(**_SEQ_K1, **band), Hyperparams())
    want = _MASK & torch.tensor(want_rows).unsqueeze(1)
    assert torch.equal(out["is_keep"], want)
    assert torch.equal(out["is_weights"], torch.where(want, 1.0, 0.0).to(F64))


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"rollout_rs_high": True}, "rollout_rs_high: expected a finite number or none, got True"),
        ({"rollout_rs_low": "0.5"}, "rollout_rs_low: expected a finite number or none, got '0.5'"),
        ({"rollout_rs_high": float("inf")}, "rollout_rs_high: expected a finite number or none, got inf"),
        ({"rollout_rs_low": -0.5}, "rollout_rs_low: expected a ratio bound >= 0, got -0.5"),
        ({"rollout_rs_low": 2.0, "rollout_rs_high": 1.0}, "expected low <= high, got 2.0 > 1.0"),
    ],
)
def test_gate_settings_refused(keys: dict[str, Any], message: str) -> None:
    # RolloutGate.__post_init__: each bound a finite number (not a bool), a ratio's >= 0, low <= high
    with pytest.raises(HyperparameterError, match=re.escape(message)):
        Convention.of(rollout_rs="token", **keys)


@pytest.mark.parametrize(
    "keys",
    [
        {"rollout_rs_low": 0.0},  # a ratio bound of 0 is allowed (>= 0)
        {"rollout_rs_low": 0.5, "rollout_rs_high": 0.5},  # low == high: a one-point band
        {"rollout_rs_low": 0.5, "rollout_rs_high": 2.0},
        {"rollout_rs_high": 2.0},  # one bound only
        {"rollout_rs_low": 0.5},
        {"rollout_rs_stat": "k1", "rollout_rs_low": -0.5, "rollout_rs_high": -0.1},  # k1 bounds may be < 0
    ],
)
def test_gate_settings_accepted(keys: dict[str, Any]) -> None:
    gate = Convention.of(rollout_rs="token", **keys).gate
    assert (gate.low, gate.high) == (keys.get("rollout_rs_low"), keys.get("rollout_rs_high"))


def _slot_q(ref: torch.Tensor | None) -> dict[str, Any]:
    # one row, T = 3, two valid tokens; score_at=after_last_valid puts the score (1.0) at t = 2, which
    # the value mask holds too; d = l^old − l^ref = [0.5, −0.6, 0.1]
    base = torch.full((1, 3), -1.0, dtype=F64)
    return {
        "mapped_scores": torch.tensor([1.0], dtype=F64),
        "mask": torch.tensor([[True, True, False]]),
        "value_mask": torch.tensor([[True, True, True]]),
        "old_logprobs": base + torch.tensor([[0.5, -0.6, 0.1]], dtype=F64),
        "ref_logprobs": ref,
        "kl": None,
    }


@pytest.mark.parametrize("naive", [False, True])
def test_slot_kl_reads_the_kl_clamps(naive: bool) -> None:
    # score_slot_kl=kl recomputes k1 over the value mask with conv.kl's clamps: d clamped below at
    # −0.25 → [0.5, −0.25, 0.1], the value clamped to [−0.3, 0.3] → [0.3, −0.25, 0.1]; β = 0.5:
    # r = [−0.15, 0.125, 1 − 0.05] (either clamp dropped: −0.3 or 0.5 on a token instead)
    conv = Convention.of(
        score_at="after_last_valid", score_slot_kl="kl", kl_estimator="k1",
        kl_log_ratio_clamp=(-0.25, None), kl_value_clamp=0.3,
    )  # fmt: skip
    out = BY_NAME["rewards"].run(
        _slot_q(torch.full((1, 3), -1.0, dtype=F64)), conv, Hyperparams(kl_coef=0.5), naive=naive
    )
    want = torch.tensor([[-0.15, 0.125, 0.95]], dtype=F64)
    torch.testing.assert_close(out["token_rewards_raw"], want, rtol=0.0, atol=1e-15)


def test_slot_kl_at_zero_beta_reads_no_reference() -> None:
    # β = 0: no KL term (slot_kl_on needs β > 0), so no reference log-probs are read: r = [0, 0, 1]
    conv = Convention.of(score_at="after_last_valid", score_slot_kl="kl")
    out = BY_NAME["rewards"].run(_slot_q(None), conv, Hyperparams(kl_coef=0.0))
    assert torch.equal(out["token_rewards_raw"], torch.tensor([[0.0, 0.0, 1.0]], dtype=F64))
