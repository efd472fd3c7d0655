"""``--detect`` screens a deferred option on a few rows before it makes it in full (issue #23 item 1;
refppo.oracle.detect.groups.Deferred, Search.screen_ratio): the screen only rules out options the
full check would drop, so the report is the one of the walk that makes every option."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle_helpers import make_inputs, refppo_dump, save, setup_for

import refppo.oracle.detect.groups as groups_mod
from refppo.dump.load import Dump, load_dump
from refppo.dump.tolerances import TOLERANCES
from refppo.oracle.check.compare import compare
from refppo.oracle.detect.detection import Detection, detect
from refppo.oracle.detect.search import Search

B, T = 12, 16
INTERMEDIATES = ("kl", "token_rewards", "advantages", "returns")


def _dump(tmp: Path, preset: str | None, seed: int, kind: str) -> Dump:
    """A float32 dump made under ``preset``; ``kind``: ``match`` (as made), ``noise`` (the
    advantages and returns perturbed: no convention makes them), ``noise_rewards`` (the token rewards
    too), ``no_rollout`` (no kl, token_rewards: the returns perturbed), ``losses`` (no intermediates)."""
    made = setup_for(preset)
    d = refppo_dump(make_inputs(B=B, T=T, seed=seed), made, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    noisy = {"noise": ("advantages", "returns"), "no_rollout": ("advantages", "returns")}
    noisy["noise_rewards"] = ("token_rewards", "advantages", "returns")
    for k in noisy.get(kind, ()):
        d[k] = d[k] + 0.01 * torch.randn(d[k].shape, generator=g, dtype=d[k].dtype)
    drop = {"no_rollout": ("kl", "token_rewards"), "losses": INTERMEDIATES}.get(kind, ())
    d = {k: v for k, v in d.items() if k not in drop}
    return load_dump(save(tmp, d, made, name=f"{preset}-{seed}-{kind}.safetensors"))


def _detect(dump: Dump, checked: str | None, screen: bool, mp: pytest.MonkeyPatch) -> tuple[Detection, int]:
    """The detection with the screen on or off, and the options the screen ruled out; each one is
    then made and checked in full (the returns check, by ``compare`` directly): it must fail, with a
    ratio at least the screen's bound."""
    ruled_out = 0
    real = groups_mod._Expansion.screened

    def spy(self: Any, d: Any) -> Any:
        nonlocal ruled_out
        out = real(self, d)
        if out is None:
            ruled_out += 1
            lower, _ = d.screen()
            state, _ = d.make()
            ca = state.carried
            full = compare("returns", dump.tensors["returns"], ca.returns, ca.vm, TOLERANCES[dump.dtype])
            assert not full.ok and full.max_abs_err / full.tol >= lower > 0
        return out

    with mp.context() as m:
        m.setattr(groups_mod, "SCREEN", screen)
        m.setattr(groups_mod._Expansion, "screened", spy)
        return detect(dump, setup_for(checked)), ruled_out


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    preset=st.sampled_from(["trl", "verl", "openrlhf", None]),
    checked=st.sampled_from(["trl", None]),
    seed=st.integers(0, 10_000),
    kind=st.sampled_from(["match", "noise", "noise_rewards", "no_rollout", "losses"]),
)
def test_screened_detection_equals_the_unscreened_one(
    preset: str | None,
    checked: str | None,
    seed: int,
    kind: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dump = _dump(tmp_path, preset, seed, kind)
    on, _ = _detect(dump, checked, True, monkeypatch)
    off, none_out = _detect(dump, checked, False, monkeypatch)
    assert none_out == 0
    assert repr(vars(on)) == repr(vars(off))


@pytest.mark.parametrize("kind", ["no_rollout", "noise_rewards"])
def test_the_screen_rules_out_options_and_the_report_is_unchanged(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On these dumps the returns step walks GAE options that the screen rules out (so the property
    above compares two different walks, not one walk with itself); each ruled-out option fails its
    full check (:func:`_detect`)."""
    dump = _dump(tmp_path, "trl", 3, kind)
    on, ruled_out = _detect(dump, None, True, monkeypatch)
    off, _ = _detect(dump, None, False, monkeypatch)
    assert ruled_out > 0
    assert repr(vars(on)) == repr(vars(off))
    assert on.n_detected == 0


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), scale=st.sampled_from([1e-6, 1e-4, 1e-3, 1e-1, 10.0]))
def test_screen_ratio_is_a_lower_bound_of_the_full_check(seed: int, scale: float, tmp_path: Path) -> None:
    """On random references, the screen's bound from a few rows never exceeds the full check's
    ratio, computed here by :func:`refppo.oracle.check.compare.compare` directly; when it is
    positive the full check fails."""
    dump = _dump(tmp_path, "trl", 0, "match")
    s = Search(dump, setup_for("trl"))
    g = torch.Generator().manual_seed(seed)
    dumped = dump.tensors["returns"]
    ref = dumped + scale * torch.randn(dumped.shape, generator=g, dtype=dumped.dtype)
    cmp = dump.mask
    rows = s.screen_rows
    assert rows is not None and 0 < rows.numel() < B
    lower = s.screen_ratio("returns", ref[rows], cmp[rows])
    full = compare("returns", dumped, ref, cmp, s.tol)
    ratio = 0.0 if full.ok else full.max_abs_err / full.tol
    assert lower <= ratio
    if lower > 0:
        assert not full.ok and math.isfinite(ratio)
