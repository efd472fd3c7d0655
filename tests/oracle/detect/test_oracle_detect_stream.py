"""``--detect`` in bounded memory (issue #9, "Scale"; refppo.oracle.detect.groups).

On a dump without the rollout's intermediates (no ``kl``, ``token_rewards``, ``advantages``,
``returns``) nothing prunes the rollout stages: the whitening stage ends with hundreds of groups.
The search must not hold a ``[B, T]`` state per group, and must return what the walk that held
every state and scored after merging returned (restated below as :func:`_walk_holding_all`).
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from oracle_helpers import make_inputs, refppo_dump, save, setup_for

import refppo.oracle.detect.detection as detect_mod
import refppo.oracle.detect.groups as groups_mod
import refppo.oracle.detect.search as search_mod
import refppo.oracle.detect.steps as steps_mod
from refppo.dump.load import Dump, load_dump
from refppo.oracle.check.settings import Setup
from refppo.oracle.detect.detection import Detection, detect
from refppo.oracle.detect.groups import Deferred, Group, Lazy
from refppo.oracle.detect.search import MAX_EQUIV, NEAREST, Search

B, T = 8, 16
INTERMEDIATES = ("kl", "token_rewards", "advantages", "returns")


def _dump(tmp: Path, made: Setup, *, losses_only: bool, name: str = "d.safetensors") -> Dump:
    d = refppo_dump(make_inputs(B=B, T=T, seed=3), made, dtype=torch.float32)
    if losses_only:
        d = {k: v for k, v in d.items() if k not in INTERMEDIATES}
    return load_dump(save(tmp, d, made, name=name))


def _walk_holding_all(
    self: Search, groups: list[Group[Any]], options: Any, checks: Any, stage: str
) -> list[Group[Any]]:
    """The old walk: every option's state made (a deferred one too) and held, merged, then every
    group scored; its walk is
    logged for the value-loss pruning (``note_walk``) as the streaming walk logs it, so both run
    the same pruned search (unlogged, the pruned search never holds and the old walk would hold
    every state of the unpruned one: 12 GB on the losses-only dump, the scale case of
    ``benchmarks/bench_detect_stream.py``)."""
    merged: dict[bytes, Group[Any]] = {}
    for g in groups:
        for upd, st, key in options(g):
            if isinstance(st, Deferred):  # made in full, never screened
                st, key = st.make()
            elif isinstance(st, Lazy):  # made at once
                st, key = st.made()
            new_convs = [{**c, **upd} for c in g.convs]
            if key in merged:
                tgt = merged[key]
                added = new_convs[: max(MAX_EQUIV - len(tgt.convs), 0)]
                tgt.convs.extend(added)
                tgt.marks.extend([()] * len(added))  # one per member, as groups._merge keeps them
                tgt.n_equiv += g.n_equiv
                tgt.worst = min(tgt.worst, g.worst)
                continue
            merged[key] = Group(new_convs, g.n_equiv, st, g.worst, list(g.unmatched))
    out = list(merged.values())
    scored = []
    any_check = False
    for g in out:
        ratios = [r for r in checks(g.state) if r is not None]
        any_check = any_check or bool(ratios)
        scored.append((max(ratios) if ratios else 0.0, g))
    self.release_compared()
    ok = [g for s, g in scored if s == 0.0]
    self.note_walk(stage, bool(ok), any_check)
    if not any_check:
        return out
    if ok:
        return ok
    self.unmatched.append(stage)
    scored.sort(key=lambda sg: max(sg[0], sg[1].worst))
    for s, g in scored[:NEAREST]:
        g.worst = max(g.worst, s)
        g.unmatched.append(stage)
    return [g for _, g in scored[:NEAREST]]


def _fields(d: Detection) -> str:
    return repr(vars(d))


CASES = {
    "losses_only_trl": ("trl", {}, True, "verl"),
    "full_openrlhf": ("openrlhf", {}, False, None),
    "full_trl_from_verl": ("trl", {}, False, "verl"),
    # nothing reproduces the whitening stage: its nearest groups go on (the nearest-first path)
    "full_unmatched": (None, {"whiten_advantages": "masked"}, False, None),
}
# a losses-only dump walks thousands of rollout candidates (tens of seconds per detection)
SLOW = pytest.mark.slow


@pytest.mark.parametrize("case", [pytest.param(c, marks=SLOW) if "losses" in c else c for c in sorted(CASES)])
def test_detection_equals_the_walk_that_holds_every_state(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    preset, conv, losses_only, checked = CASES[case]
    dump = _dump(tmp_path, setup_for(preset, conv), losses_only=losses_only)
    if case == "full_unmatched":  # advantages off by a factor no convention gives
        dump.tensors["advantages"] = dump.tensors["advantages"] * 1.37
    start = setup_for(checked)
    runs: list[str] = []
    real_run = steps_mod.run_search

    def run(self: Search) -> list[Group[Any]]:
        runs.append("pruned" if self.prune is not None else "unpruned")
        return real_run(self)

    monkeypatch.setattr(detect_mod, "run_search", run)
    new = detect(dump, start)
    n_new = len(runs)
    with monkeypatch.context() as mp:
        mp.setattr(Search, "expand", _walk_holding_all)
        old = detect(dump, start)
    assert _fields(new) == _fields(old)
    # the same searches: the hold-all walk never falls back to the unpruned search the streaming
    # walk did not need (its every state held: 12 GB on the losses-only dump)
    assert runs[n_new:] == runs[:n_new], runs
    if case == "full_unmatched":
        assert "advantages" in new.unmatched_stages and new.nearest is not None
    else:
        assert new.n_detected > 0


@pytest.mark.parametrize("checked", [None, "verl"])
def test_replayed_states_equal_held_ones(
    checked: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Holding no state (each one replayed) or every state gives the same detection."""
    dump = _dump(tmp_path, setup_for("trl"), losses_only=False)
    start = setup_for(checked)
    monkeypatch.setattr(groups_mod, "HOLD", 10**9)
    held = detect(dump, start)
    monkeypatch.setattr(groups_mod, "HOLD", 0)
    replayer_counts: list[int] = []
    real_run = steps_mod.run_search

    def run(self: Search) -> list[Group[Any]]:
        out = real_run(self)
        replayer_counts.append(self.replayer.replayed)
        return out

    monkeypatch.setattr(detect_mod, "run_search", run)
    replayed = detect(dump, start)
    assert replayer_counts and replayer_counts[0] > 0  # states were rebuilt, not held
    assert _fields(replayed) == _fields(held)


