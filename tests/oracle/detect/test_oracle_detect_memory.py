"""``--detect``'s memory levers (issue #9, "Scale"): each frees memory and changes no result.

Each test checks that the lever acts (it fails on the code before it) and that the detection equals
the one with the lever turned off, i.e. the code before it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from oracle_helpers import make_inputs, refppo_dump, save, setup_for

import refppo.oracle.detect.detection as detect_mod
import refppo.oracle.detect.search as search_mod
import refppo.oracle.detect.steps as steps_mod
from refppo.dump.load import Dump, load_dump
from refppo.oracle.check.settings import Setup
from refppo.oracle.detect.detection import Detection, detect
from refppo.oracle.detect.groups import Group


def _dump(tmp: Path) -> tuple[Dump, Setup]:
    made = setup_for(None, {"whiten_rewards": "masked"})  # a float32 dump outside the checked setting
    start = setup_for(None, {})
    import torch

    d = refppo_dump(make_inputs(B=8, T=16, seed=5), made, dtype=torch.float32)
    return load_dump(save(tmp, d, start)), start


def _fields(d: Detection) -> Any:
    return repr(vars(d))


def bt_fields(state: Any, prefix: str = "") -> set[str]:
    """The names of the tensors with more than one dimension a typed state holds (nested states
    included), e.g. ``{"adv", "carried.returns", "carried.vm"}``."""
    import dataclasses

    import torch

    out: set[str] = set()
    for f in dataclasses.fields(state):
        v = getattr(state, f.name)
        if isinstance(v, torch.Tensor) and v.dim() > 1:
            out.add(prefix + f.name)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            out |= bt_fields(v, f"{prefix}{f.name}.")
    return out


def test_compared_keys_are_released_after_each_walk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dump, start = _dump(tmp_path)
    assert {"kl", "token_rewards", "advantages", "returns"} <= set(dump.mapped)
    compared: list[str] = []
    released: list[str] = []
    real_ratio = search_mod.Search.ratio

    def ratio(self: search_mod.Search, name: str, *a: Any, **k: Any) -> float | None:
        compared.append(name)
        return real_ratio(self, name, *a, **k)

    def release(self: Dump, key: str) -> None:
        released.append(key)

    real_run = steps_mod.run_search
    by_search: list[str] = []

    def run(self: search_mod.Search) -> list[Group[Any]]:
        out = real_run(self)
        by_search.extend(released)  # the re-checks after the search release through check()
        assert not self.compared
        return out

    monkeypatch.setattr(search_mod.Search, "ratio", ratio)
    monkeypatch.setattr(detect_mod, "run_search", run)
    monkeypatch.setattr(Dump, "release", release)
    found = detect(dump, start)
    assert found.detected
    in_search = {k for k in compared if dump.has(k)}
    assert {"kl", "token_rewards", "advantages", "returns"} <= in_search
    assert in_search <= set(by_search)  # every compared key is handed back, not held to the end


def test_release_changes_no_detection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys of 32 KiB (B=16, T=512 float32: whole pages), so the release really calls madvise (a
    B=8, T=16 dump's 512-byte keys are below a page and were never released: the test could not fail)."""
    import torch

    import refppo.dump.residency as residency

    made = setup_for(None, {"whiten_rewards": "masked"})
    start = setup_for(None, {})
    d = refppo_dump(make_inputs(B=16, T=512, seed=5), made, dtype=torch.float32)
    dump = load_dump(save(tmp_path, d, start))
    calls: list[int] = []
    real = residency._madvise

    def counting() -> Any:
        fn = real()
        if fn is None:
            return None
        return lambda *a: (calls.append(1), fn(*a))[1]

    monkeypatch.setattr(residency, "_madvise", counting)
    with_release = detect(dump, start)
    if real() is not None:  # Linux: the pages were handed back
        assert calls, "the release never reached madvise"
    monkeypatch.setattr(Dump, "release", lambda self, key: None)  # the old path: pages kept
    assert _fields(detect(dump, start)) == _fields(with_release)


def test_policy_step_gets_no_rollout_only_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The policy step's input states hold the advantages, the returns and the value mask: no KL,
    token rewards or raw advantages (the old string-keyed states carried them to the policy stage)."""
    dump, start = _dump(tmp_path)
    seen: list[set[str]] = []
    real = steps_mod.policy_step

    def spy(search: Any, groups: list[Group[Any]]) -> list[Group[Any]]:
        seen.extend(bt_fields(g.state) for g in groups)
        return real(search, groups)

    monkeypatch.setattr(steps_mod, "policy_step", spy)
    detect(dump, start)
    assert seen
    for keys in seen:
        assert keys == {"adv", "carried.returns", "carried.vm"}, keys


def test_dropping_rollout_state_changes_no_detection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dump, start = _dump(tmp_path)
    dropped = detect(dump, start)
    monkeypatch.setattr(steps_mod, "drop_raw_advantages", lambda st: st)  # raw advantages kept
    assert _fields(detect(dump, start)) == _fields(dropped)


def test_search_states_are_freed_before_the_rechecks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dump, start = _dump(tmp_path)
    groups: list[Group[Any]] = []
    real_run = steps_mod.run_search

    def run(self: search_mod.Search) -> list[Group[Any]]:
        out = real_run(self)
        groups.extend(out)
        return out

    states_at_check: list[int] = []
    real_check = detect_mod.check

    def check(*a: Any, **k: Any) -> Any:
        states_at_check.append(sum(g.held or g.source is not None for g in groups))
        return real_check(*a, **k)

    monkeypatch.setattr(detect_mod, "run_search", run)
    monkeypatch.setattr(detect_mod, "check", check)
    found = detect(dump, start)
    assert found.detected and groups and states_at_check
    assert states_at_check == [0] * len(states_at_check)
