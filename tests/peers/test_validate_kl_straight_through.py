"""Run ``tools/peers kl_straight_through``: verl 0.9.1's own ``kl_penalty`` with a ``+`` suffix
(straight-through) vs refppo's ``k1+``/``k3+``/``abs+`` — value, autograd gradient and the
closed-form gradient twin — with the base estimator's gradient as a control that must differ.

Needs the verl side venv (/work/shared/peers/README.md); skipped with the reason where it is absent.
"""

from __future__ import annotations

from pathlib import Path

from _peers import require, run


def test_verl_straight_through_kl_matches_refppo(tmp_path: Path) -> None:
    require("verl-openrlhf")  # $REFPPO_PEERS_ROOT and its READY stamp
    proc, doc = run("kl_straight_through", tmp_path=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert doc["versions"] == {"verl": "verl 0.9.1"}, doc["versions"]
    s = doc["summary"]
    assert (s["cases"], s["passed"]) == (7, 7), s
    assert (s["controls"], s["controls_mismatched"]) == (5, 5), s  # every + variant's gradient differs
