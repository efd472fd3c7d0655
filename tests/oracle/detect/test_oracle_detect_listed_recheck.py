"""Every convention ``--detect`` lists is what the pipeline computes for it (issue #20 item 2).

The walk evaluates the pipeline's stages through their own functions, so each listed convention
reproduces the dump *by construction*; ``detect`` itself re-checks only the nearest few through
:func:`refppo.oracle.check.diagnose.check`. Here every listed convention (``limit`` above the count:
the whole list) of a corpus of dumps is re-checked through ``check``, the recompute of
:mod:`refppo.oracle.check`: one dump per peer preset, full / losses-only / without ``returns``,
float32, written by the naive twins (:func:`oracle_helpers.naive_dump`, not the pipeline the
search walks). The control: the nearest entry with ``loss_agg`` changed to a mode no entry lists
does not match (the re-check tells conventions apart on these dumps).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from oracle_helpers import make_inputs, naive_dump, save, setup_for

from refppo.conventions import LossAgg
from refppo.dump.load import Dump, load_dump
from refppo.oracle.check.diagnose import check
from refppo.oracle.check.settings import Setup
from refppo.oracle.detect.detection import detect, setup_from_json

LOSSES_ONLY = ("kl", "token_rewards", "advantages", "returns")
CASES = [
    ("refppo", (), None),
    ("verl", LOSSES_ONLY, "verl"),
    ("openrlhf", ("returns",), None),
    ("trl", (), None),
    ("trl", LOSSES_ONLY, "trl"),
    ("deepspeed-chat", LOSSES_ONLY, None),
    ("skyrl", (), "skyrl"),
    ("areal", ("returns",), None),
]
"""``(maker's preset, keys dropped from the dump, preset checked from)``."""


def _matches(dump: Dump, start: Setup, conv: dict[str, Any]) -> bool:
    return check(dump, setup_from_json(start, conv), explain_divergence=False).match


@pytest.mark.parametrize(("made", "drop", "start_preset"), CASES)
def test_every_listed_convention_matches_through_the_check(
    made: str, drop: tuple[str, ...], start_preset: str | None, tmp_path: Path
) -> None:
    d = naive_dump(make_inputs(B=8, T=16, seed=7), setup_for(made), dtype=torch.float32)
    start = setup_for(start_preset)
    dump = load_dump(save(tmp_path, {k: v for k, v in d.items() if k not in drop}, start))
    found = detect(dump, start, limit=10_000)
    assert found.detected, (found.nearest, found.unmatched_stages)
    assert found.n_rechecked < len(found.detected)  # most entries are the walk's alone
    failed = [c for c in found.detected if not _matches(dump, start, c)]
    assert failed == [], (len(failed), len(found.detected), failed[:3])
    other = next(m.value for m in LossAgg if m.value not in {c["loss_agg"] for c in found.detected})
    assert not _matches(dump, start, {**found.detected[0], "loss_agg": other}), other
