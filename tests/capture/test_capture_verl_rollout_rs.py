"""The verl adapter maps ``algorithm.rollout_correction.rollout_rs`` to the gate keys with
``rollout_rs_effect=drop_mask`` (verl 0.9.1 ``rollout_corr_helper.py::compute_rollout_rejection_mask``;
checked against verl's own code in ``tests/peers/test_peer_verl_rollout_rs.py``) and refuses, with one
line, what has no key."""

from __future__ import annotations

from typing import Any

import pytest

from refppo.capture.adapters.verl import verl_correction, verl_hparams


def _gate(level: str, stat: str, low: float | None, high: float, reduce: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"rollout_rs": level, "rollout_rs_stat": stat, "rollout_rs_order": "behaviour"}
    if reduce is not None:
        out["rollout_rs_reduce"] = reduce
    return {**out, "rollout_rs_low": low, "rollout_rs_high": high, "rollout_rs_effect": "drop_mask"}


@pytest.mark.parametrize(
    ("option", "threshold", "want"),
    [
        ("token_k1", "0.5_2.0", _gate("token", "ratio", 0.5, 2.0)),
        ("token_k1", 4.0, _gate("token", "ratio", 0.25, 4.0)),  # one value u: [1/u, u]
        ("token_k3", 0.2, _gate("token", "k3", None, 0.2)),
        ("seq_sum_k1", "0.8_1.25", _gate("sequence", "ratio", 0.8, 1.25, "sum")),
        ("seq_mean_k2", 0.1, _gate("sequence", "k2", None, 0.1, "mean")),
        ("seq_max_k3", 0.3, _gate("sequence", "k3", None, 0.3, "max")),
    ],
)
def test_rollout_rs_becomes_the_gate_keys_with_drop_mask(
    option: str, threshold: Any, want: dict[str, Any]
) -> None:
    assert verl_correction({"rollout_rs": option, "rollout_rs_threshold": threshold}) == want
    both = verl_correction({"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": option,
                            "rollout_rs_threshold": threshold})  # fmt: skip
    assert both == {"rollout_is": "token", "rollout_is_mode": "truncate", "rollout_is_low": None,
                    "rollout_is_high": 2.0, **want}  # fmt: skip


@pytest.mark.parametrize(
    ("cfg", "line"),
    [
        (
            {"rollout_rs": "token_k1,seq_max_k2", "rollout_rs_threshold": 2.0},
            r"rollout_rs='token_k1,seq_max_k2'",
        ),
        ({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": 2.0}, r"rollout_rs='seq_max_k1' has no refppo"),
        ({"rollout_rs": "token_k2"}, r"rollout_rs_threshold: required with rollout_rs='token_k2'"),
        ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.1_0.2"}, r"token_k2 takes one upper bound"),
        ({"rollout_rs": "token_k1", "rollout_rs_threshold": "a_b"}, r"expected a number or 'LOW_HIGH'"),
    ],
)
def test_what_has_no_key_is_refused_with_one_line(cfg: dict[str, Any], line: str) -> None:
    with pytest.raises(ValueError, match=line) as e:
        verl_correction(cfg)
    assert "\n" not in str(e.value) and str(e.value).startswith("verl config: rollout_correction.")


def test_verl_hparams_carry_the_gate() -> None:
    cfg = {"algorithm": {"rollout_correction": {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.15}}}
    assert verl_hparams(cfg)[1]["rollout_rs_effect"] == "drop_mask"
