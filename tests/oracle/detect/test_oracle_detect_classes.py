"""#23 item 2: ``--detect`` groups the conventions it lists into classes the dump cannot tell apart,
and labels what one equation fixes (:mod:`refppo.oracle.detect.classes`,
:mod:`refppo.oracle.detect.evidence`).

A class holds the listed conventions that give bit-identical values on every dumped quantity. The
dumps are made by the naive twins (:func:`oracle_helpers.naive_dump`: ε = 0.1 while the sidecar says
0.2, so the policy step's solver reads ε off the data); each class is checked against the pipeline's
recompute of every listed member (:func:`refppo.oracle.check.recompute.recompute`), not against the
walk that made it: members of one class must agree bit for bit on every dumped quantity, members of
two classes must differ on one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from oracle_helpers import HP, make_inputs, naive_dump, setup_for

from refppo.dump.load import Dump, load_dump
from refppo.dump.write import write_dump
from refppo.oracle.check.recompute import recompute
from refppo.oracle.cli import main
from refppo.oracle.detect.classes import classify
from refppo.oracle.detect.detection import Detection, detect, setup_from_json
from refppo.pipeline.stages import OUTPUTS

INPUTS = ("response_mask", "old_logprobs", "ref_logprobs", "old_values", "scores", "logprobs", "values")
ROLLOUT = ("kl", "token_rewards", "advantages", "returns")
VALUE_KEYS = {"value_loss", "value_loss_agg", "value_clip_form", "vf_mask"}
"""The value loss's keys: by spec/ppo.md they reach only vf_loss, vf_clipfrac, the total and ∂/∂V."""


def _dump(tmp_path: Path, keep: tuple[str, ...] | None, dtype: torch.dtype = torch.float64) -> Path:
    d = naive_dump(make_inputs(B=6, T=12, seed=1), setup_for(hp={"cliprange": 0.1}), dtype=dtype)
    if keep is not None:
        d = {k: v for k, v in d.items() if k in (*INPUTS, *keep)}
    path = tmp_path / "s.safetensors"
    write_dump(path, d, hparams=dict(HP))
    return path


def _dumped_bits(dump: Dump, conv: dict[str, Any]) -> tuple[bytes, ...]:
    """The bits of every dumped quantity as the pipeline computes it under ``conv`` (compared
    positions only)."""
    ref = recompute(dump, setup_from_json(setup_for(), conv))
    out = []
    for q in (q for q in OUTPUTS if dump.has(q)):
        m = ref.compare_mask(q)
        v = ref.values[q] if m is None else ref.values[q][m]
        out.append(v.contiguous().numpy().tobytes())
    return tuple(out)


def _check_against_the_pipeline(dump: Dump, listed: list[dict[str, Any]], classes: list[list[int]]) -> None:
    """Same class ⇔ bit-identical on every dumped quantity, for every pair of ``listed`` conventions
    (``classes``: each class's member indices): the classes are the partition by the pipeline's bits."""
    by_class: dict[int, set[tuple[bytes, ...]]] = {}
    by_bits: dict[tuple[bytes, ...], set[int]] = {}
    for ci, members in enumerate(classes):
        for i in (i for i in members if i < len(listed)):
            bits = _dumped_bits(dump, listed[i])
            by_class.setdefault(ci, set()).add(bits)
            by_bits.setdefault(bits, set()).add(ci)
    assert all(len(b) == 1 for b in by_class.values()), "a class whose members differ on a dumped quantity"
    assert all(len(c) == 1 for c in by_bits.values()), "two classes with the same dumped values"


def _members(found: Detection) -> list[list[int]]:
    return [list(c.members) for c in found.classes.classes]


