"""``--detect`` walks every setting each critic-free estimator reads (review of the estimators work).

- ``reinforce++``'s return-to-go crosses interior holes by ``gae_holes`` (the pipeline threads it):
  a dump made under one hole convention, checked under the other, must be detected;
- ``grpo-passk`` reads ``group_std``, ``group_eps`` and ``group_std_level`` as ``grpo`` does: a
  population-std dump checked under the unbiased std must be detected.

The grpo-passk dump comes from the naive twin (:func:`refppo.core.group_naive.group_advantages_naive`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from oracle_helpers import make_inputs, refppo_dump, save, setup_for
from test_oracle_critic_free import GROUPS, _grpo_dump, _write
from test_oracle_detect_critic_free import _detect

from refppo.core.group_naive import group_advantages_naive
from refppo.dump.load import load_dump
from refppo.oracle.check.diagnose import check
from refppo.oracle.detect.detection import detect, setup_from_json


@pytest.mark.parametrize(("made_holes", "checked_holes"), [("zero", "skip"), ("skip", "zero")])
def test_detect_walks_gae_holes_for_reinforce_pp(tmp_path: Path, made_holes: str, checked_holes: str) -> None:
    inp = make_inputs(B=6, T=10, seed=3, lengths=[10, 9, 8, 7, 6, 5])
    m = inp["response_mask"].bool().clone()
    m[:, 2] = False
    m[1, 4] = False  # interior holes
    inp["response_mask"] = m.to(inp["response_mask"].dtype)
    for k in ("old_values", "values"):
        inp.pop(k)
    base = {"advantage": "reinforce++", "whiten_advantages": "none", "kl_in": "reward"}
    made = setup_for(None, {**base, "gae_holes": made_holes})
    start = setup_for(None, {**base, "gae_holes": checked_holes})
    dump = load_dump(save(tmp_path, refppo_dump(inp, made), start))
    assert not check(dump, start, explain_divergence=False).match
    found = detect(dump, start)
    assert found.detected, found.unmatched
    holes = {c["gae_holes"] for c in found.detected}
    assert made_holes in holes and checked_holes not in holes, holes
    for c in found.detected[:3]:
        assert check(dump, setup_from_json(start, c), explain_divergence=False).match


def test_detect_walks_the_std_of_grpo_passk(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _grpo_dump()
    m = d["response_mask"].bool()
    folded = torch.where(m, d["token_rewards"], torch.zeros((), dtype=torch.float64)).sum(dim=1)
    adv = group_advantages_naive(folded, GROUPS, m, estimator="grpo-passk", unbiased_std=False, eps=1e-6)
    assert bool((adv != 0).any())
    d.update(advantages=adv, returns=adv.clone())
    sets = ("advantage=grpo-passk", "whiten_advantages=none", "group_std=unbiased", "group_eps=1e-6")
    rep = _detect(capsys, _write(tmp_path, d), *sets)
    assert rep["detected"], rep
    assert {(c["advantage"], c["group_std"]) for c in rep["detected"]} == {("grpo-passk", "population")}
