"""``--detect`` drops GAE candidates no value loss can match before the whitening walk (issue #9,
"Scale"; refppo.oracle.detect.prune), and reports exactly what the unpruned walk reports."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import torch
from oracle_helpers import make_inputs, refppo_dump, save, setup_for

import refppo.oracle.detect.detection as detect_mod
import refppo.oracle.detect.prune as prune_mod
import refppo.oracle.detect.steps as steps_mod
from refppo.agg_conventions import MASK_AGGS
from refppo.core.value import value_loss
from refppo.dump.load import Dump, load_dump
from refppo.dump.tolerances import TOLERANCES
from refppo.oracle.check.compare import compare
from refppo.oracle.detect.detection import Detection, detect
from refppo.oracle.detect.groups import Group
from refppo.oracle.detect.search import Search

B, T = 8, 16
NO_RETURNS = ("advantages", "returns")


def _dump(
    tmp: Path,
    preset: str | None,
    drop: tuple[str, ...],
    scale: str | None = None,
    conv: dict[str, Any] | None = None,
) -> Dump:
    made = setup_for(preset, conv)
    inputs = make_inputs(B=B, T=T, seed=5)
    if (conv or {}).get("value_loss") == "unclipped":  # |V − V_old| up to 1: the clip (0.2) binds
        inputs["values"] = inputs["old_values"] + torch.linspace(-1.0, 1.0, T, dtype=torch.float64)
    d = refppo_dump(inputs, made, dtype=torch.float32)
    d = {k: v for k, v in d.items() if k not in drop}
    if scale is not None:  # a loss no convention reproduces: the nearest-group paths run
        d[scale] = d[scale] * 1.05
    return load_dump(save(tmp, d, made))


def _unpruned(dump: Dump, start: Any, mp: pytest.MonkeyPatch) -> Detection:
    with mp.context() as m:
        m.setattr(detect_mod, "value_prune_for", lambda _s: None)
        return detect(dump, start)


def _spy(mp: pytest.MonkeyPatch) -> list[tuple[bool, int, bool]]:
    """Records, per search run, (pruning on, GAE options dropped, pruned walk held)."""
    seen: list[tuple[bool, int, bool]] = []
    real = detect_mod.prune_held

    def held(search: Search) -> bool:
        ok = real(search)
        assert search.prune is not None
        seen.append((True, search.prune.dropped, ok))
        return ok

    mp.setattr(detect_mod, "prune_held", held)
    return seen


CASES: dict[str, tuple[str | None, dict[str, Any], str | None]] = {
    "no_returns_trl": ("trl", {}, None),
    "no_returns_openrlhf_from_verl": ("openrlhf", {}, "verl"),
    "no_returns_refppo": (None, {}, None),
    # the value loss over the response mask, which differs from the value mask (a slot past the end)
    "no_returns_vf_mask_response": (None, {"vf_mask": "response", "score_at": "after_last_valid"}, None),
    "no_returns_unclipped_seq_sum": (
        None,
        {"value_loss": "unclipped", "loss_agg": "seq-mean-token-sum"},
        None,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pruned_detection_equals_the_unpruned_one(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    preset, conv, checked = CASES[case]
    dump = _dump(tmp_path, preset, NO_RETURNS, conv=conv)
    start = setup_for(checked)
    seen = _spy(monkeypatch)
    new = detect(dump, start)
    assert seen and seen[0][1] > 0 and seen[0][2]  # candidates were dropped and the pruned walk held
    assert repr(vars(new)) == repr(vars(_unpruned(dump, start, monkeypatch)))
    assert new.n_detected > 0


@pytest.mark.parametrize("scale", ["vf_loss", "pg_loss"])
def test_an_unmatched_stage_walks_again_unpruned(
    scale: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing reproduces the scaled loss: the search returns its nearest groups, which the pruned
    walk may not have (a dropped candidate can be among them), so the search runs again unpruned."""
    dump = _dump(tmp_path, "trl", NO_RETURNS, scale)
    seen = _spy(monkeypatch)
    runs: list[bool] = []
    real_run = steps_mod.run_search

    def run(self: Search) -> list[Group[Any]]:
        runs.append(self.prune is not None)
        return real_run(self)

    walked: list[tuple[bool, str]] = []
    real_note = Search.note_walk

    def note(search: Search, stage: str, ok_seen: bool, any_check: bool) -> None:
        walked.append((search.prune is not None, stage))
        real_note(search, stage, ok_seen, any_check)

    monkeypatch.setattr(detect_mod, "run_search", run)
    monkeypatch.setattr(Search, "note_walk", note)
    new = detect(dump, setup_for(None))
    assert runs == [True, False] and not (seen and seen[0][2])
    # the pruned walk stops at the first stage that shows it cannot hold (rev5: it used to walk to
    # the end, so a mismatching dump paid for two whole searches); the unpruned one walks them all
    pruned = [st for p, st in walked if p]
    assert pruned[-1] == {"vf_loss": "value", "pg_loss": "policy"}[scale]
    assert pruned.count(pruned[-1]) == 1 and "loss" not in pruned
    assert "loss" in [st for p, st in walked if not p]
    assert new.n_detected == 0 and new.nearest is not None
    assert repr(vars(new)) == repr(vars(_unpruned(dump, setup_for(None), monkeypatch)))


