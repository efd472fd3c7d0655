"""Multi-turn dumps with holes from the peers' OWN code (``tools/peers/makers/holes.py``, run in
the side venvs) reproduced by each preset and its hole convention (issue #11).

verl 0.9.1 and OpenRLHF 0.11.2 (``verl-openrlhf`` venv), SkyRL-train 0.3.1 and AReaL 1.0.4
(``skyrl-areal`` venv)
each make dumps whose ``response_mask`` has interior holes; ``refppo diff --preset <peer>`` must
match them, the flipped hole convention must not, and ``--detect`` from refppo's defaults must name
the peer's hole convention. Without a venv the test is SKIPPED with the reason.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
from _peers import require
from peers.harness import Report, peers_root
from peers.presets import VENVS, check_venvs

from refppo.dump.load import load_dump
from refppo.oracle.cli import main as diff_main

EXPECTED: dict[str, dict[str, tuple[str, str]]] = {
    # group -> {case: (gae_holes, whiten_holes) the preset must carry}
    "verl-openrlhf": {
        "verl_holes_token-mean": ("skip", "exclude"),
        "verl_holes_seq-mean-token-mean": ("skip", "exclude"),
        "openrlhf_holes_token-mean": ("zero", "exclude"),
        "openrlhf_holes_seq-mean-token-mean": ("zero", "exclude"),
    },
    "skyrl-areal": {
        "skyrl_holes_token_mean": ("through", "include"),
        "skyrl_holes_sequence_mean": ("through", "include"),
        "areal_holes_plain": ("skip", "exclude"),
        "areal_holes_advnorm": ("skip", "exclude"),
    },
}


NO_DETECT = {"areal_holes_plain", "areal_holes_advnorm"}
"""``--detect`` reproduces no AReaL dump, holes or not (its ``approx_kl=neg_k1`` is not among the
policy stage's options; a limitation older than holes)."""
DETECT_PINS: dict[str, dict[str, str]] = {
    # right-padded rows: SkyRL's GAE runs through the padding too, so gae_padding=through decides and
    # gae_holes is moot; the whitening over the envelope is still pinned down
    "skyrl_holes_sequence_mean": {"gae_padding": "through", "whiten_holes": "include"},
}


def _diff_json(argv: list[str]) -> tuple[int, dict[str, Any]]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = diff_main([*argv, "--json"])
    return rc, json.loads(buf.getvalue())


@pytest.mark.parametrize("group", sorted(EXPECTED))
def test_peer_dumps_with_holes_are_reproduced(group: str, tmp_path: Path) -> None:
    require(group)
    report = Report("presets")
    check_venvs(report, {group: VENVS[group]}, peers_root(), tmp_path)
    assert not report.failed, report.failed
    cases = {c.name: c for c in report.cases}
    folder = tmp_path / group
    for name, (holes, wh) in EXPECTED[group].items():
        assert name in cases, (name, sorted(cases))
        case = cases[name]
        dump = load_dump(folder / f"{name}.pt")
        m = dump.tensors["response_mask"]
        assert bool((m[:, 1:] & ~m[:, :-1]).any()), f"{name}: the peer's mask has no interior hole"
        assert case.ok, (name, case.info["first_divergence"], case.info["diagnosis"])
        assert case.errors["abs"] < 1e-5, (name, case.errors)
        assert case.controls and case.controls[0].ok, (name, "control still matches")
        if name in NO_DETECT:
            continue
        # --detect from refppo's defaults pins the peer's hole conventions down
        _, rep = _diff_json([str(folder / f"{name}.pt"), "--detect"])
        detected = rep["detected"]
        assert detected, (name, rep.get("nearest"))
        pins = DETECT_PINS.get(name, {"gae_holes": holes, "whiten_holes": wh})
        assert all(all(c[k] == v for k, v in pins.items()) for c in detected), (name, detected[:3])


def test_skyrl_full_rows_are_reproduced_by_gae_holes_through_alone(tmp_path: Path) -> None:
    """On rows without right padding only the holes separate the GAE conventions: with the preset's
    ``gae_padding=through`` replaced by ``masked``, ``gae_holes=through`` alone must still match
    SkyRL and ``skip``/``zero`` must not."""
    require("skyrl-areal")
    report = Report("presets")
    check_venvs(report, {"skyrl-areal": VENVS["skyrl-areal"]}, peers_root(), tmp_path)
    folder = tmp_path / "skyrl-areal"
    path = str(folder / "skyrl_holes_token_mean.pt")
    conv = json.loads((folder / "skyrl_holes_token_mean.set.json").read_text())
    sets = [a for k, v in conv.items() for a in ("--set", f"{k}={v}")]
    base = [path, "--preset", "skyrl", *sets, "--set", "gae_padding=masked"]
    assert _diff_json(base)[0] == 0
    for other in ("skip", "zero"):
        rc, rep = _diff_json([*base, "--set", f"gae_holes={other}"])
        assert rc == 1 and rep["first_divergence"] in ("advantages", "returns"), (
            other,
            rep["first_divergence"],
        )
