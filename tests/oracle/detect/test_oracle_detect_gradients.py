"""``--detect`` on v2 dumps with gradients and no scalar losses (#23 item 3).

The dumps are written by the HAND-WRITTEN trainer of ``tests/helpers/grad_helpers.py`` (two ranks ×
two micro-batches, the per-token losses restated from their definitions, the gradient by autograd
per micro-batch); they hold ``grad_logprobs`` / ``grad_values`` and no ``pg_loss``/``vf_loss``/``loss``.
The sidecar names no ``loss_agg`` (the search starts from refppo's default) or a wrong clip range,
so the convention must be read off the gradient: the aggregation (the per-token normaliser), the
clip regions (zero gradient where a clip binds), the dual clip and the value clip.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from grad_helpers import Bugs, save_step, step_dump

from refppo.dump.load import load_dump
from refppo.oracle.check.diagnose import check
from refppo.oracle.check.settings import build_setup, parse_value
from refppo.oracle.detect import grad_fit
from refppo.oracle.detect.detection import Detection, detect, setup_from_json
from refppo.oracle.detect.evidence import evidence


def _detect(tmp: Path, conv: dict[str, Any], side: dict[str, Any], bugs: Bugs | None = None) -> Detection:
    d = step_dump(conv, bugs)
    assert not any(k in d for k in ("pg_loss", "vf_loss", "loss", "kl_loss"))  # gradients only
    dump = load_dump(save_step(tmp, d, **side))
    sidecar = {k: parse_value(k, v) for k, v in dump.hparams.items()}
    return detect(dump, build_setup(preset_conv=None, preset_hp=None, sidecar=sidecar, overrides={}))


GENERATING = [
    {"loss_agg": "token-mean"},
    {"loss_agg": "seq-mean-token-mean"},
    {"loss_agg": "seq-mean-token-sum"},
    {"loss_agg": "seq-mean-token-sum-norm"},
    {"loss_agg": "token-sum"},
    {"loss_agg": "seq-mean-token-mean", "kl_in": "loss", "kl_estimator": "k3"},
    {"loss_agg": "token-sum", "kl_in": "loss", "kl_estimator": "k2"},
]


@pytest.mark.parametrize("conv", GENERATING, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_the_generating_aggregation_is_listed_and_no_other(tmp_path: Path, conv: dict[str, Any]) -> None:
    det = _detect(tmp_path, conv, {})
    assert det.detected, det.unmatched_stages
    # every listed convention aggregates as the trainer did: the per-token normaliser is pinned
    assert {e["loss_agg"] for e in det.detected} == {conv["loss_agg"]}
    assert "loss_agg" not in det.undetermined
    assert any(all(e[k] == v for k, v in conv.items()) for e in det.detected)
    if "kl_in" in conv:  # k3 and its straight-through twin k3+ share values: the gradient decides
        assert {e["kl_estimator"] for e in det.detected} == {conv["kl_estimator"]}


def test_every_listed_entry_passes_the_oracle_check(tmp_path: Path) -> None:
    """Not only the re-checked head: every listed entry reproduces the gradients through the oracle."""
    conv = {"loss_agg": "seq-mean-token-sum"}
    d = step_dump(conv)
    dump = load_dump(save_step(tmp_path, d))
    sidecar = {k: parse_value(k, v) for k, v in dump.hparams.items()}
    base = build_setup(preset_conv=None, preset_hp=None, sidecar=sidecar, overrides={})
    det = detect(dump, base, limit=30)
    assert det.detected
    assert all(check(dump, setup_from_json(base, e), explain_divergence=False).match for e in det.detected)


def test_clip_range_read_off_the_gradient(tmp_path: Path) -> None:
    """The trainer clips at ε = 0.2 (``HP``); the sidecar says 0.1: the tokens with zero gradient bound
    ε from both sides, and 0.2, the roundest number in the interval, is proposed and confirmed."""
    det = _detect(tmp_path, {"loss_agg": "seq-mean-token-mean"}, {"cliprange": 0.1})
    assert det.detected
    assert {e["cliprange"] for e in det.detected} == {0.2}
    assert det.solved["cliprange"] == [0.2]
    line = next(n for n in det.notes if n.startswith("cliprange: read off the gradient"))
    lo, hi = (float(x) for x in line.split(": ")[2].split(" (")[0].split(" ≤ cliprange < "))
    assert lo <= 0.2 < hi and hi - lo < 0.1  # a two-sided interval, not a half-line


def test_solved_clip_range_counts_the_gradient_tokens(tmp_path: Path) -> None:
    conv = {"loss_agg": "token-mean"}
    d = step_dump(conv)
    dump = load_dump(save_step(tmp_path, d, cliprange=0.1))
    sidecar = {k: parse_value(k, v) for k, v in dump.hparams.items()}
    det = detect(dump, build_setup(preset_conv=None, preset_hp=None, sidecar=sidecar, overrides={}))
    ev = {e.key: e for e in evidence(dump, [], det.solved)}["cliprange"]
    n_tokens = int(d["response_mask"].bool().sum())
    assert ev.dumped == {"grad_logprobs": n_tokens}
    assert ev.determined
    assert f"grad_logprobs: {n_tokens} gradient entries" in ev.text()


def test_value_clip_range_read_off_grad_values(tmp_path: Path) -> None:
    det = _detect(tmp_path, {"loss_agg": "token-mean"}, {"cliprange_value": 0.5})
    assert det.detected
    assert {e["cliprange_value"] for e in det.detected} == {0.2}
    assert any(n.startswith("cliprange_value: read off the gradient") for n in det.notes)


def test_dual_clip_read_off_the_gradient(tmp_path: Path) -> None:
    """A dual clip c = 1.3 (no named value): the A < 0 tokens with ρ > c have zero gradient."""
    det = _detect(tmp_path, {"loss_agg": "seq-mean-token-mean", "dual_clip": 1.3}, {})
    assert det.detected
    assert {e["dual_clip"] for e in det.detected} == {1.3}
    assert det.solved["dual_clip"] == [1.3]


@pytest.mark.parametrize(
    ("bug", "named"),
    [
        (Bugs(local_norm=True), "local_normaliser"),
        (Bugs(local_norm_summed=True), "local_normaliser_summed"),
        (Bugs(rank_norm=True), "rank_normaliser"),
    ],
    ids=["local_norm", "local_norm_summed", "rank_norm"],
)
def test_a_normaliser_bug_is_not_listed_and_the_report_says_so(tmp_path: Path, bug: Bugs, named: str) -> None:
    """A micro-batch (rank) normaliser where the convention's is the step's: no convention makes that
    gradient, so nothing is listed, and the fitted line names the bug."""
    det = _detect(tmp_path, {"loss_agg": "token-mean"}, {}, bug)
    assert det.detected == []
    assert "policy" in det.unmatched_stages
    line = next(f for f in det.fitted if f.startswith("policy: no convention's gradient reproduces"))
    assert f"it is a trainer bug, not a convention ({named})" in line


def test_scalar_and_gradient_must_agree(tmp_path: Path) -> None:
    """``pg_loss`` and ``loss`` of a token-mean step with the gradient of a seq-mean-token-mean one:
    each alone is reproduced by some aggregation, the two together by none."""
    d = step_dump({"loss_agg": "token-mean"}, Bugs(loss_agg="seq-mean-token-mean"), keep_scalars=True)
    assert "pg_loss" in d
    dump = load_dump(save_step(tmp_path, d))
    sidecar = {k: parse_value(k, v) for k, v in dump.hparams.items()}
    det = detect(dump, build_setup(preset_conv=None, preset_hp=None, sidecar=sidecar, overrides={}))
    assert det.detected == []


def test_the_screen_rejects_on_the_first_rows_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a screen of 2 rows the listed conventions are those of the unscreened walk, and some
    candidates are rejected by the screen."""
    conv = {"loss_agg": "seq-mean-token-sum", "dual_clip": 1.3}
    whole = _detect(tmp_path, conv, {"cliprange": 0.1})
    rejected: list[bool] = []
    real = grad_fit.GradFit._screen_fails

    def counting(self: grad_fit.GradFit, *a: Any) -> bool:
        out = real(self, *a)
        rejected.append(out)
        return out

    monkeypatch.setattr(grad_fit, "SCREEN_ELEMENTS", 20)
    monkeypatch.setattr(grad_fit.GradFit, "_screen_fails", counting)
    screened = _detect(tmp_path, conv, {"cliprange": 0.1})
    assert any(rejected) and not all(rejected)
    assert screened.detected == whole.detected and screened.n_detected == whole.n_detected


def test_screen_rows_leaves_small_batches_whole() -> None:
    assert grad_fit.screen_rows(8, 10) == 0
    assert grad_fit.screen_rows(256, 1024) == 8  # 8192 elements
    assert grad_fit.screen_rows(1024, 8192) == 1
    assert grad_fit.screen_rows(4, 100000) == 1  # at least one row