def _value_loss_can_match(dump: Dump, returns: torch.Tensor, vm: torch.Tensor) -> bool:
    """Straight from the core's value_loss (whole batch, each aggregation by its own call)."""
    t, tol = dump.tensors, TOLERANCES[dump.dtype]
    for kind, form in (("clipped", "around_old"), ("clipped", "delta"), ("unclipped", "around_old")):
        for mask in (vm, dump.mask):
            for agg in MASK_AGGS:
                out = value_loss(
                    t["values"], t["old_values"], returns, mask, clip=0.2, kind=kind, agg=agg, clip_form=form
                )
                if compare("vf_loss", t["vf_loss"], out.loss, None, tol).ok:
                    return True
    return False


def test_the_whitening_walks_only_returns_a_value_loss_matches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every candidate the whitening stage expands has returns under which some value loss gives the
    dumped vf_loss (the unpruned walk expands every GAE candidate, most of which give none)."""
    dump = _dump(tmp_path, "trl", NO_RETURNS)
    walked: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = steps_mod.whiten_step

    def spy(s: Search, groups: list[Group[Any]]) -> list[Group[Any]]:
        walked.extend((g.state.carried.returns, g.state.carried.vm) for g in groups)
        return real(s, groups)

    monkeypatch.setattr(steps_mod, "whiten_step", spy)
    assert detect(dump, setup_for(None)).n_detected > 0
    assert walked
    assert all(_value_loss_can_match(dump, r, vm) for r, vm in walked)


def test_prune_held_reads_each_stage_first_walk() -> None:
    class S:
        walks: list[tuple[str, bool, bool]]

    s = cast(Search, S())  # a stub: prune_held reads only .walks
    ok = [("kl", True, True), ("advantages", False, False), ("policy", True, True), ("value", True, True)]
    s.walks = ok
    assert prune_mod.prune_held(s)
    # a solver walk matched the policy stage after the first failed: the pruned walk may differ
    s.walks = [*ok[:2], ("policy", False, True), ("policy", True, True), ok[3]]
    assert not prune_mod.prune_held(s)
    s.walks = [*ok[:3], ("value", False, True)]  # nothing passed the value stage
    assert not prune_mod.prune_held(s)
    s.walks = ok[:3]  # the value stage never ran
    assert not prune_mod.prune_held(s)
    s.walks = [ok[0], ("advantages", False, True), *ok[2:]]  # whitening checked, nothing passed
    assert not prune_mod.prune_held(s)


def test_no_pruning_without_a_value_loss_or_with_dumped_returns(tmp_path: Path) -> None:
    full = _dump(tmp_path, "trl", ())
    assert prune_mod.value_prune_for(Search(full, setup_for(None))) is None  # returns checked there
    d = refppo_dump(make_inputs(B=B, T=T, seed=5), setup_for("trl"), dtype=torch.float32)
    d = {k: v for k, v in d.items() if k not in (*NO_RETURNS, "vf_loss")}
    no_vf = load_dump(save(tmp_path, d, setup_for("trl"), name="novf.safetensors"))
    assert prune_mod.value_prune_for(Search(no_vf, setup_for(None))) is None
    assert prune_mod.value_prune_for(Search(_dump(tmp_path, "trl", NO_RETURNS), setup_for(None))) is not None
