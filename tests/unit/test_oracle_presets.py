"""Presets: refppo's own dumps under every preset match; the preset values are the survey's; detection
recovers the convention a dump was made with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from oracle_helpers import make_inputs, refppo_dump, save, setup_for

from refppo.oracle.detect import detect
from refppo.oracle.diagnose import check
from refppo.oracle.load import load_dump
from refppo.oracle.presets import PEER_PRESETS, PRESETS, resolve_preset


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("preset", [*PEER_PRESETS, "refppo"])
def test_refppo_dump_matches_under_every_preset(tmp_path: Path, preset: str, dtype: torch.dtype) -> None:
    s = setup_for(preset)
    d = refppo_dump(make_inputs(seed=11), s, dtype=dtype)
    res = check(load_dump(save(tmp_path, d, s)), s)
    assert res.match, res.diagnosis
    assert len(res.quantities) == 11


@pytest.mark.parametrize("preset", PEER_PRESETS)
def test_a_preset_dump_does_not_match_the_refppo_defaults(tmp_path: Path, preset: str) -> None:
    s = setup_for(preset)
    d = refppo_dump(make_inputs(seed=12, lp_noise=1.5), s)  # ratios > 3 so verl's dual clip acts
    assert not check(load_dump(save(tmp_path, d, s)), setup_for(None, hp=s.hparams_dict())).match


def test_preset_values_follow_the_survey() -> None:
    # shared/conventions.md section 1 (comparison table)
    verl, orl, trl, ds = (resolve_preset(n)[0] for n in ("verl", "openrlhf", "trl", "deepspeed-chat"))
    assert (
        verl["dual_clip"] == 3.0 and verl["log_ratio_clamp"] == 20.0 and verl["whiten_variance"] == "unbiased"
    )
    assert (
        orl["whiten_variance"] == "population" and orl["kl_value_clamp"] == 10.0 and orl["score_clip"] == 10.0
    )
    assert trl["score_at"] == "after_last_valid" and trl["approx_kl"] == "k2_all_positions"
    assert (
        ds["score_at"] == "after_last_valid" and ds["whiten_advantages"] == "none" and ds["score_clip"] == 5.0
    )
    assert resolve_preset("verl", "k3")[0]["kl_log_ratio_clamp"] == (-20.0, 20.0)
    assert resolve_preset("verl", "k1")[0]["kl_value_clamp"] is None
    assert resolve_preset("openrlhf", "k3")[0]["kl_log_ratio_clamp"] == (-10.0, None)
    assert PRESETS["trl"].hparams["lam"] == 0.95 and PRESETS["verl"].hparams["lam"] == 1.0


def _pinned(conv: dict[str, object], got: dict[str, object]) -> bool:
    return all(got[k] == v for k, v in conv.items())


DETECT_CASES: list[tuple[str | None, dict[str, str]]] = [
    ("trl", {}),
    ("verl", {"kl_estimator": "k3", "loss_agg": "seq-mean-token-sum"}),
    ("openrlhf", {"whiten_advantages": "masked_no_shift"}),
    ("deepspeed-chat", {}),
    (None, {"kl_estimator": "k2", "score_at": "last_position", "value_loss": "unclipped", "kl_in": "loss"}),
]


@pytest.mark.parametrize(("preset", "conv"), DETECT_CASES)
def test_detect_recovers_the_convention(tmp_path: Path, preset: str | None, conv: dict[str, str]) -> None:
    made = setup_for(preset, conv)
    inp = make_inputs(B=6, T=10, seed=21)
    inp["scores"] = inp["scores"] * 4.0  # large enough that score clipping is visible
    d = refppo_dump(inp, made)
    dump = load_dump(save(tmp_path, d, made))
    start = setup_for(None, hp=made.hparams_dict())  # search from refppo's defaults
    found = detect(dump, start)
    assert found.detected, found.unmatched_stages
    truth = {k: (list(v) if isinstance(v, tuple) else v) for k, v in made.convention_dict().items()}
    pinned = {k: v for k, v in truth.items() if k not in found.undetermined}
    assert any(_pinned(pinned, c) for c in found.detected)
    assert {"score_at", "whiten_advantages", "loss_agg", "value_loss", "kl_estimator"}.isdisjoint(
        found.undetermined
    )
    for c in found.detected:  # every reported convention really reproduces the dump
        res = check(
            dump, start.with_convention({k: tuple(v) if isinstance(v, list) else v for k, v in c.items()})
        )
        assert res.match, (c, res.diagnosis)


def test_detect_reports_the_nearest_when_nothing_matches(tmp_path: Path) -> None:
    s = setup_for("trl")
    d = refppo_dump(make_inputs(seed=5), s)
    d["vf_loss"] = d["vf_loss"] * 1.37  # no convention produces this
    found = detect(load_dump(save(tmp_path, d, s)), s)
    assert not found.detected
    assert found.nearest is not None and found.nearest["score_at"] == "after_last_valid"
    assert "value" in found.unmatched_stages
