"""Issue #23 item 4 on the peers' own code: β = 0 critic-free dumps WITHOUT a reference are checked.

The critic-free makers run as each peer runs at β = 0 (no reference model, no KL anywhere): verl
0.9.1 (``use_kl_in_reward``/``use_kl_loss`` off), OpenRLHF 0.11.2 (no initial model: ``kl`` zeros,
``kl_ctl`` 0), SkyRL-train 0.3.1, AReaL 1.0.4 (``kl_ctl`` 0, no ``ref_logp``), TRL 1.12.0 and 1.16.0
GRPOTrainer (``beta = 0``). Each dump holds no ``ref_logprobs`` and no ``kl``; its sidecar carries
none of ``lam``, ``cliprange_value``, ``vf_coef``. ``refppo diff --preset PEER --set ...`` must MATCH
(advantages and the policy loss compared), the case's control (its option flipped; a KL-only control
replaced by the estimator flipped) must MISMATCH. Each side venv is its own test, SKIPPED without it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _peers import require
from peers.harness import Report, Unit, peers_root
from peers.presets import check_venvs

VENVS: dict[str, dict[str, Unit]] = {
    "verl-openrlhf": {
        "verl:noref": Unit("verl", "peers.makers.critic_free:make_verl_no_reference"),
        "openrlhf:noref": Unit("openrlhf", "peers.makers.critic_free:make_openrlhf_no_reference"),
    },
    "skyrl-areal": {
        "skyrl:noref": Unit("skyrl-train", "peers.makers.critic_free_skyrl:make_skyrl_no_reference"),
        "areal:noref": Unit("areal", "peers.makers.areal_grpo:make_no_reference"),
    },
    "trl": {"trl:noref": Unit("trl", "peers.makers.trl_grpo:make_no_reference")},
    "trl-grpo": {"trl:noref": Unit("trl", "peers.makers.trl_grpo:make_no_reference")},
}
"""Side venv → unit (``PRESET:noref``) → (distribution, maker)."""
COUNTS = {"verl-openrlhf": {"verl": 9, "openrlhf": 6}, "skyrl-areal": {"skyrl": 4, "areal": 10}}
COUNTS.update(trl={"trl": 7}, **{"trl-grpo": {"trl": 7}})
"""Dumps per venv and peer (43 in all): every critic-free case of the makers (TRL: its β = 0 ones)."""
UNREAD = ("lam", "cliprange_value", "vf_coef")


@pytest.mark.parametrize("venv", sorted(VENVS))
def test_beta0_dumps_without_a_reference_match_and_their_controls_do_not(venv: str, tmp_path: Path) -> None:
    require(venv)
    report = Report("no_reference")
    check_venvs(report, {venv: VENVS[venv]}, peers_root(), tmp_path)
    assert not report.failed and not report.skipped, (report.failed, report.skipped)
    per_peer: dict[str, int] = {}
    for case in report.cases:
        peer = case.unit.split(":")[0]
        per_peer[peer] = per_peer.get(peer, 0) + 1
        info = case.info
        assert case.ok, (case.name, info["first_divergence"], info["diagnosis"])
        assert {"advantages", "pg_loss"} <= set(info["quantities"]), (case.name, info["quantities"])
        assert "kl" not in info["quantities"] and "kl_loss" not in info["quantities"], case.name
        assert case.controls and all(c.ok for c in case.controls), (case.name, case.controls)
        folder = tmp_path / venv
        dump = torch.load(folder / f"{case.name}.pt", weights_only=True)
        side = json.loads((folder / f"{case.name}.pt.json").read_text())
        assert "ref_logprobs" not in dump and "kl" not in dump, (case.name, sorted(dump))
        assert side["kl_coef"] == 0.0 and not set(UNREAD) & set(side), (case.name, side)
    assert per_peer == COUNTS[venv], per_peer
