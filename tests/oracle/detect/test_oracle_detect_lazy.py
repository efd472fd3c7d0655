"""``--detect``'s reward options are :class:`refppo.oracle.detect.groups.Lazy` (issue #23 item 1):
a replay of the reward walk (the returns step rebuilds the reward groups' states, once per walk)
makes only the options it rebuilds, and one option's raw rewards are shared by its reward whitening
options. With ``LAZY`` off every option is made as it is yielded, from its own raw rewards (the
walk before the change): the two detections must be the same, byte for byte."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle_helpers import make_inputs, refppo_dump, save, setup_for

import refppo.oracle.detect.groups as groups_mod
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


def _detect(dump: Dump, checked: str | None, lazy: bool, mp: pytest.MonkeyPatch) -> tuple[Detection, int]:
    """The detection with ``LAZY`` on or off, and how many reward whitenings it evaluated."""
    n = 0
    real = Search.evaluate

    def count(self: Search, stage: str, *a: Any, **k: Any) -> Any:
        nonlocal n
        n += stage == "reward_whitening"
        return real(self, stage, *a, **k)

    with mp.context() as m:
        m.setattr(groups_mod, "LAZY", lazy)
        m.setattr(Search, "evaluate", count)
        return detect(dump, setup_for(checked)), n


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    preset=st.sampled_from(["trl", "verl", "openrlhf", None]),
    checked=st.sampled_from(["trl", None]),
    seed=st.integers(0, 10_000),
    kind=st.sampled_from(["match", "noise", "no_rollout", "losses"]),
)
def test_lazy_detection_equals_the_eager_one(
    preset: str | None,
    checked: str | None,
    seed: int,
    kind: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dump = _dump(tmp_path, preset, seed, kind)
    on, n_on = _detect(dump, checked, True, monkeypatch)
    off, n_off = _detect(dump, checked, False, monkeypatch)
    assert n_on <= n_off
    assert repr(vars(on)) == repr(vars(off))


def test_lazy_replay_makes_fewer_reward_options_and_the_report_is_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a dump without kl and token_rewards every reward option reaches the returns step, which
    replays the reward groups: the lazy walk evaluates fewer reward whitenings (so the property
    above compares two different walks, not one walk with itself)."""
    dump = _dump(tmp_path, "trl", 3, "no_rollout")
    on, n_on = _detect(dump, None, True, monkeypatch)
    off, n_off = _detect(dump, None, False, monkeypatch)
    assert 0 < n_on < n_off
    assert repr(vars(on)) == repr(vars(off))
    assert on.n_detected == 0
