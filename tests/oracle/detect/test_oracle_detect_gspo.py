"""``--detect`` on GSPO dumps (issue #23 item 5): ``policy_loss`` is walked.

Each dump's outputs come from refppo's naive twins (``oracle_helpers.naive_dump``:
:func:`refppo.core.gspo.gspo_policy_loss_naive` token by token), not from the pipeline the walk
evaluates. Before, the policy step walked only the checked setting's policy loss: on every dump
here ``--detect`` listed nothing, and its nearest convention carried unrelated changes.

The other policy losses are walked only when the checked one reproduces nothing (the solver's
second walk): on a vanilla dump the policy stage is never evaluated under ``gspo``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from oracle_helpers import make_inputs, naive_dump, refppo_dump, save, setup_for
from test_oracle_detect_peak import B, T, _BigOutputs, _junk_inputs, _policy

import refppo.oracle.detect.policy as search_policy
from refppo.dump.load import Dump, load_dump
from refppo.oracle.check.diagnose import check
from refppo.oracle.check.settings import Setup
from refppo.oracle.detect.detection import Detection, detect, setup_from_json
from refppo.oracle.detect.search import Search
from refppo.oracle.run import check_step
from refppo.pipeline.blocks import Evaluation


def _gspo_dump(
    tmp: Path,
    conv: dict[str, Any],
    hp: dict[str, Any] | None = None,
    *,
    preset: str | None = None,
    dtype: torch.dtype = torch.float64,
    offset: float | None = None,
) -> tuple[Dump, Setup]:
    """A naive-twin dump under ``conv`` (+ ``preset``, ``hp``) and the checked setting (``preset``
    alone, the dump's other hyperparameters). ``offset``: added to row 2's log-ratio, so that its
    ``S_b`` passes verl's κ = 10."""
    x = make_inputs(B=8, T=16, seed=5)
    if offset is not None:
        m, lp = x["response_mask"].bool(), x["logprobs"].clone()
        lp[2] = torch.where(m[2], lp[2] + offset, lp[2])
        x["logprobs"] = lp
    made = setup_for(preset, conv, hp)
    start = setup_for(preset, {}, {k: v for k, v in (hp or {}).items() if not k.startswith("clip")})
    dump = load_dump(save(tmp, naive_dump(x, made, dtype=dtype), start))
    assert check(dump, made).match, "the naive twins' dump matches its own convention"
    assert not check(dump, start).match
    return dump, start


def _rechecked(dump: Dump, start: Setup, found: Detection) -> None:
    assert found.detected, (found.unmatched_stages, found.nearest)
    for c in found.detected[:10]:
        assert check(dump, setup_from_json(start, c), explain_divergence=False).match, c


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_detect_lists_gspo_from_refppos_defaults(tmp_path: Path, dtype: torch.dtype) -> None:
    dump, start = _gspo_dump(tmp_path, {"policy_loss": "gspo"}, dtype=dtype)
    found = detect(dump, start, limit=1000)
    assert {c["policy_loss"] for c in found.detected} == {"gspo"}, found.nearest
    assert "policy_loss" not in found.undetermined
    # no row reaches κ = 10 or 20: the clamp binds on nothing, every value is listed
    assert {c["log_ratio_clamp"] for c in found.detected} == {None, 10.0}
    assert {c["dual_clip"] for c in found.detected} == {None}
    _rechecked(dump, start, found)


def test_detect_lists_verls_gspo_clamp_where_it_binds(tmp_path: Path) -> None:
    """Row 2's sequence log-ratio is above 10: only verl's κ = 10 reproduces it."""
    dump, start = _gspo_dump(tmp_path, {"policy_loss": "gspo", "log_ratio_clamp": 10.0}, offset=10.5)
    found = detect(dump, start)
    assert {(c["policy_loss"], c["log_ratio_clamp"]) for c in found.detected} == {("gspo", 10.0)}
    _rechecked(dump, start, found)


def test_detect_lists_gspo_from_the_verl_preset(tmp_path: Path) -> None:
    """verl's preset checks ``dual_clip=3`` and ``log_ratio_clamp=20``, which GSPO has not (its
    policy group refuses a dual clip): the GSPO options drop the dual clip."""
    conv = {"policy_loss": "gspo", "dual_clip": None, "log_ratio_clamp": 10.0}
    dump, start = _gspo_dump(tmp_path, conv, preset="verl")
    assert start.conv.policy.dual_clip == 3.0
    found = detect(dump, start)
    assert found.detected, (found.unmatched_stages, found.nearest)
    assert all(c["policy_loss"] == "gspo" and c["dual_clip"] is None for c in found.detected)
    _rechecked(dump, start, found)


def test_detect_solves_gspos_clip_range(tmp_path: Path) -> None:
    """The dump's ε = 0.1 is not the sidecar's 0.2: the policy solver reads it off ``pg_loss`` on
    GSPO's sequence ratio (on the token ratio it solves another one, which the clip fraction or
    the pipeline refuses)."""
    dump, start = _gspo_dump(tmp_path, {"policy_loss": "gspo"}, {"cliprange": 0.1})
    assert start.hp.cliprange == 0.2
    found = detect(dump, start)
    assert found.detected, (found.unmatched_stages, found.nearest)
    assert {(c["policy_loss"], c["cliprange"]) for c in found.detected} == {("gspo", 0.1)}
    assert 0.1 in found.solved["cliprange"]
    _rechecked(dump, start, found)


def test_the_report_names_gspo(tmp_path: Path) -> None:
    dump, _ = _gspo_dump(tmp_path, {"policy_loss": "gspo"})
    text = check_step(dump, detect_conventions=True).text()
    listed = [ln for ln in text.splitlines() if ln.startswith("  * ")]
    assert listed and all("policy_loss=gspo" in ln for ln in listed), text[-2000:]


def _policy_losses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The policy loss of every policy stage evaluation of the walk, recorded."""
    seen: list[str] = []
    real = Search.evaluate

    def evaluate(self: Search, stage: str, q: Any, setting: Setup, ev: Any = None) -> dict[str, Any]:
        if stage == "policy":
            seen.append(setting.conv.policy.loss.value)
        return real(self, stage, q, setting, ev)

    monkeypatch.setattr(Search, "evaluate", evaluate)
    return seen


def test_a_vanilla_dump_walks_no_other_policy_loss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checked policy loss reproduces the dump: the walk costs what it did (no gspo evaluation)."""
    made = setup_for(None, {"loss_agg": "seq-mean-token-mean"})
    dump = load_dump(save(tmp_path, refppo_dump(make_inputs(B=8, T=16, seed=5), made), made))
    seen = _policy_losses(monkeypatch)
    found = detect(dump, setup_for(None, {}))
    assert found.detected and seen
    assert set(seen) == {"vanilla"}


def test_a_gspo_dump_walks_gspo_after_vanilla(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dump, start = _gspo_dump(tmp_path, {"policy_loss": "gspo"})
    seen = _policy_losses(monkeypatch)
    assert detect(dump, start).detected
    assert seen[0] == "vanilla" and "gspo" in seen


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_gspo_clamp_test_by_blocks(seed: int) -> None:
    """``max_b S_b`` by blocks of 3 rows, with no ``[B, T]`` allocation, is the largest row mean of
    ``l − l^old``, and a GSPO clamp κ leaves the policy
    stage's output as it is without it, bit for bit, exactly when κ is at or above it (what lets
    the walk reuse that evaluation)."""
    lp, lp_old, adv, mask = _junk_inputs(seed)
    means = [
        sum(float(lp[b, t]) - float(lp_old[b, t]) for t in range(T) if mask[b, t]) / int(mask[b].sum())
        for b in range(B)
    ]
    rec = _BigOutputs(B * T)
    with rec:
        got = search_policy.max_seq_log_ratio(3, lp, lp_old, mask)
    assert rec.allocating == []
    assert got == pytest.approx(max(means), rel=1e-5, abs=1e-6)
    whole = Evaluation()
    plain = _policy(lp, lp_old, adv, mask, whole, policy_loss="gspo")
    kappas = [k for k in (got - 0.05, got, got + 0.05, sorted(means)[len(means) // 2]) if k > 0]
    assert kappas
    for kappa in kappas:
        clamped = _policy(lp, lp_old, adv, mask, whole, policy_loss="gspo", log_ratio_clamp=kappa)
        same = all(torch.equal(clamped[k], plain[k]) for k in ("pg_per_token", "pg_clipfrac", "pg_approx_kl"))
        assert same == (kappa >= got), (kappa, got)
