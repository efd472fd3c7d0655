"""#23 item 2: a solved constant says how many dumped observations fix it, and the keys a dump leaves
open say what to dump to test them (``refppo.oracle.detect.evidence``, derived from the stage table).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from oracle_helpers import HP, make_inputs, naive_dump, setup_for

from refppo.dump.load import load_dump
from refppo.dump.write import write_dump
from refppo.oracle.cli import main
from refppo.oracle.detect.evidence import DETERMINED, FIT, OPEN, class_evidence, evidence, pinned_by

INPUTS = ("response_mask", "old_logprobs", "ref_logprobs", "old_values", "scores", "logprobs", "values")


def test_pinned_by_follows_the_ppo_equations() -> None:
    # written from the equations (spec/ppo.md): ε enters the clipped surrogate, its clip fraction, the
    # total and the policy gradient, never the KL, rewards, advantages, the value terms or approx_kl
    assert pinned_by("cliprange") == ("pg_loss", "pg_clipfrac", "loss", "grad_logprobs")
    assert pinned_by("cliprange_value") == ("vf_loss", "vf_clipfrac", "loss", "grad_values")
    # the score slot moves the rewards and everything built on them, not the KL, approx_kl, the
    # entropy or the KL loss
    assert pinned_by("score_at") == (
        "token_rewards", "advantages", "returns", "pg_loss", "pg_clipfrac", "vf_loss", "vf_clipfrac",
        "loss", "grad_logprobs", "grad_values",
    )  # fmt: skip
    assert pinned_by("kl_value_clamp")[0] == "kl" and "approx_kl" not in pinned_by("kl_value_clamp")


def _dump(tmp_path: Path, keep: tuple[str, ...]) -> Path:
    """A step made by the naive twins with ε = 0.1 whose sidecar says ε = 0.2 (HP): the policy
    step's solver reads a clip range off ``pg_loss``."""
    d = naive_dump(make_inputs(B=6, T=12, seed=1), setup_for(hp={"cliprange": 0.1}))
    path = tmp_path / "s.safetensors"
    write_dump(path, {k: v for k, v in d.items() if k in (*INPUTS, *keep)}, hparams=dict(HP))
    return path


