"""``Hyperparams.clip_high``: the one home of the rule "ε_high = ``cliprange_high``, or ``cliprange``
when it is None" (read by the CISPO update, its naive twin, the CISPO gradient and the tie check)."""

from __future__ import annotations

from refppo.pipeline.settings import Hyperparams


def test_clip_high_falls_back_to_cliprange_only_when_unset() -> None:
    assert Hyperparams(cliprange=0.2).clip_high == 0.2
    assert Hyperparams(cliprange=0.2, cliprange_high=0.28).clip_high == 0.28
    # 0 is a value (no upper slack), not "unset": a truthiness fallback would give 0.2 here
    assert Hyperparams(cliprange=0.2, cliprange_high=0.0).clip_high == 0.0
