"""``--detect`` walks the rejection gates ``rollout_rs*`` and solves their thresholds (issue #22 item 2).

Dumps come from the naive twins (``oracle_helpers.naive_dump``: the gate by
``rejection_mask_naive`` multiplied into the weight token by token) with behaviour log-probs
``l^prox − noise``. ``--detect`` starts from refppo's defaults (no gate): the generating gate must
be listed (a gated entry, never the bare step) with a threshold solved from ``pg_loss`` inside the
interval of the generating one that keeps the same tokens (the data fix no more than that).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from oracle_helpers import make_inputs, naive_dump, save, setup_for, with_behaviour

from refppo.core.rollout_correction import gate_statistic
from refppo.dump.load import load_dump
from refppo.oracle.detect.detection import detect

CASES: dict[str, dict[str, Any]] = {
    "verl-seq-mean-k3": {
        "rollout_rs": "sequence", "rollout_rs_stat": "k3", "rollout_rs_order": "behaviour",
        "rollout_rs_reduce": "mean", "rollout_rs_high": 0.07,
    },
    "areal-token-k2-on-raw-ratio": {
        "rollout_is": "token", "rollout_rs": "token", "rollout_rs_stat": "k2", "rollout_rs_high": 0.3,
    },
}  # fmt: skip
"""The dumps' gates (verl's ``seq_mean_k3``; AReaL's ``kl_k2`` token gate on the raw ratio)."""


def _equivalent_interval(x: dict[str, torch.Tensor], conv: dict[str, Any]) -> tuple[float, float]:
    """``[s_(k), s_(k+1))``: the observed statistics around the generating threshold; every upper
    threshold in it keeps the same tokens (the data cannot tell them apart)."""
    m = x["response_mask"].bool()
    u = gate_statistic(
        x["old_logprobs"], x["rollout_logprobs"], m, stat=conv["rollout_rs_stat"],
        order=conv.get("rollout_rs_order", "proximal"), level=conv["rollout_rs"],
        reduce=conv.get("rollout_rs_reduce", "mean"),
    )[m]  # fmt: skip
    h = conv["rollout_rs_high"]
    return float(u[u <= h].max()), float(u[u > h].min())


@pytest.mark.parametrize("case", list(CASES))
def test_the_generating_gate_is_listed_and_its_threshold_solved(tmp_path: Path, case: str) -> None:
    conv = CASES[case]
    x = with_behaviour(make_inputs(B=8, T=12, seed=5))
    path = save(tmp_path, naive_dump(x, setup_for(None, conv)), setup_for(None, {}))
    found = detect(load_dump(path), setup_for(None, {}))
    assert found.detected, (found.unmatched_stages, found.nearest)
    assert any(e.get("rollout_rs") is not None for e in found.detected)
    assert not any(e.get("rollout_rs") is None and e.get("rollout_is") is None for e in found.detected)
    lo, hi = _equivalent_interval(x, conv)
    assert any(lo <= v < hi for v in found.solved.get("rollout_rs_high", [])), (lo, hi, found.solved)


def test_a_gate_changes_the_dump() -> None:
    """The cases' gates reject some tokens and keep others: the dumps differ from the ungated step's."""
    x = with_behaviour(make_inputs(B=8, T=12, seed=5))
    for conv in CASES.values():
        off = {k: v for k, v in conv.items() if not k.startswith("rollout_rs")}
        a = naive_dump(x, setup_for(None, conv))["pg_loss"]
        b = naive_dump(x, setup_for(None, off))["pg_loss"]
        assert not torch.allclose(a, b)
        lo, hi = _equivalent_interval(x, conv)
        assert lo < hi
