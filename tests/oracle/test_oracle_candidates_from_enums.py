"""The diagnosis' candidates are the enums' members (refppo/oracle/check/alternatives.py), so every
member --detect walks is also offered as a single-key explanation. Before, the hand-kept lists
offered 3 of the 5 advantage whitenings and 2 of the 3 approx_kl metrics: a dump whitened by
``center`` (AReaL ``std_level: null``) or logging AReaL's ``neg_k1`` was "not explained by a single
convention change" although one change explains it."""

from __future__ import annotations

from pathlib import Path

import pytest
from oracle_helpers import make_inputs, naive_dump, save, setup_for

from refppo.dump.load import load_dump
from refppo.oracle.check.diagnose import check


@pytest.mark.parametrize(
    ("made", "first", "line"),
    [
        (
            {"whiten_advantages": "center"},
            "advantages",
            "explained by the convention whiten_advantages=center",
        ),
        ({"whiten_advantages": "scale"}, "advantages", "explained by the convention whiten_advantages=scale"),
        ({"approx_kl": "neg_k1"}, "approx_kl", "explained by the convention approx_kl=neg_k1"),
    ],
)
def test_every_enum_member_is_a_candidate(
    tmp_path: Path, made: dict[str, str], first: str, line: str
) -> None:
    start = setup_for("verl", {})
    dump = load_dump(
        save(tmp_path, naive_dump(make_inputs(B=6, T=10, seed=7), setup_for("verl", made)), start)
    )
    res = check(dump, start)
    assert res.first_divergence == first
    hits = [d for d in res.diagnosis if d.startswith(line)]
    assert hits and "with it every quantity in the dump matches" in hits[0], res.diagnosis
    assert {"kind": "convention", "change": made, "all_match": True} in res.explained_by
