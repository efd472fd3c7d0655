"""Run ``tools/peers grpo_peers``: TRL GRPOTrainer's and AReaL's GRPO family, as dumps.

Per side venv (TRL 1.12.0 ``trl``, TRL 1.16.0 ``trl-grpo``, AReaL 1.0.4 ``skyrl-areal``), each
skipped with the reason where it is absent (/work/shared/peers/README.md). The peer's OWN code makes
each dump (TRL: the advantage block of ``GRPOTrainer._generate_and_score_completions`` and
``_compute_loss``; AReaL: ``PPOActor._compute_advantages`` with a group ``reward_norm``); the script
exits 1 when ``refppo diff --preset PEER --set ...`` does not reproduce a dump, when the case's
control (one key flipped) still reproduces it, or when ``--detect`` from refppo's defaults does not
list the generating convention. Preset and control run on every case in one run per venv
(``--no-detect``); ``--detect`` runs per case (``--case NAME``, its own run and timeout) on the
representative subset ``DETECT_CASES``, as ``--detect`` costs minutes per case on TRL GRPO dumps
(measured 1733 s for all 11 ``trl-grpo`` cases in one run under load). TRL
``scale_rewards="batch"`` (``group_std_level=batch``) and AReaL ``std_level: batch``
(``group_std_level=batch-centred``) must be reproduced like the rest (they were NOT EXPRESSIBLE
before that key); each of their controls is another std level. Each venv's dumps are made once per
session (the ``dumps`` fixture: ``--dumps DIR``), not once per run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _peers import cases_of, require, run

EXPECTED = {
    # venv: (the peer's version line, cases that must pass through the preset, named cases)
    "trl": ("trl 1.12.0", "trl1120_grpo_", ("group_bool_grpo_beta", "none_bool_bnpo_n3_beta", "group_n1")),
    "trl-grpo": (
        "trl 1.16.0",
        "trl1160_grpo_",
        ("group_bool_grpo_beta", "none_dr_grpo", "group_equal_scores"),
    ),
    "skyrl-areal": (
        "areal 1.0.4",
        "areal_grpo_",
        ("grpo_k1", "dr_grpo", "rloo_leave1out", "rloo_group_size1"),
    ),
}
BATCH_STD = {
    # venv: the cases with a batch-level std (group_std_level batch / batch-centred), all expressed
    "trl": ("batch_dapo", "batch_equal_scores_beta", "batch_bnpo_n3_f32"),
    "trl-grpo": ("batch_dapo", "batch_equal_scores_beta", "batch_bnpo_n3_f32"),
    "skyrl-areal": ("grpo_std_batch", "grpo_std_batch_population_n3"),
}


DETECT_CASES = {
    # venv: the cases --detect runs on, each in its own run with its own timeout (see _run). Every
    # std level (group, batch, none / batch-centred), a beta > 0 case (the KL solve) and, for AReaL,
    # the binding reward scale/clip; --detect costs ~4 min per TRL beta > 0 case on a loaded
    # machine (dumps without intermediates), so it runs on this subset, preset and control on all.
    "trl": (
        "batch_dapo",
        "batch_equal_scores_beta",
        "batch_bnpo_n3_f32",
        "group_bool_grpo_beta",
        "none_dr_grpo",
    ),
    "trl-grpo": (
        "batch_dapo",
        "batch_equal_scores_beta",
        "batch_bnpo_n3_f32",
        "group_bool_grpo_beta",
        "none_dr_grpo",
    ),
    "skyrl-areal": ("grpo_std_batch", "grpo_std_batch_population_n3", "grpo_reward_scale_clip", "grpo_k1"),
}
TIMEOUT_S = 1800
"""Per run: preset + control on every case (minutes), or one case's --detect (~4 min at worst)."""


@pytest.fixture(scope="session")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder of peer dumps for the session: each venv's made by its first run, read by the rest."""
    return tmp_path_factory.mktemp("grpo-peer-dumps")


def _run(venv: str, tmp_path: Path, dumps: Path, *extra: str) -> dict[str, Any]:
    require(venv)
    args = ("--venv", venv, "--dumps", str(dumps), *extra)
    proc, doc = run("grpo_peers", *args, tmp_path=tmp_path, timeout=TIMEOUT_S)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert doc["versions"] == {venv: EXPECTED[venv][0]}, doc["versions"]  # the peer ran, pinned version
    return cases_of(doc, venv)


@pytest.mark.parametrize("venv", sorted(EXPECTED))
def test_peer_grpo_dumps_reproduce_under_the_preset(venv: str, tmp_path: Path, dumps: Path) -> None:
    cases = _run(venv, tmp_path, dumps, "--no-detect")
    _, prefix, named = EXPECTED[venv]
    for name in (*named, *BATCH_STD[venv], *DETECT_CASES[venv]):
        assert prefix + name in cases, sorted(cases)
    expressed = {n: c for n, c in cases.items() if c["info"]["verdict"] != "not expressible"}
    assert len(expressed) >= 6, sorted(cases)
    for name in BATCH_STD[venv]:
        c = cases[prefix + name]
        assert c["info"]["verdict"] == "MATCH" and "group_std_level" in c["info"]["command"], (name, c)
        (ctl,) = c["controls"]
        assert ctl["label"].startswith("--set group_std_level=") and ctl["ok"], (name, c)
    for name, c in expressed.items():
        assert c["info"]["verdict"] == "MATCH" and len(c["info"]["quantities"]) >= 2, (name, c)
        assert len(c["controls"]) == 1 and c["controls"][0]["ok"], (name, c)
        assert c["info"]["detect"] == "not run", (name, c)  # --detect: the per-case test below
    not_expressible = sorted(n for n, c in cases.items() if c["info"]["verdict"] == "not expressible")
    assert not_expressible == [], not_expressible  # every form these makers run is stated now


@pytest.mark.parametrize(("venv", "case"), [(v, c) for v in sorted(DETECT_CASES) for c in DETECT_CASES[v]])
def test_peer_grpo_detect_finds_the_generating_convention(
    venv: str, case: str, tmp_path: Path, dumps: Path
) -> None:
    name = EXPECTED[venv][1] + case
    cases = _run(venv, tmp_path, dumps, "--case", name)
    assert sorted(cases) == [name], sorted(cases)  # exactly this case ran
    c = cases[name]
    assert c["info"]["verdict"] == "MATCH" and c["controls"][0]["ok"], c
    assert c["info"]["detect"] in ("found", "equivalent"), c  # DETECT_GAPS is empty: no named gap
    assert not c["info"]["detect_gap"], c
