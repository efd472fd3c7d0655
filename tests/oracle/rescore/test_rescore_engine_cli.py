"""``refppo diff DUMP --actor DIR`` on a dump with ``rollout_logprobs``: the engine's verdict is the
exit code (0: match or within precision; 1: beyond precision), in the text and the JSON report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from rescore_helpers import engine_dump, save_sharp_actor

from refppo.oracle.cli import main


@pytest.fixture(scope="module")
def actor(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_sharp_actor(tmp_path_factory.mktemp("llama"), "llama")


def _diff(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    rc = main(list(args))
    return rc, capsys.readouterr().out


@pytest.mark.parametrize(
    ("engine", "rc", "status", "verdict"),
    [
        ({}, 0, "ok", "match"),
        ({"logits_dtype": torch.bfloat16}, 0, "ok (within precision)", "precision"),
        ({"temperature_applied": False}, 1, "NOT OK", "explained"),
        ({"shift": 0.5}, 1, "NOT OK", "disagree"),
    ],
    ids=["clean", "bf16-logits", "no-temperature", "shifted"],
)
def test_the_engine_verdict_is_the_exit_code(
    actor: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    engine: dict[str, Any],
    rc: int,
    status: str,
    verdict: str,
) -> None:
    p = engine_dump(actor, tmp_path, **engine)
    got, out = _diff(capsys, str(p), "--actor", str(actor))
    assert got == rc, out
    row = next(line for line in out.splitlines() if line.startswith("engine"))
    assert row.split()[1] == "rollout_logprobs" and row.endswith(status), row
    assert f"engine/rollout_logprobs: verdict {verdict}:" in out
    assert "engine/rollout_logprobs: gates: ratio exp(l_engine − l_trainer) mean" in out
    assert ("RE-SCORE MATCH." in out) == (rc == 0)


def test_the_json_report_carries_the_verdict_and_the_gates(
    actor: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = engine_dump(actor, tmp_path, temperature_applied=False)
    rc, out = _diff(capsys, str(p), "--actor", str(actor), "--json")
    assert rc == 1
    rep = json.loads(out)["rescore"]
    actor_item, engine = rep["items"]
    assert actor_item["ok"] is True and rep["match"] is False
    assert (engine["role"], engine["key"], engine["verdict"], engine["ok"]) == (
        "engine",
        "rollout_logprobs",
        "explained",
        False,
    )
    assert [e["name"] for e in engine["explained_by"]] == ["engine_temperature_not_applied"]
    assert engine["explained_by"][0]["recheck"]["ok"] is True
    assert set(engine["gates"]) >= {"ratio_mean", "share_outside_trust", "kl_k1", "kl_k3", "chi2_token"}
    assert engine["gates"]["trust_delta"] == 0.2 and engine["gates"]["tokens"] == 20
