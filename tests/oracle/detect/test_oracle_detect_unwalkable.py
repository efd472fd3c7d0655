"""``--detect`` refuses a checked setting whose rows its walk does not apply (``truncated_rows`` ≠
``keep``; ``rollout_rs_effect=drop_mask`` is walked since #22 item 6) in one line, instead of listing
conventions computed on the wrong rows (before: "no convention reproduces the dump" on a matching TRL
``mask_truncated_completions`` dump checked with ``--set truncated_rows=mask_in_loss``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from oracle_helpers import make_inputs, naive_dump, save, setup_for

from refppo.cli import main
from refppo.dump.load import load_dump
from refppo.errors import ConventionError
from refppo.oracle.detect.detection import detect, unwalkable

REFUSED = [
    ({"truncated_rows": "mask_in_loss"}, "truncated_rows=mask_in_loss"),
    ({"truncated_rows": "drop"}, "truncated_rows=drop"),
]


@pytest.mark.parametrize(("conv", "key"), REFUSED, ids=[k for _, k in REFUSED])
def test_detect_refuses_what_its_walk_does_not_apply(
    tmp_path: Path, conv: dict[str, object], key: str
) -> None:
    x = make_inputs(B=4, T=6, seed=3)
    x["truncated"] = torch.tensor([False, True, False, False])
    x["rollout_logprobs"] = x["old_logprobs"].clone()
    path = save(tmp_path, naive_dump(x, setup_for(None, {})), setup_for(None, {}))
    base = setup_for(None, conv)
    with pytest.raises(ConventionError, match=f"^--detect does not walk {key} yet"):
        detect(load_dump(path), base)


def test_the_walkable_settings_pass_and_the_cli_says_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert unwalkable(setup_for(None, {})) is None
    assert unwalkable(setup_for(None, {"rollout_rs": "token", "rollout_rs_high": 2.0})) is None  # weight
    # drop_mask: applied by the returns step (detect/drop_gate.py; test_oracle_detect_drop_mask.py)
    drop = {"rollout_rs": "token", "rollout_rs_high": 2.0, "rollout_rs_effect": "drop_mask"}
    assert unwalkable(setup_for(None, drop)) is None
    x = make_inputs(B=4, T=6, seed=3)
    x["truncated"] = torch.tensor([False, True, False, False])
    path = save(tmp_path, naive_dump(x, setup_for(None, {})), setup_for(None, {}))
    code = main(["diff", str(path), "--detect", "--set", "truncated_rows=mask_in_loss"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert len(err) == 1 and "--detect does not walk truncated_rows=mask_in_loss yet" in err[0], err
