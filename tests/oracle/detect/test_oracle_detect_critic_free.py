"""``--detect`` walks the critic-free estimators and solves GRPO's ε from the data (issue #13 item 4).

The dumps come from the naive twins of :mod:`refppo.core.group` (``test_oracle_critic_free``), not
from the pipeline the search re-checks with.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_oracle_critic_free import GROUPS, _grpo_dump, _write

from refppo.core.group_naive import group_advantages_naive
from refppo.oracle.cli import main


def _detect(capsys: pytest.CaptureFixture[str], path: Path, *sets: str) -> dict[str, Any]:
    argv = [str(path), "--detect", "--json"]
    for s in sets:
        argv += ["--set", s]
    rc = main(argv)
    rep: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert rc in (0, 1)
    return rep


@pytest.mark.parametrize(("eps", "solved"), [(1e-4, False), (3e-2, True)])
def test_detect_names_grpo_and_its_eps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], eps: float, solved: bool
) -> None:
    """Checked as RLOO: the search finds GRPO, with TRL's named 1e-4 or a solved 0.03."""
    rep = _detect(capsys, _write(tmp_path, _grpo_dump(eps=eps)), "advantage=rloo", "whiten_advantages=none")
    first = rep["detected_changes"][0]
    assert first == {"advantage": "grpo", "group_eps": eps}, rep["detected_changes"][:3]
    assert all(c["advantage"] == "grpo" and c["group_eps"] == eps for c in rep["detected"])
    # a named ε is found by the walk (the solver may read it off too); an unnamed one only by the solver
    if solved:
        assert rep["solved"] == {"group_eps": [eps]}
    else:  # found by the walk; the solver may or may not also have read it off, never another value
        assert rep["solved"].get("group_eps") in (None, [eps]), rep["solved"]


def test_detect_tells_the_openrlhf_kl_form(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Scores grouped alone, −β·KL added as its return-to-go (OpenRLHF): group_kl=to_go is found."""
    d = _grpo_dump()
    m = d["response_mask"].bool()
    pen = torch.where(m, -0.1 * (d["old_logprobs"] - d["ref_logprobs"]), torch.zeros((), dtype=torch.float64))
    adv = group_advantages_naive(d["scores"], GROUPS, m, estimator="dr-grpo", token_penalty=pen)
    d.update(advantages=adv, returns=adv.clone())
    rep = _detect(capsys, _write(tmp_path, d), "advantage=grpo", "whiten_advantages=none")
    assert rep["detected_changes"][0] == {"advantage": "dr-grpo", "group_kl": "to_go"}
    assert {c["group_kl"] for c in rep["detected"]} == {"to_go"}
