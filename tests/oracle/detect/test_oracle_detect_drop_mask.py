"""``--detect`` on a ``rollout_rs_effect=drop_mask`` dump (issue #22 item 6): the gate read off ``returns``.

Dumps come from the pipeline (``oracle_helpers.refppo_dump``: the stage walk, the gate's kept tokens
replacing the response and value masks from GAE on, rows it empties out of every count) with
behaviour log-probs ``l^prox − noise``. ``--detect`` starts from refppo's defaults (no gate): each
listed entry must name ``rollout_rs_effect=drop_mask``, one must have the generating level and
statistic, and the threshold read off the data must lie in the interval of the generating one that
keeps the same tokens. A gate used as a weight (``rollout_rs_effect=weight``) is still listed as a
weight. Before, ``--detect`` found nothing on such a dump from the defaults and refused a checked
drop_mask setting in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from oracle_helpers import make_inputs, refppo_dump, save, setup_for, with_behaviour

from refppo.cli import main
from refppo.core.rollout_correction import gate_statistic
from refppo.dump.load import load_dump
from refppo.errors import ConventionError
from refppo.oracle.detect.detection import detect

CASES: dict[str, dict[str, Any]] = {
    "token-ratio-band": {
        "rollout_rs": "token", "rollout_rs_stat": "ratio", "rollout_rs_order": "behaviour",
        "rollout_rs_low": 0.6, "rollout_rs_high": 1.6,
    },
    "sequence-mean-k3": {  # rejects whole rows: they leave every count
        "rollout_rs": "sequence", "rollout_rs_stat": "k3", "rollout_rs_order": "behaviour",
        "rollout_rs_reduce": "mean", "rollout_rs_high": 0.12,
    },
}  # fmt: skip
DROP = {"rollout_rs_effect": "drop_mask"}
DUMP = refppo_dump
"""The pipeline's own step (its stage walk: the gate before GAE, emptied rows out of every count)."""


def _inputs() -> dict[str, torch.Tensor]:
    return with_behaviour(make_inputs(B=8, T=10, seed=7), scale=0.5)


def _stat(x: dict[str, torch.Tensor], conv: dict[str, Any]) -> torch.Tensor:
    m = x["response_mask"].bool()
    return _full_stat(x, conv)[m]


def _full_stat(x: dict[str, torch.Tensor], conv: dict[str, Any]) -> torch.Tensor:
    return gate_statistic(
        x["old_logprobs"], x["rollout_logprobs"], x["response_mask"].bool(), stat=conv["rollout_rs_stat"],
        order=conv["rollout_rs_order"], level=conv["rollout_rs"],
        reduce=conv.get("rollout_rs_reduce", "mean"),
    )  # fmt: skip


def _interval(u: torch.Tensor, v: float) -> tuple[float, float]:
    """The observed statistics around ``v``: every threshold between them keeps the same tokens."""
    return float(u[u < v].max()), float(u[u > v].min())


@pytest.mark.parametrize("case", list(CASES))
def test_the_drop_mask_gate_is_read_off_returns(tmp_path: Path, case: str) -> None:
    conv = {**CASES[case], **DROP}
    x = _inputs()
    path = save(tmp_path, DUMP(x, setup_for(None, conv)), setup_for(None, {}))
    found = detect(load_dump(path), setup_for(None, {}))
    assert found.detected, (found.unmatched_stages, found.nearest)
    assert all(e.get("rollout_rs_effect") == "drop_mask" for e in found.detected), found.detected
    mode = ("rollout_rs", "rollout_rs_stat")
    same = [e for e in found.detected if all(e.get(k, "ratio") == conv[k] for k in mode)]
    assert same, [{k: e.get(k) for k in mode} for e in found.detected]
    u = _stat(x, conv)
    for key in ("rollout_rs_low", "rollout_rs_high"):
        if conv.get(key) is None:
            continue
        lo, hi = _interval(u, conv[key])
        got = [e.get(key) for e in same if e.get("rollout_rs_order", "proximal") == conv["rollout_rs_order"]]
        assert any(v is not None and lo < v < hi for v in got), (key, lo, hi, got)


def test_a_sequence_gate_empties_rows_and_a_token_gate_makes_holes() -> None:
    """The cases exercise both: rows taken out (sequence) and holes inside rows (token)."""
    x = _inputs()
    m = x["response_mask"].bool()
    for case, conv in CASES.items():
        u = _full_stat(x, conv)
        keep = m & (u >= conv.get("rollout_rs_low", -1e9)) & (u <= conv["rollout_rs_high"])
        emptied = m.any(dim=1) & ~keep.any(dim=1)
        holes = (keep[:, 1:] & ~keep[:, :-1]).any()
        assert 0 < int(keep.sum()) < int(m.sum()), case
        assert bool(emptied.any()) == (case == "sequence-mean-k3"), case
        assert bool(holes) == (case == "token-ratio-band"), case


def test_a_checked_drop_mask_setting_is_walked(tmp_path: Path) -> None:
    """``--set rollout_rs_effect=drop_mask`` with the generating gate: the checked setting is listed
    (before: refused in one line, "--detect does not walk rollout_rs_effect=drop_mask yet")."""
    conv = {**CASES["sequence-mean-k3"], **DROP}
    x = _inputs()
    path = save(tmp_path, DUMP(x, setup_for(None, conv)), setup_for(None, {}))
    found = detect(load_dump(path), setup_for(None, conv))
    assert found.detected, (found.unmatched_stages, found.nearest)
    assert any(all(e.get(k) == v for k, v in conv.items()) for e in found.detected), found.detected


def test_a_gate_as_a_weight_is_listed_as_a_weight(tmp_path: Path) -> None:
    """The same gate with ``rollout_rs_effect=weight`` (rejected tokens still counted): never drop_mask."""
    conv = CASES["token-ratio-band"]
    x = _inputs()
    path = save(tmp_path, DUMP(x, setup_for(None, conv)), setup_for(None, {}))
    found = detect(load_dump(path), setup_for(None, {}))
    assert found.detected, (found.unmatched_stages, found.nearest)
    assert any(e.get("rollout_rs") is not None for e in found.detected)
    assert not any(e.get("rollout_rs_effect") == "drop_mask" for e in found.detected)


def test_a_checked_drop_mask_under_a_group_estimator_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """GRPO under a checked drop_mask gate reads every row's score (as verl 0.9.1); the search cuts the
    gate's rows before the group statistics, so it would list nothing on a dump ``refppo diff``
    matches (a verl GRPO dump did: its nearest, ``advantage=opo``, then ended the run). Refused in one
    line; without ``--detect`` the dump matches."""
    conv = {**CASES["sequence-mean-k3"], **DROP, "advantage": "grpo", "group_eps": 1e-6}
    x = {k: v for k, v in _inputs().items() if k not in ("old_values", "values")}
    x["group_index"] = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    path = save(tmp_path, DUMP(x, setup_for(None, conv)), setup_for(None, conv))
    refused = "^--detect does not walk rollout_rs_effect=drop_mask under "
    with pytest.raises(ConventionError, match=refused):
        detect(load_dump(path), setup_for(None, conv))
    sets = [a for k, v in conv.items() for a in ("--set", f"{k}={v}")]
    assert main(["diff", str(path), *sets]) == 0  # the checked setting itself matches
    capsys.readouterr()
    assert main(["diff", str(path), *sets, "--detect"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "advantage=grpo" in err[0], err
