"""``--detect``'s reward whitening options of one raw reward share its batch moments and their
bit-identical outputs (:mod:`refppo.oracle.detect.reward_options`, :mod:`refppo.core.moments_memo`;
issue #23 item 1). With ``MEMO`` off each option computes its moments and output alone (the walk
before the change): the two detections must be the same, byte for byte."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle_helpers import make_inputs, refppo_dump, save, setup_for

import refppo.core.normalize as normalize_mod
import refppo.oracle.detect.estimator as estimator_mod
import refppo.oracle.detect.reward_options as ro
import refppo.oracle.detect.rollout as rollout_mod
from refppo.dump.load import Dump, load_dump
from refppo.oracle.detect.detection import Detection, detect
from refppo.oracle.detect.search import Search

B, T = 12, 16
INTERMEDIATES = ("kl", "token_rewards", "advantages", "returns")


def _dump(tmp: Path, preset: str | None, seed: int, kind: str) -> Dump:
    """A float32 dump made under ``preset``; ``kind``: ``match`` (as made), ``noise`` (advantages and
    returns perturbed), ``no_rollout`` (that, without kl and token_rewards), ``losses`` (no
    intermediates)."""
    made = setup_for(preset)
    d = refppo_dump(make_inputs(B=B, T=T, seed=seed), made, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    if kind in ("noise", "no_rollout"):
        for k in ("advantages", "returns"):
            d[k] = d[k] + 0.01 * torch.randn(d[k].shape, generator=g, dtype=d[k].dtype)
    drop = {"no_rollout": ("kl", "token_rewards"), "losses": INTERMEDIATES}.get(kind, ())
    d = {k: v for k, v in d.items() if k not in drop}
    return load_dump(save(tmp, d, made, name=f"{preset}-{seed}-{kind}.safetensors"))


def _detect(
    dump: Dump, checked: str | None, memo: bool, mp: pytest.MonkeyPatch
) -> tuple[Detection, int, list[bytes]]:
    """The detection with ``MEMO`` on or off, how many whitened outputs it computed and the digest
    of every reward option made, in order (content digests: the same outputs, the same list)."""
    n = 0
    real = normalize_mod._output
    keys: list[bytes] = []

    def key(st: Any) -> bytes:
        keys.append(ro.reward_key(st))
        return keys[-1]

    def count(*a: Any, **k: Any) -> Any:
        nonlocal n
        inner = a[-1]

        def counted() -> Any:
            nonlocal n
            n += 1
            return inner()

        return real(*a[:-1], counted, **k)

    with mp.context() as m:
        m.setattr(ro, "MEMO", memo)
        m.setattr(normalize_mod, "_output", count)
        m.setattr(rollout_mod, "reward_key", key)
        return detect(dump, setup_for(checked)), n, keys


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    preset=st.sampled_from(["trl", "verl", "openrlhf", None]),
    checked=st.sampled_from(["trl", None]),
    seed=st.integers(0, 10_000),
    kind=st.sampled_from(["match", "noise", "no_rollout", "losses"]),
)
def test_the_shared_moments_detection_equals_the_unshared_one(
    preset: str | None,
    checked: str | None,
    seed: int,
    kind: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dump = _dump(tmp_path, preset, seed, kind)
    on, n_on, k_on = _detect(dump, checked, True, monkeypatch)
    off, n_off, k_off = _detect(dump, checked, False, monkeypatch)
    assert n_on <= n_off
    assert k_on == k_off
    assert repr(vars(on)) == repr(vars(off))


def test_the_memo_shares_outputs_and_the_report_is_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a dump without kl and token_rewards every reward whitening option is walked: the memo
    computes fewer whitened outputs (so the property above compares two different walks)."""
    dump = _dump(tmp_path, "trl", 3, "no_rollout")
    on, n_on, k_on = _detect(dump, None, True, monkeypatch)
    off, n_off, k_off = _detect(dump, None, False, monkeypatch)
    assert 0 < n_on < 0.8 * n_off
    assert len(k_on) > 100 and k_on == k_off
    assert repr(vars(on)) == repr(vars(off))
    assert on.n_detected == 0


def _detect_ahead(
    dump: Dump, checked: str | None, ahead: bool, mp: pytest.MonkeyPatch
) -> tuple[Detection, int]:
    """The detection with ``SCREEN_AHEAD`` on or off, and how many reward whitenings it evaluated
    (each rewards group read by the returns step is a replay of the reward walk)."""
    n = 0
    real = Search.evaluate

    def count(self: Search, stage: str, *a: Any, **k: Any) -> Any:
        nonlocal n
        n += stage == "reward_whitening"
        return real(self, stage, *a, **k)

    with mp.context() as m:
        m.setattr(estimator_mod, "SCREEN_AHEAD", ahead)
        m.setattr(Search, "evaluate", count)
        return detect(dump, setup_for(checked)), n


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    preset=st.sampled_from(["trl", "verl", "openrlhf", None]),
    checked=st.sampled_from(["trl", None]),
    seed=st.integers(0, 10_000),
    kind=st.sampled_from(["match", "noise", "no_rollout"]),
)
def test_screening_every_padding_ahead_equals_screening_each_walk(
    preset: str | None,
    checked: str | None,
    seed: int,
    kind: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GAE step's screens kept for its solver walk (:class:`refppo.oracle.detect.estimator.Screens`)
    give the detection that screens each walk's options afresh."""
    dump = _dump(tmp_path, preset, seed, kind)
    on, _ = _detect_ahead(dump, checked, True, monkeypatch)
    off, _ = _detect_ahead(dump, checked, False, monkeypatch)
    assert repr(vars(on)) == repr(vars(off))


def test_screening_ahead_replays_fewer_reward_groups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a dump without kl and token_rewards whose returns nothing reproduces, the solver walk of
    the returns step reads the kept screens instead of replaying every rewards group."""
    dump = _dump(tmp_path, "trl", 3, "no_rollout")
    on, n_on = _detect_ahead(dump, None, True, monkeypatch)
    off, n_off = _detect_ahead(dump, None, False, monkeypatch)
    assert 0 < n_on < 0.9 * n_off
    assert repr(vars(on)) == repr(vars(off))