def test_a_clip_range_solved_from_one_scalar_is_called_a_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _dump(tmp_path, ("kl", "token_rewards", "advantages", "returns", "pg_loss"))
    main([str(path), "--detect", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rep["detected_count"] > 0, rep.get("diagnosis")
    solved = rep["solved"]
    assert solved, "the search solved no constant: the test needs one"
    for key in solved:
        ev = rep["evidence"][key]
        assert ev["from"] == {"pg_loss": 1} and ev["observations"] == 1, (key, ev)
        assert ev["determined"] is False
        assert "grad_logprobs" in ev["to_pin_it_dump"]
    main([str(path), "--detect"])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("  solved "))
    assert "1 observation(s) (pg_loss: 1 scalar)" in line, line
    assert ("underdetermined" in line) or ("a fit, not a test" in line), line
    # dual_clip acts on the clipped surrogate (its clip fraction next); score_clip only through the
    # token rewards, which are dumped and match: no further output can tell its options apart
    assert "pg_clipfrac (dual_clip, log_ratio_clamp)" in out, out
    assert "every output score_clip can change is dumped and agrees" in out, out


def test_evidence_counts_tokens_and_calls_determined_only_above_the_free_parameters(tmp_path: Path) -> None:
    d = naive_dump(make_inputs(B=6, T=12, seed=1), setup_for())
    path = tmp_path / "g.safetensors"
    d["grad_logprobs"] = torch.zeros_like(d["logprobs"])
    write_dump(
        path, {k: v for k, v in d.items() if k in (*INPUTS, "pg_loss", "grad_logprobs")}, hparams=dict(HP)
    )
    dump = load_dump(path)
    n_tok = int(dump.mask.sum())
    [one] = evidence(dump, [], {"cliprange": [0.25]})
    assert one.dumped == {"pg_loss": 1, "grad_logprobs": n_tok} and one.n == 1 + n_tok
    assert one.free == 1 and one.determined
    two = evidence(dump, [], {"cliprange": [0.25, 0.3]})[0]
    assert not two.determined and "2 values reproduce the dump" in two.text()
    # two constants on pg_loss alone: two unknowns, one equation
    scalar = tmp_path / "p.safetensors"
    write_dump(scalar, {k: v for k, v in d.items() if k in (*INPUTS, "pg_loss")}, hparams=dict(HP))
    evs = evidence(load_dump(scalar), [], {"cliprange": [0.25], "dual_clip": [3.0]})
    assert all(e.free == 2 and e.n == 1 and not e.determined for e in evs)
    assert all("underdetermined" in e.text() for e in evs)
    walked = evidence(load_dump(scalar), ["score_at"], {})[0]
    assert walked.free == 0 and not walked.determined and walked.missing[0] == "token_rewards"


def test_free_parameters_are_counted_per_class(tmp_path: Path) -> None:
    """#23 item 2: two classes on one scalar ``pg_loss``, one fitting ``cliprange`` and ``dual_clip``
    (two unknowns, one equation: underdetermined), the other ``cliprange`` alone (one equation for
    one constant: a fit). Counted across every solved constant (the old count) both were "2 free"."""
    d = naive_dump(make_inputs(B=6, T=12, seed=1), setup_for())
    scalar = tmp_path / "p.safetensors"
    write_dump(scalar, {k: v for k, v in d.items() if k in (*INPUTS, "pg_loss")}, hparams=dict(HP))
    dump = load_dump(scalar)
    solved = {"cliprange": [0.25], "dual_clip": [3.0]}
    both = {"cliprange": 0.25, "dual_clip": 3.0}
    clip_only = {"cliprange": 0.25, "dual_clip": None}
    a = {e.key: e for e in class_evidence(dump, both, {}, solved)}
    b = {e.key: e for e in class_evidence(dump, clip_only, {}, solved)}
    assert set(a) == {"cliprange", "dual_clip"} and set(b) == {"cliprange"}
    assert all(e.free == 2 and e.n == 1 and e.label == OPEN for e in a.values())
    assert "underdetermined" in a["cliprange"].text()
    assert b["cliprange"].free == 1 and b["cliprange"].label == FIT
    # the summary counts each constant in the classes that use it (the largest count), not globally
    dual_only = {"cliprange": None, "dual_clip": 3.0}
    split = {e.key: e for e in evidence(dump, [], solved, [(clip_only, {}), (dual_only, {})])}
    assert split["cliprange"].free == 1 and split["dual_clip"].free == 1
    assert split["cliprange"].label == FIT
    joint = {e.key: e for e in evidence(dump, [], solved, [(clip_only, {}), (both, {})])}
    assert joint["cliprange"].free == 2 and joint["dual_clip"].free == 2
    # a class whose members take two values of a constant: not determined even with many observations
    g = tmp_path / "g.safetensors"
    d["grad_logprobs"] = torch.zeros_like(d["logprobs"])
    write_dump(
        g, {k: v for k, v in d.items() if k in (*INPUTS, "pg_loss", "grad_logprobs")}, hparams=dict(HP)
    )
    gd = load_dump(g)
    [one] = class_evidence(gd, clip_only, {}, solved)
    assert one.label == DETERMINED
    [two] = class_evidence(gd, clip_only, {"cliprange": [0.25, 0.3]}, {"cliprange": [0.25, 0.3]})
    assert two.values == 2 and two.label == OPEN


def test_a_mask_bound_is_never_called_determined(tmp_path: Path) -> None:
    """A correction bound under ``rollout_is_mode=mask`` keeps or drops tokens: every value between
    two observed weights gives the same step, so with many observations and one value it is still
    an interval (truncation: the same cap is determined)."""
    d = naive_dump(make_inputs(B=6, T=12, seed=1), setup_for())
    d["grad_logprobs"] = torch.zeros_like(d["logprobs"])
    g = tmp_path / "g.safetensors"
    write_dump(
        g, {k: v for k, v in d.items() if k in (*INPUTS, "pg_loss", "grad_logprobs")}, hparams=dict(HP)
    )
    dump = load_dump(g)
    solved = {"rollout_is_high": [4.0]}
    [mask] = class_evidence(dump, {"rollout_is_mode": "mask", "rollout_is_high": 4.0}, {}, solved)
    [trunc] = class_evidence(dump, {"rollout_is_mode": "truncate", "rollout_is_high": 4.0}, {}, solved)
    assert mask.interval and mask.label == OPEN and "interval" in mask.text()
    assert not trunc.interval and trunc.label == DETERMINED
    [summary] = evidence(dump, [], solved, [({"rollout_is_mode": "mask", "rollout_is_high": 4.0}, {})])
    assert summary.interval and not summary.determined
    # a class whose representative is the cap 4 and whose other member is the band [0.2, 5]: the
    # lower bound 0.2 is used by the class (a member's value) and is a mask bound too
    band = {"rollout_is_low": [0.2], "rollout_is_high": [4.0, 5.0]}
    rep = {"rollout_is_mode": "mask", "rollout_is_low": None, "rollout_is_high": 4.0}
    diff = {"rollout_is_low": [None, 0.2], "rollout_is_high": [4.0, 5.0]}
    got = {e.key: e for e in evidence(dump, [], band, [(rep, diff)])}
    assert got["rollout_is_low"].interval and got["rollout_is_low"].label == OPEN


def test_a_gate_threshold_is_never_called_determined(tmp_path: Path) -> None:
    """A rejection gate's threshold (``rollout_rs_low``/``rollout_rs_high`` with ``rollout_rs`` on)
    keeps or drops tokens whatever ``rollout_is_mode``: one value and many observations is still an
    interval, labelled as a gate threshold (issue #22: AReaL's sequence ratio veto)."""
    d = naive_dump(make_inputs(B=6, T=12, seed=1), setup_for())
    d["grad_logprobs"] = torch.zeros_like(d["logprobs"])
    g = tmp_path / "g.safetensors"
    write_dump(
        g, {k: v for k, v in d.items() if k in (*INPUTS, "pg_loss", "grad_logprobs")}, hparams=dict(HP)
    )
    dump = load_dump(g)
    solved = {"rollout_rs_high": [3.0]}
    gate = {"rollout_is_mode": "truncate", "rollout_rs": "sequence", "rollout_rs_high": 3.0}
    [one] = class_evidence(dump, gate, {}, solved)
    assert one.n > one.free == 1 and one.values == 1
    assert one.interval and one.label == OPEN and "gate threshold" in one.text()
    [summary] = evidence(dump, [], solved, [(gate, {})])
    assert summary.interval and not summary.determined
    # a class one of whose members has the gate off still uses the threshold of those with it on
    [mixed] = class_evidence(dump, {**gate, "rollout_rs": None}, {"rollout_rs": [None, "token"]}, solved)
    assert mixed.interval
