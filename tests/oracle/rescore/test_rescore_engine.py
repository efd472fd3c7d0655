"""Engine versus trainer (issue #22 item 4): dumps whose ``rollout_logprobs`` come from a tiny saved
actor through plain code written from each hypothesis's definition (tests/helpers/rescore_helpers.py
``engine_logprobs``: transformers' own warpers for the support, never refppo's read-outs), the
responses sampled by that engine. Each hypothesis is named, the others not; a clean engine and a
precision-only one pass; a grossly wrong engine fails with nothing named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from rescore_helpers import engine_dump, engine_rows, save_sharp_actor, trainer_logprobs, write_rows

from refppo.dump.load import load_dump
from refppo.models.tiny import Arch
from refppo.oracle.rescore.engine import EngineItem
from refppo.oracle.rescore.run import load_models, rescore_dump


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def actor(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch: Arch = request.param
    return save_sharp_actor(tmp_path_factory.mktemp(arch), arch)


def engine_item(actor: Path, dump: Path) -> EngineItem:
    items = rescore_dump(
        load_dump(dump), load_models(str(actor), None, None, None), {"actor": "old_logprobs"}
    )
    assert [(i.role, i.key) for i in items] == [("actor", "old_logprobs"), ("engine", "rollout_logprobs")]
    assert items[0].ok, items[0].result  # the trainer's own old_logprobs are right in every case here
    item = items[1]
    assert isinstance(item, EngineItem)
    return item


def names(item: EngineItem) -> list[str]:
    return [f.name for f in item.findings]


def test_a_clean_engine_matches(actor: Path, tmp_path: Path) -> None:
    item = engine_item(actor, engine_dump(actor, tmp_path))
    assert item.ok and item.verdict == "match" and item.findings == []
    g = item.gates
    assert g["max_abs_dlogp"] < 1e-4 and abs(g["ratio_mean"] - 1) < 1e-4 and abs(g["kl_k1"]) < 1e-5
    assert g["share_outside_trust"] == 0.0 and g["tokens"] == 20


def test_temperature_not_applied_is_named(actor: Path, tmp_path: Path) -> None:
    item = engine_item(actor, engine_dump(actor, tmp_path, temperature_applied=False))
    assert not item.ok and item.verdict == "explained"
    assert names(item) == ["engine_temperature_not_applied"]
    check = item.findings[0].check
    assert check is not None and check.ok and check.max_abs_err < 1e-4
    assert item.result.max_abs_err > 0.1  # the plain comparison does not reproduce the engine


@pytest.mark.parametrize(
    "support",
    [{"top_p": 0.8}, {"top_k": 3}, {"min_p": 0.2}, {"top_p": 0.9, "top_k": 5}],
    ids=["top_p", "top_k", "min_p", "top_k+top_p"],
)
def test_support_renormalisation_is_named(actor: Path, tmp_path: Path, support: dict[str, Any]) -> None:
    item = engine_item(actor, engine_dump(actor, tmp_path, support=support))
    assert not item.ok and item.verdict == "explained"
    assert names(item) == ["engine_support_renormalised"], (item.findings, item.notes)
    check = item.findings[0].check
    assert check is not None and check.ok and check.max_abs_err < 1e-4
    # the engine's probabilities are larger: every ratio exp(l_engine − l_trainer) = 1/S ≥ 1
    assert item.gates["ratio_min"] >= 1 - 1e-4 and item.gates["kl_k1"] > 0.0


def test_support_with_the_sidecar_silent_is_not_named(actor: Path, tmp_path: Path) -> None:
    """The engine filtered with top-p but the sidecar does not say so: nothing re-enacts it."""
    p = engine_dump(actor, tmp_path, support={"top_p": 0.8}, sidecar={"top_p": 1.0})
    item = engine_item(actor, p)
    assert item.verdict == "disagree" and item.findings == []
    assert any("sampling support not tested" in n for n in item.notes)


def test_bf16_logits_are_precision_and_pass(actor: Path, tmp_path: Path) -> None:
    item = engine_item(actor, engine_dump(actor, tmp_path, logits_dtype=torch.bfloat16))
    assert item.ok and item.verdict == "precision"
    assert names(item) == ["precision_logits_bfloat16"]
    assert item.result.max_abs_err > 1e-3  # beyond the float32 tolerance: only precision explains it


def test_a_bf16_forward_is_precision_and_passes(actor: Path, tmp_path: Path) -> None:
    item = engine_item(actor, engine_dump(actor, tmp_path, forward_dtype=torch.bfloat16))
    assert item.ok and item.verdict == "precision"
    # refppo's bf16 re-run reproduces it exactly, or (left padding changes the bf16 kernels' sums)
    # its envelope holds it
    assert names(item) in (["precision_forward_bfloat16"], ["precision_forward_envelope"])
    assert item.result.max_abs_err > 1e-2


def test_a_shifted_engine_fails_with_nothing_named(actor: Path, tmp_path: Path) -> None:
    item = engine_item(actor, engine_dump(actor, tmp_path, support={"top_p": 0.8}, shift=-0.5))
    assert not item.ok and item.verdict == "disagree" and item.findings == []
    assert abs(item.gates["kl_k1"] + 0.5) < 0.2 and item.gates["share_outside_trust"] > 0.5


def test_an_engine_temperature_the_sidecar_lacks_is_solved(actor: Path, tmp_path: Path) -> None:
    """Vice versa: the engine applied τ = 0.7, the sidecar (and the trainer) say 1."""
    item = engine_item(actor, engine_dump(actor, tmp_path, sidecar_tau=1.0))
    assert not item.ok and names(item) == ["engine_temperature_other"]
    assert "τ̂=0.7" in item.findings[0].text, item.findings[0].text


def test_a_bf16_engine_without_temperature_is_named_up_to_precision(actor: Path, tmp_path: Path) -> None:
    """A realistic engine: its forward in bf16 AND no temperature. No re-enactment is exact; the
    temperature hypothesis's residual lies in the bf16 envelope, the plain one's does not."""
    p = engine_dump(actor, tmp_path, forward_dtype=torch.bfloat16, temperature_applied=False)
    item = engine_item(actor, p)
    assert not item.ok and item.verdict == "explained"
    assert names(item) == ["engine_temperature_not_applied"]
    assert item.findings[0].check is None and "up to precision" in item.findings[0].text


def test_rows_of_several_policy_versions_are_noted(actor: Path, tmp_path: Path) -> None:
    rows = engine_rows(actor)
    lp = trainer_logprobs(actor, rows)
    version = torch.tensor([3, 3, 2, 3, 1])
    p = write_rows(tmp_path, rows, old_logprobs=lp, rollout_logprobs=lp.clone(), policy_version=version)
    item = engine_item(actor, p)
    assert item.verdict == "match" and any("several policy versions" in n for n in item.notes), item.notes
    same = write_rows(tmp_path, rows, name="same.safetensors", old_logprobs=lp, rollout_logprobs=lp.clone(),
                      policy_version=torch.full((5,), 3))  # fmt: skip
    assert engine_item(actor, same).notes == []


def test_without_rollout_logprobs_or_with_the_update_actor_no_engine_item(
    actor: Path, tmp_path: Path
) -> None:
    rows = engine_rows(actor)
    lp = trainer_logprobs(actor, rows)
    models = load_models(str(actor), None, None, None)
    plain = write_rows(tmp_path, rows, name="plain.safetensors", old_logprobs=lp)
    assert [i.role for i in rescore_dump(load_dump(plain), models, {"actor": "old_logprobs"})] == ["actor"]
    both = write_rows(tmp_path, rows, name="both.safetensors", logprobs=lp, rollout_logprobs=lp - 1)
    (item,) = rescore_dump(load_dump(both), models, {"actor": "logprobs"})
    assert item.ok and any(
        "rollout_logprobs not compared: with --actor-key logprobs" in n for n in item.notes
    )
