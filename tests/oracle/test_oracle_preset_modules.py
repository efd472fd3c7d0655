"""The presets: one module per peer under ``refppo/oracle/presets/``, every value with its source,
the registry derived from the modules, and the contents exactly those of the table they replaced.

``fixtures/presets_snapshot.json`` was written by :func:`snapshot` from the presets as they stood
at commit 5511172 (``refppo/oracle/presets/table_a.py``, ``table_b.py``, ``base.py``,
``critic_free.py``; the variants were ``critic_free.VARIANTS`` then, ``registry.VARIANTS`` now):
each preset's convention and hyperparameter items in order, its ``sources``, its KL clamps for
every estimator, :func:`resolve_preset` for every advantage estimator under the preset's own KL
estimator, ``k1``, ``k3`` and ``k3+`` (or the one-line refusal), and every critic-free variant's
items with their sources. Python types are kept apart (a tuple, an int and a float are tagged), so
``3`` and ``3.0`` differ.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from refppo.conventions import AdvantageEstimator, KLEstimator
from refppo.errors import ConventionError
from refppo.oracle.presets import registry

FIXTURE = Path(__file__).parent / "fixtures" / "presets_snapshot.json"
ORDER = [
    "refppo",
    "verl",
    "openrlhf",
    "trl",
    "deepspeed-chat",
    "skyrl",
    "areal",
    "torchtune",
    "trinity",
    "oat",
    "rlinf",
    "skyrl04",
]
ADDED = ["torchtune", "trinity", "oat", "rlinf", "skyrl04"]
"""Presets added after the snapshot (appended to the order; their values are checked by their peer
tests, e.g. tests/peers/test_peer_torchtune.py, test_peer_oat.py, test_peer_rlinf.py,
test_peer_skyrl04.py)."""


def _tag(v: Any) -> Any:
    """A JSON form that keeps the Python type: tuples, bools, ints and floats are told apart."""
    if isinstance(v, tuple):
        return {"tuple": [_tag(x) for x in v]}
    if isinstance(v, list):
        return {"list": [_tag(x) for x in v]}
    if isinstance(v, dict):
        return {"dict": [[k, _tag(x)] for k, x in v.items()]}
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, int):
        return {"int": v}
    if isinstance(v, float):
        return {"float": repr(v)}
    return {type(v).__name__: str(v)}


def snapshot() -> dict[str, Any]:
    """Everything the presets say, through their public names (the same names before and after)."""
    estimators = [e.value for e in KLEstimator]
    advantages = [None, *(a.value for a in AdvantageEstimator)]
    out: dict[str, Any] = {"order": list(registry.PRESETS), "peers": list(registry.PEER_PRESETS)}
    for name, p in registry.PRESETS.items():
        resolved = {}
        for est in (None, "k1", "k3", "k3+"):  # the preset's own, a plain one, a clamped one, "+"
            for adv in advantages:
                try:
                    got: Any = _tag(registry.resolve_preset(name, est, adv))
                except ConventionError as exc:
                    got = f"ConventionError: {exc}"
                resolved[f"{est}/{adv}"] = got
        out[name] = {
            "name": p.name,
            "conventions": _tag(p.conventions),
            "hparams": _tag(p.hparams),
            "sources": list(p.sources),
            "kl_clamps": {e: _tag(p.kl_clamps(e)) for e in estimators},
            "resolved": resolved,
        }
    out["variants"] = {
        peer: {adv: _tag(items) for adv, items in ests.items()}
        for peer, ests in sorted(registry.VARIANTS.items())
    }
    return out


def test_the_presets_are_exactly_those_of_the_old_table() -> None:
    want = json.loads(FIXTURE.read_text())
    got = json.loads(json.dumps(snapshot()))
    assert got["order"] == want["order"] + ADDED and got["peers"] == want["peers"] + ADDED
    for name in want["order"]:
        for part in ("name", "conventions", "hparams", "sources", "kl_clamps", "resolved"):
            assert got[name][part] == want[name][part], (name, part)
    got["variants"] = {k: v for k, v in got["variants"].items() if k not in ADDED}
    assert {k: v for k, v in got.items() if k not in ADDED} == {
        **want,
        "order": got["order"],
        "peers": got["peers"],
    }


def test_the_registry_order_is_pinned_and_read_by_the_help() -> None:
    assert list(registry.PRESETS) == ORDER
    assert list(registry.PEER_PRESETS) == ORDER[1:]
    from refppo.oracle.cli import build_parser

    assert "a peer's conventions: " + ", ".join(ORDER) in " ".join(build_parser().format_help().split())


def test_the_registry_is_the_peer_modules() -> None:
    """One module per preset, each holding its PRESET (and its critic-free variants, if any)."""
    mods = registry.PRESET_MODULES
    assert [m.PRESET.name for m in mods] == ORDER
    assert [m.__name__.rsplit(".", 1)[1] for m in mods] == [n.replace("-", "_") for n in ORDER]
    assert all(registry.PRESETS[m.PRESET.name] is m.PRESET for m in mods)
    have = {m.PRESET.name: getattr(m, "CRITIC_FREE", {}) for m in mods}
    assert {k: v for k, v in have.items() if v} == registry.VARIANTS
    assert list(registry.VARIANTS) == [n for n in ORDER if have[n]]


@pytest.mark.parametrize("name", ORDER)
def test_every_value_carries_a_source(name: str) -> None:
    """Each convention and hyperparameter of a preset, and each field of its variants, names where
    it comes from: a file of the peer's repository and (most) a function or config key."""
    p = registry.PRESETS[name]
    keys = [*p.conventions, *p.hparams]
    assert sorted(p.value_sources) == sorted(keys)
    for k in keys:
        src = p.value_sources[k]
        assert isinstance(src, str) and len(src) > 10 and ("/" in src or "::" in src), (name, k, src)
    for adv, items in registry.VARIANTS.get(name, {}).items():
        for k, (_, src) in items.items():
            assert "/" in src and len(src) > 10, (name, adv, k, src)


def test_one_home_for_the_kl_clamp_bundles() -> None:
    """The bundles ``--detect`` and the diagnosis try are the presets' own clamp rules' outputs."""
    from refppo.oracle.check import alternatives
    from refppo.oracle.presets.kl_clamps import CLAMP_BUNDLES

    assert alternatives.CLAMP_BUNDLES == CLAMP_BUNDLES
    made = {
        tuple(sorted(registry.PRESETS[n].kl_clamps(e).items()))
        for n in ORDER
        for e in ("k1", "k2", "k3", "abs")
    }
    assert made == {tuple(sorted(b.items())) for b in CLAMP_BUNDLES.values()}
