"""``--detect`` tries OpenRLHF's ``flash-reinforce`` (the batch-mean baseline, no group; issue #13).

The dumps come from the naive twin (:func:`refppo.core.group_naive.group_advantages_naive`, a plain loop
over the batch), with OpenRLHF's KL form (``−β·KL`` added as its return-to-go), not from the
pipeline the search re-checks with.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_oracle_critic_free import GROUPS, _grpo_dump, _write
from test_oracle_detect_critic_free import _detect

from refppo.core.group_naive import group_advantages_naive


def _flash_dump(keep_index: bool) -> dict[str, torch.Tensor]:
    d = _grpo_dump()
    m = d["response_mask"].bool()
    pen = torch.where(m, -0.1 * (d["old_logprobs"] - d["ref_logprobs"]), torch.zeros((), dtype=torch.float64))
    adv = group_advantages_naive(d["scores"], None, m, estimator="flash-reinforce", token_penalty=pen)
    # the batch mean is not any group's mean here: the groups' means differ
    means = [float(d["scores"][GROUPS.eq(g)].mean()) for g in (1, 3)]
    assert abs(means[0] - means[1]) > 1e-3
    d.update(advantages=adv, returns=adv.clone())
    if not keep_index:
        d.pop("group_index")
    return d


@pytest.mark.parametrize("keep_index", [True, False])
def test_detect_finds_flash_reinforce(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], keep_index: bool
) -> None:
    """Checked as GRPO (with a group_index) or REINFORCE++ (without): the search names flash-reinforce."""
    start = "advantage=grpo" if keep_index else "advantage=reinforce++"
    path = _write(tmp_path, _flash_dump(keep_index))
    rep = _detect(capsys, path, start, "whiten_advantages=none")
    assert rep["detected_changes"], f"nothing reproduces the dump: {rep.get('detected')}"
    first = rep["detected_changes"][0]
    assert first.get("advantage") == "flash-reinforce", rep["detected_changes"][:3]
    assert first.get("group_kl", "to_go") == "to_go", first
    assert all(c["advantage"] == "flash-reinforce" for c in rep["detected"]), rep["detected"]