def _live_bt() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and tuple(o.shape) == (B, T))


@SLOW
def test_live_bt_tensors_stay_bounded_as_candidates_grow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the whitening stage of a losses-only dump (hundreds of groups), the process holds a
    bounded number of ``[B, T]`` tensors: not one or more per group (the old walk held thousands)."""
    dump = _dump(tmp_path, setup_for("trl"), losses_only=True)
    seen: list[tuple[int, int]] = []
    real = steps_mod.policy_step

    def spy(search: Search, groups: list[Group[Any]]) -> list[Group[Any]]:
        seen.append((len(groups), _live_bt()))
        return real(search, groups)

    monkeypatch.setattr(steps_mod, "policy_step", spy)
    # every candidate reaches the policy stage: without the value-loss pruning (search_prune)
    monkeypatch.setattr(detect_mod, "value_prune_for", lambda _s: None)
    found = detect(dump, setup_for(None))
    assert found.n_detected > 0 and seen
    n_groups, live = seen[0]
    assert n_groups >= 200  # the candidates: every rollout convention the losses cannot tell apart
    assert live <= 64, (n_groups, live)


def test_a_dropped_group_is_not_revived_by_a_later_option() -> None:
    """A failing group dropped once a group passes: a later option with its digest merges into
    nothing (it must not come back as a new group)."""

    class S:
        replayer = groups_mod.Replayer()
        unmatched: ClassVar[list[str]] = []
        walks: ClassVar[list[tuple[str, bool, bool]]] = []
        prune = None

        def release_compared(self) -> None:
            pass

        def note_walk(self, stage: str, ok_seen: bool, any_check: bool) -> None:
            self.walks.append((stage, ok_seen, any_check))

        def note_unmatched(self, stage: str) -> None:
            self.unmatched.append(stage)

    src: list[Group[dict[str, int]]] = [Group([{"a": i}], 1, {"i": i}) for i in range(3)]
    # option digests: group 0 -> x (fails), group 1 -> y (passes), group 2 -> x again
    keys = {0: b"x", 1: b"y", 2: b"x"}

    def options(g: Group[dict[str, int]]) -> Any:
        yield {"o": 1}, {"v": g.state["i"]}, keys[g.state["i"]]

    checked: list[int] = []

    def checks(st: dict[str, Any]) -> list[float | None]:
        checked.append(st["v"])
        return [0.0 if st["v"] == 1 else 2.0]

    out = groups_mod.expand_groups(S(), src, options, checks, "st", 3, 256)
    assert [g.convs for g in out] == [[{"a": 1, "o": 1}]]
    # group 2's option merged into the dropped digest and was never scored again (a revived group
    # is scored a third time, then dropped: the output alone cannot tell)
    assert checked == [0, 1]
    assert search_mod.NEAREST == 3
