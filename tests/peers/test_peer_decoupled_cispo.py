"""The peers' decoupled PPO, CISPO and rollout IS steps through ``refppo diff`` and ``--detect`` (issue #22).

Each maker runs the peer's own installed code in its side venv (skipped with the reason without it)
and writes v2 step dumps (``grad_logprobs`` by autograd through the peer's function):

- :mod:`peers.makers.areal_decoupled`: AReaL 1.0.4 ``ppo_actor_loss_fn`` with ``proximal_logprobs``
  and the engine's ``old_logprobs`` (``use_decoupled_loss``), ``rejection_sampling`` token mask cap 5,
  token clamp 2, token band [0.5, 2], sequence (geometric) band [0.7, 1.4];
- :mod:`peers.makers.cispo`: verl 0.9.1 ``compute_policy_loss_cispo`` (two clip ranges, one with
  verl's TIS weight);
- :mod:`peers.makers.skyrl_tis`: SkyRL-train 0.3.1 ``ppo_policy_loss`` with ``use_tis`` (regular and
  dual-clip) and ``compute_policy_loss_cispo``;
- :mod:`peers.makers.trl_is`: TRL 1.16.0 GRPOTrainer's four ``vllm_importance_sampling_mode`` values.

Each dump must match under its preset plus its ``--set`` (max abs error printed and bounded), the
control (one key flipped) must mismatch (AReaL's: also ``pg_clipfrac``, its logged ``clip_ratio``,
under ``clipfrac_counts=kept``, whose control ``all`` must mismatch at ``pg_clipfrac`` where a
rejected token is clipped), and ``--detect`` from refppo's defaults must list the
generating surrogate and correction family (``policy_loss``, ``rollout_is``, ``rollout_is_agg``,
``rollout_is_mode``, ``rollout_rs``) on the v2 dump itself, each listed entry of that family re-checked,
and must not list the control's family. A gate is part of the family: the unbounded token weight
truncated nowhere times a token ratio gate ``[L, H]`` is the same computation as ``rollout_is_mode=mask``
with ``[L, H]`` (AReaL's mask band), so ``--detect`` lists both, and the gated entry is neither the
generating family nor the control's (``truncate`` with no gate).
(Until the caps were read off the gradient, five of these v2 dumps listed
nothing: caps fitted to ``pg_loss`` alone failed the gradient re-check; issue #22 item 6.)
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from _peers import REPO, TOOLS, require

from refppo.dump.load import load_dump
from refppo.oracle.check.diagnose import check
from refppo.oracle.detect.detection import detect, setup_from_json

MAKERS: dict[str, tuple[str, str, str, int]] = {
    # unit: (venv, maker module, preset, cases)
    "areal": ("skyrl-areal", "areal_decoupled", "areal", 4),
    "verl": ("verl-openrlhf", "cispo", "verl", 3),
    "skyrl": ("skyrl-areal", "skyrl_tis", "skyrl", 4),
    "trl": ("trl-grpo", "trl_is", "trl", 4),
}
FAMILY = ("policy_loss", "rollout_is", "rollout_is_agg", "rollout_is_mode", "rollout_rs")
MAX_ERR = 1e-5


def _family(conv: dict[str, Any]) -> tuple[Any, ...]:
    defaults = {
        "policy_loss": "vanilla",
        "rollout_is": None,
        "rollout_is_agg": "product",
        "rollout_is_mode": "truncate",
        "rollout_rs": None,
    }
    return tuple(conv.get(k, defaults[k]) for k in FAMILY)


def _made(tmp: Path, unit: str) -> tuple[list[str], str]:
    venv, module, preset, n_cases = MAKERS[unit]
    py = require(venv)
    code = f"import sys, pathlib; from peers.makers.{module} import make; make(pathlib.Path(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": str(TOOLS)}
    subprocess.run([str(py), "-c", code, str(tmp)], check=True, cwd=REPO, env=env, timeout=600)
    names = sorted(p.name.removesuffix(".set.json") for p in tmp.glob("*.set.json"))
    assert len(names) == n_cases, names
    return names, preset


CLIP_RATIO_ALL_SAME = {"areal_decoupled_token_clamp_2"}
"""AReaL dumps whose logged ``clip_ratio`` equals the default count (``clamp`` keeps every token)."""


def _areal_clip_ratio(dump: Any, expected: Any, n: str) -> None:
    """AReaL's logged ``clip_ratio`` (``pg_clipfrac``) is compared under ``clipfrac_counts=kept``
    (the preset's); the default count (``all``: the rejected tokens' clips too) mismatches at
    ``pg_clipfrac`` wherever a rejected token is clipped."""
    assert expected.conv.policy.clipfrac_counts.value == "kept", n
    flat = {k: getattr(v, "value", v) for k, v in expected.convention_dict().items()}
    ctl = check(dump, setup_from_json(expected, {**flat, "clipfrac_counts": "all"}), explain_divergence=False)
    err = ctl.quantities["pg_clipfrac"].max_abs_err
    print(f"{n}: pg_clipfrac (clip_ratio) control clipfrac_counts=all: abs error {err:.3g}")
    if n in CLIP_RATIO_ALL_SAME:
        assert ctl.match, n
    else:
        assert not ctl.match and ctl.first_divergence == "pg_clipfrac", (n, ctl.first_divergence)


KEPT_DETECTED = "areal_decoupled_token_mask_cap5"
"""The AReaL dump ``--detect`` also walks from ``clipfrac_counts=all`` (one: each walk costs)."""


def _detect_kept(dump: Any, base: Any, n: str) -> None:
    """``--detect`` from the preset with ``clipfrac_counts=all`` on AReaL's own step: every listed
    convention names ``kept`` (issue #23 item 5; before, the walk kept the checked ``all``)."""
    flat = {k: getattr(v, "value", v) for k, v in base.convention_dict().items()}
    det = detect(dump, setup_from_json(base, {**flat, "clipfrac_counts": "all"}), limit=100000)
    assert det.detected, (n, det.unmatched_stages, det.nearest)
    assert {e["clipfrac_counts"] for e in det.detected} == {"kept"}, n
    print(f"{n}: --detect from clipfrac_counts=all lists {len(det.detected)} entries, all kept")


@pytest.mark.parametrize("unit", list(MAKERS))
def test_the_peers_steps_match_their_convention_and_detect_lists_it(
    tmp_path: Path, unit: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(TOOLS))
    from peers.checks import dump_file
    from peers.detect import _setups

    names, preset = _made(tmp_path, unit)
    for n in names:
        conv = json.loads((tmp_path / f"{n}.set.json").read_text())
        dump = load_dump(dump_file(tmp_path, n))
        expected, base = _setups(dump, preset, conv)
        res = check(dump, expected, explain_divergence=False)
        assert res.match and "grad_logprobs" in res.quantities, (n, res.first_divergence)
        assert unit != "areal" or "pg_clipfrac" in res.quantities, n  # AReaL's clip_ratio
        err = max(q.max_abs_err for q in res.quantities.values())
        print(f"{n}: match, max abs error {err:.2e}")
        assert err < MAX_ERR, (n, err)
        flip = json.loads((tmp_path / f"{n}.control.json").read_text())
        trial = {**{k: getattr(v, "value", v) for k, v in expected.convention_dict().items()}, **flip}
        assert not check(dump, setup_from_json(expected, trial), explain_divergence=False).match, n
        if unit == "areal":
            _areal_clip_ratio(dump, expected, n)
            if n == KEPT_DETECTED:
                _detect_kept(dump, base, n)
        want, unwanted = _family(conv), _family({**conv, **flip})
        det = detect(dump, base, limit=100000)
        listed = [e for e in det.detected if _family(e) == want]
        assert listed, (n, want, det.detected[:3])
        assert not [e for e in det.detected if _family(e) == unwanted], (n, unwanted)
        print(f"{n}: --detect lists {len(listed)} of the family, none of the control's")
        for e in listed[:3]:
            assert check(dump, setup_from_json(base, e), explain_divergence=False).match, (n, e)
