"""``--detect`` walks the rejection gates ``rollout_rs*`` and solves their thresholds (issue #22 item 2).

Dumps come from the naive twins (``oracle_helpers.naive_dump``: the gate by
``rejection_mask_naive`` multiplied into the weight token by token) with behaviour log-probs
``l^prox − noise``. ``--detect`` starts from refppo's defaults (no gate): the generating gate must
be listed with its threshold solved from ``pg_loss`` (none of them is a named value).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from oracle_helpers import make_inputs, naive_dump, save, setup_for, with_behaviour

from refppo.dump.load import load_dump
from refppo.oracle.detect.detection import detect

KEYS = ("rollout_is", "rollout_rs", "rollout_rs_stat", "rollout_rs_order", "rollout_rs_reduce")


def _detected(tmp: Path, conv: dict[str, Any]) -> Any:
    x = with_behaviour(make_inputs(B=8, T=12, seed=5))
    path = save(tmp, naive_dump(x, setup_for(None, conv)), setup_for(None, {}))
    return detect(load_dump(path), setup_for(None, {}))


CASES: dict[str, tuple[dict[str, Any], tuple[Any, ...], tuple[str, float]]] = {
    # (the dump's gate, the entry expected, the threshold solved)
    "verl-seq-mean-k3": (
        {"rollout_rs": "sequence", "rollout_rs_stat": "k3", "rollout_rs_order": "behaviour",
         "rollout_rs_reduce": "mean", "rollout_rs_high": 0.07},
        (None, "sequence", "k3", "behaviour", "mean"), ("rollout_rs_high", 0.07),
    ),
    "areal-token-k2-on-raw-ratio": (
        {"rollout_is": "token", "rollout_rs": "token", "rollout_rs_stat": "k2", "rollout_rs_high": 0.3},
        ("token", "token", "k2", "proximal", "mean"), ("rollout_rs_high", 0.3),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_the_generating_gate_is_listed_and_its_threshold_solved(tmp_path: Path, case: str) -> None:
    conv, want, (key, value) = CASES[case]
    found = _detected(tmp_path, conv)
    assert found.detected, (found.unmatched_stages, found.nearest)
    listed = {tuple(e.get(k) for k in KEYS) for e in found.detected}
    assert want in listed, sorted(listed, key=str)[:10]
    assert value in found.solved.get(key, []), found.solved
    assert not any(e.get("rollout_rs") is None and e.get("rollout_is") is None for e in found.detected)


def test_a_gate_changes_the_dump(tmp_path: Path) -> None:
    """The cases' gates reject tokens: the dumps differ from the ungated step's."""
    x = with_behaviour(make_inputs(B=8, T=12, seed=5))
    for conv, _, _ in CASES.values():
        off = {k: v for k, v in conv.items() if not k.startswith("rollout_rs")}
        a = naive_dump(x, setup_for(None, conv))["pg_loss"]
        b = naive_dump(x, setup_for(None, off))["pg_loss"]
        assert not torch.allclose(a, b)
