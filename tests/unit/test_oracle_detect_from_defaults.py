"""``--detect`` from refppo's defaults (``advantage=gae``) on a critic-free dump (issue #9).

Before, the estimator stage's first walk tried only the checked setting's own estimator; GAE does
not apply to a dump without ``old_values``, so the walk yielded no candidate at all, the stage was
not recorded as unmatched and the walk over every estimator never ran: ``--detect`` listed nothing
and named no nearest convention for any verl/OpenRLHF/SkyRL GRPO, RLOO or REINFORCE++ dump. The
dump here is the naive twin's (``test_oracle_critic_free._grpo_dump``), not the pipeline's.
"""

from __future__ import annotations

from pathlib import Path

from oracle_helpers import setup_for
from test_oracle_critic_free import _grpo_dump, _write

from refppo.oracle.detect import detect, setup_from_json
from refppo.oracle.diagnose import check
from refppo.oracle.load import load_dump


def test_detect_finds_grpo_from_the_gae_default(tmp_path: Path) -> None:
    dump = load_dump(_write(tmp_path, _grpo_dump()))
    start = setup_for(None, {}, {"kl_coef": 0.1})
    assert start.conv.advantage.value == "gae"
    found = detect(dump, start, limit=1000)
    assert found.detected, (found.nearest, found.unmatched_stages)
    grpo = [c for c in found.detected if c["advantage"] == "grpo"]
    assert grpo, sorted({c["advantage"] for c in found.detected})
    assert any(c["group_kl"] == "fold" and c["group_eps"] == 1e-6 for c in grpo)
    for c in found.detected[:5]:  # re-checked through the pipeline
        assert check(dump, setup_from_json(start, c), explain_divergence=False).match, c
