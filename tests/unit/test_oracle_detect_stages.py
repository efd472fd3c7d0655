"""``--detect`` walks every convention of the reward, GAE and whitening stages (issue #9).

Before, the stage search ignored ``whiten_rewards``, ``gae_padding``, ``whiten_eps_at`` and the
score bias/scale: a dump made under any of them reproduced under no convention. Each dump here is
made by refppo's pipeline under the named setting, checked to fail under the checked (default)
setting, and every reported convention is re-checked through the pipeline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from oracle_helpers import make_inputs, refppo_dump, save, setup_for

from refppo.oracle.detect import Detection, detect, setup_from_json
from refppo.oracle.diagnose import check
from refppo.oracle.load import Dump, load_dump
from refppo.oracle.settings import Setup


def _detect(
    tmp: Path, made_conv: dict[str, Any], made_hp: dict[str, Any] | None = None
) -> tuple[Dump, Setup, Detection]:
    made = setup_for(None, made_conv, made_hp)
    start = setup_for(None, {}, made_hp)
    d = refppo_dump(make_inputs(B=8, T=16, seed=5), made)
    dump = load_dump(save(tmp, d, start))
    assert not check(dump, start).match  # the setting really is outside the checked one
    return dump, start, detect(dump, start)


def _recheck(dump: Dump, start: Setup, found: Detection) -> None:
    assert found.detected, (found.unmatched_stages, found.fitted)
    for c in found.detected[:10]:
        res = check(dump, setup_from_json(start, c), explain_divergence=False)
        assert res.match, (c, res.diagnosis)


@pytest.mark.parametrize("kind", ["masked", "masked_no_shift"])
def test_detect_finds_reward_whitening(tmp_path: Path, kind: str) -> None:
    dump, start, found = _detect(tmp_path, {"whiten_rewards": kind})
    assert {c["whiten_rewards"] for c in found.detected} == {kind}
    _recheck(dump, start, found)


def test_detect_finds_gae_through_padding(tmp_path: Path) -> None:
    dump, start, found = _detect(tmp_path, {"gae_padding": "through"})
    assert {c["gae_padding"] for c in found.detected} == {"through"}
    _recheck(dump, start, found)


@pytest.mark.parametrize("eps_at", ["clamp", "std"])
def test_detect_finds_where_the_whitening_eps_sits(tmp_path: Path, eps_at: str) -> None:
    # a large eps so that its placement changes the advantages beyond float64 tolerance
    dump, start, found = _detect(tmp_path, {"whiten_eps_at": eps_at}, {"whiten_eps": 0.5})
    assert {c["whiten_eps_at"] for c in found.detected} == {eps_at}
    _recheck(dump, start, found)


def test_detect_solves_score_bias_and_scale(tmp_path: Path) -> None:
    # AReaL's reward_bias / reward_scaling: the reward's score is (s + b)·k
    dump, start, found = _detect(tmp_path, {"score_bias": -0.5, "score_scale": 2.0})
    assert {(c["score_bias"], c["score_scale"]) for c in found.detected} == {(-0.5, 2.0)}
    assert found.solved["score_bias"] == [-0.5] and found.solved["score_scale"] == [2.0]
    _recheck(dump, start, found)
