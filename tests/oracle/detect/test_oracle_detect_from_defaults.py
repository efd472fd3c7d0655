"""``--detect`` from refppo's defaults (``advantage=gae``) on a critic-free dump (issue #9).

Before, the estimator stage's first walk tried only the checked setting's own estimator; GAE does
not apply to a dump without ``old_values``, so the walk yielded no candidate at all, the stage was
not recorded as unmatched and the walk over every estimator never ran: ``--detect`` listed nothing
and named no nearest convention for any verl/OpenRLHF/SkyRL GRPO, RLOO or REINFORCE++ dump. The
dump here is the naive twin's (``test_oracle_critic_free._grpo_dump``), not the pipeline's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from oracle_helpers import setup_for
from test_oracle_critic_free import _grpo_dump, _write
from test_oracle_detect_stages import _detect, _recheck

from refppo.dump.load import load_dump
from refppo.oracle.check.diagnose import check
from refppo.oracle.detect.detection import detect, setup_from_json


def test_detect_finds_grpo_from_the_gae_default(tmp_path: Path) -> None:
    dump = load_dump(_write(tmp_path, _grpo_dump()))
    start = setup_for(None, {}, {"kl_coef": 0.1})
    assert start.conv.adv.estimator.value == "gae"
    found = detect(dump, start, limit=1000)
    assert found.detected, (found.nearest, found.unmatched_stages)
    grpo = [c for c in found.detected if c["advantage"] == "grpo"]
    assert grpo, sorted({c["advantage"] for c in found.detected})
    assert any(c["group_kl"] == "fold" and c["group_eps"] == 1e-6 for c in grpo)
    for c in found.detected[:5]:  # re-checked through the pipeline
        assert check(dump, setup_from_json(start, c), explain_divergence=False).match, c


@pytest.mark.parametrize(
    ("made", "key"),
    [
        # SkyRL: KL in the loss aggregated seq-mean-token-mean while pg_loss is token-mean
        ({"kl_in": "loss", "kl_estimator": "k3", "kl_loss_agg": "seq-mean-token-mean"}, "kl_loss_agg"),
        # SkyRL: entropy token-mean whatever loss_agg (here seq-mean-token-sum-norm)
        ({"loss_agg": "seq-mean-token-sum-norm", "entropy_agg": "token-mean"}, "entropy_agg"),
    ],
)
def test_detect_walks_the_kl_and_entropy_aggregations(tmp_path: Path, made: dict[str, Any], key: str) -> None:
    """Before, the KL loss and the entropy were aggregated like pg_loss only: no candidate matched."""
    dump, start, found = _detect(tmp_path, made, {"ent_coef": 0.01})
    assert found.detected, (found.nearest, found.unmatched_stages)
    agg = made.get("loss_agg", "token-mean")
    assert all(c[key] == made[key] and c["loss_agg"] == agg for c in found.detected), found.detected[:3]
    assert all(c.get("dual_clip") in (None, 3.0) for c in found.detected)  # no fitted dual clip
    _recheck(dump, start, found)


@pytest.mark.parametrize("clip", [3.0, 5.0])
def test_detect_solves_a_clipped_score_map(tmp_path: Path, clip: float) -> None:
    """AReaL's clip((s + b)·k, ±C): before, the score-map solver fitted one line through the clipped
    rows too and failed, so no map (and no unnamed C such as 3) was ever proposed."""
    made = {"score_bias": -0.5, "score_scale": 2.0, "score_clip": clip}
    dump, start, found = _detect(tmp_path, made)
    assert found.detected, (found.nearest, found.unmatched_stages, found.fitted)
    got = {(c["score_bias"], c["score_scale"], c["score_clip"]) for c in found.detected}
    assert got == {(-0.5, 2.0, clip)}
    _recheck(dump, start, found)