def test_a_one_scalar_loss_dump_gets_the_one_equation_label_and_its_class(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _dump(tmp_path, (*ROLLOUT, "pg_loss"))
    main([str(path), "--detect", "--json"])
    rep = json.loads(capsys.readouterr().out)
    ev = rep["evidence"]["cliprange"]
    assert (ev["observations"], ev["free_parameters"]) == (1, 1), ev
    assert ev["label"] == "fixed by one equation" and ev["determined"] is False
    # the value loss's keys reach no dumped quantity here (no vf_loss, vf_clipfrac, loss, grad_values)
    # and the clamps bind on no token: every listed convention gives the same dumped values
    [one] = rep["classes"]
    assert one["size"] == rep["detected_count"] > 1000
    assert set(one["differing"]) >= VALUE_KEYS, one["differing"]
    assert one["differing"]["value_loss"] == ["clipped", "unclipped"]
    assert {k: one["to_separate_dump"][k] for k in VALUE_KEYS} == dict.fromkeys(VALUE_KEYS, "vf_loss")
    assert one["to_separate_dump"]["dual_clip"] == "pg_clipfrac"  # the dual clip acts on the clipped term
    main([str(path), "--detect"])
    out = capsys.readouterr().out
    assert "for 1 solved constant(s): fixed by one equation: a fit, not a test" in out, out
    assert "1 class(es) the dump cannot tell apart" in out, out
    assert "to separate the members of a class, dump " in out and "vf_loss (value_clip_form" in out, out
    assert len(out.splitlines()) < 80  # thousands of conventions, a few lines
    _check_against_the_pipeline(load_dump(path), rep["detected"], [c["members"] for c in rep["classes"]])


def test_a_full_dump_whose_listed_conventions_differ_in_clamps_that_never_bind_is_one_class(
    tmp_path: Path,
) -> None:
    dump = load_dump(_dump(tmp_path, None))
    found = detect(dump, setup_for(), limit=1000)
    assert found.n_detected == len(found.detected) > 1
    [one] = found.classes.classes
    assert one.size == found.n_detected and one.members == tuple(range(found.n_detected))
    # the clamps of the KL, the ratio and the scores, and the dual clip, bind on no token of these
    # inputs; the value clip's two forms agree and the value mask is the response mask (no slot)
    assert set(one.differing) <= {
        "kl_log_ratio_clamp", "kl_value_clamp", "log_ratio_clamp", "dual_clip", "score_clip",
        "value_clip_form", "vf_mask",
    }, one.differing  # fmt: skip
    assert {"kl_value_clamp", "dual_clip"} <= set(one.differing)
    _check_against_the_pipeline(dump, found.detected, _members(found))


def test_conventions_that_differ_on_a_dumped_quantity_are_never_in_one_class(tmp_path: Path) -> None:
    # in float32 several ε (and loss aggregations) reproduce every dumped quantity within tolerance,
    # each with its own pg_loss bits: the listed conventions fall into several classes
    dump = load_dump(_dump(tmp_path, None, torch.float32))
    found = detect(dump, setup_for(), limit=1000)
    assert len(found.classes.classes) >= 2, found.classes
    _check_against_the_pipeline(dump, found.detected, _members(found))


def _marks(**digests: bytes) -> tuple[tuple[str, bytes], ...]:
    return tuple(digests.items())


def test_a_group_of_the_walk_is_split_where_an_earlier_dumped_step_differs() -> None:
    # the walk's last steps merge by a few scalars, so one group can hold members whose (dumped)
    # advantages differ bit-wise: the advantages step's digest keeps them apart
    base = {"whiten_eps_at": "inside_sqrt", "value_loss": "clipped", "approx_kl": "k1"}
    a, b = dict(base), {**base, "whiten_eps_at": "outside_sqrt"}
    marks_a = _marks(advantages=b"A", policy=b"P", loss=b"L")
    marks_b = _marks(advantages=b"B", policy=b"P", loss=b"L")
    dumped = frozenset({"advantages", "pg_loss"})
    split = classify([a, b], [(0, marks_a), (0, marks_b)], [2], dumped)
    assert [c.members for c in split.classes] == [(0,), (1,)]
    assert split.unassigned == 0 and [c.size for c in split.classes] == [1, 1]
    # without the advantages in the dump the same two are one class
    joined = classify([a, b], [(0, marks_a), (0, marks_b)], [5], frozenset({"pg_loss"}))
    [one] = joined.classes
    assert one.members == (0, 1) and one.size == 5
    assert one.differing == {"whiten_eps_at": ["inside_sqrt", "outside_sqrt"]}
    # whiten_eps_at is read by the reward whitening too: its first output is the token rewards
    assert one.separate == {"whiten_eps_at": "token_rewards"}
    # members counted beyond the listed ones of a group that spans two classes are in neither
    assert classify([a, b], [(0, marks_a), (0, marks_b)], [5], dumped).unassigned == 3


def test_keys_no_dumped_quantity_reads_fall_together() -> None:
    # approx_kl and the value loss's keys reach neither pg_loss nor advantages: two members of two
    # groups with another policy digest (it covers approx_kl) that differ only there are one class
    a = {"loss_agg": "token-mean", "approx_kl": "k1", "value_loss": "clipped"}
    b = {**a, "approx_kl": "k2_all_positions", "value_loss": "unclipped"}
    c = {**a, "loss_agg": "seq-mean-token-mean"}
    dumped = frozenset({"advantages", "pg_loss"})
    origin = [(0, _marks(advantages=b"A", policy=b"P")), (1, _marks(advantages=b"A", policy=b"Q")),
              (2, _marks(advantages=b"A", policy=b"R"))]  # fmt: skip
    out = classify([a, b, c], origin, [1, 1, 1], dumped)
    assert [cl.members for cl in out.classes] == [(0, 1), (2,)]  # loss_agg reaches pg_loss
    assert out.classes[0].separate == {"approx_kl": "approx_kl", "value_loss": "vf_loss"}


def test_json_keeps_every_listed_convention(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _dump(tmp_path, None, torch.float32)
    main([str(path), "--detect", "--json"])
    rep = json.loads(capsys.readouterr().out)
    listed, classes = rep["detected"], rep["classes"]
    assert len(classes) >= 2 and len(listed) == min(50, rep["detected_count"])
    members = sorted(i for c in classes for i in c["members"])
    assert members == list(range(len(listed)))  # each listed convention in exactly one class
    assert sum(c["size"] for c in classes) + rep["classes_unassigned"] == rep["detected_count"]
    for c in classes:
        rep_conv = c["representative"]
        for i in c["members"]:
            for k, v in listed[i].items():
                assert v in c["differing"][k] if k in c["differing"] else v == rep_conv[k], (k, v)
        if c["members"]:  # nearest first: a class's first listed member is its nearest one
            assert listed[c["members"][0]] == rep_conv


def test_with_a_gradient_dumped_a_straight_through_twin_is_another_class() -> None:
    # k3 and k3+ give the same values (one walk group, the same digests) and different gradients of
    # the KL loss (spec/conventions.md): the walk evaluates no gradient, so with grad_logprobs
    # dumped they stay apart; without it the dump cannot tell them apart
    a = {"kl_estimator": "k3", "kl_in": "loss"}
    b = {**a, "kl_estimator": "k3+"}
    origin = [(0, _marks(kl=b"K", policy=b"P")), (0, _marks(kl=b"K", policy=b"P"))]
    values = classify([a, b], origin, [2], frozenset({"kl", "pg_loss"}))
    assert [c.members for c in values.classes] == [(0, 1)]
    grads = classify([a, b], origin, [2], frozenset({"kl", "pg_loss", "grad_logprobs"}))
    assert [c.members for c in grads.classes] == [(0,), (1,)]
    # the group's count is known for neither class alone: nothing beyond the listed members here
    assert grads.unassigned == 0


def test_without_the_walk_counts_a_class_counts_its_listed_members() -> None:
    # after the re-check rejected an estimator, detect passes counted=False: sizes are the listed
    a, b = {"loss_agg": "token-mean"}, {"loss_agg": "seq-mean-token-mean"}
    origin = [(0, _marks(policy=b"P")), (1, _marks(policy=b"Q"))]
    out = classify([a, b], origin, [7, 9], frozenset({"pg_loss"}), counted=False)
    assert [(c.members, c.size) for c in out.classes] == [((0,), 1), ((1,), 1)] and out.unassigned == 0
    counted = classify([a, b], origin, [7, 9], frozenset({"pg_loss"}))
    assert [c.size for c in counted.classes] == [7, 9]
