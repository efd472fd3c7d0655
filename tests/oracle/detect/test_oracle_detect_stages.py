"""``--detect`` walks every convention of the reward, GAE and whitening stages (issue #9).

Before, the stage search ignored ``whiten_rewards``, ``gae_padding``, ``whiten_eps_at`` and the
score bias/scale: a dump made under any of them reproduced under no convention. Each dump here is
made by refppo's pipeline under the named setting, checked to fail under the checked (default)
setting, and every reported convention is re-checked through the pipeline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from oracle_helpers import make_inputs, refppo_dump, save, setup_for

from refppo.dump.load import Dump, load_dump
from refppo.oracle.check.diagnose import check
from refppo.oracle.check.settings import Setup
from refppo.oracle.detect.detection import Detection, detect, setup_from_json


def _detect(
    tmp: Path, made_conv: dict[str, Any], made_hp: dict[str, Any] | None = None
) -> tuple[Dump, Setup, Detection]:
    made = setup_for(None, made_conv, made_hp)
    start = setup_for(None, {}, made_hp)
    d = refppo_dump(make_inputs(B=8, T=16, seed=5), made)
    dump = load_dump(save(tmp, d, start))
    assert not check(dump, start).match  # the setting really is outside the checked one
    return dump, start, detect(dump, start)


def _recheck(dump: Dump, start: Setup, found: Detection) -> None:
    assert found.detected, (found.unmatched_stages, found.fitted)
    for c in found.detected[:10]:
        res = check(dump, setup_from_json(start, c), explain_divergence=False)
        assert res.match, (c, res.diagnosis)


@pytest.mark.parametrize("kind", ["masked", "masked_no_shift"])
def test_detect_finds_reward_whitening(tmp_path: Path, kind: str) -> None:
    dump, start, found = _detect(tmp_path, {"whiten_rewards": kind})
    assert {c["whiten_rewards"] for c in found.detected} == {kind}
    _recheck(dump, start, found)


def test_detect_finds_gae_through_padding(tmp_path: Path) -> None:
    dump, start, found = _detect(tmp_path, {"gae_padding": "through"})
    assert {c["gae_padding"] for c in found.detected} == {"through"}
    _recheck(dump, start, found)


@pytest.mark.parametrize("eps_at", ["clamp", "std"])
def test_detect_finds_where_the_whitening_eps_sits(tmp_path: Path, eps_at: str) -> None:
    # a large eps so that its placement changes the advantages beyond float64 tolerance
    dump, start, found = _detect(tmp_path, {"whiten_eps_at": eps_at}, {"whiten_eps": 0.5})
    assert {c["whiten_eps_at"] for c in found.detected} == {eps_at}
    _recheck(dump, start, found)


def test_detect_solves_score_bias_and_scale(tmp_path: Path) -> None:
    # AReaL's reward_bias / reward_scaling: the reward's score is (s + b)·k
    dump, start, found = _detect(tmp_path, {"score_bias": -0.5, "score_scale": 2.0})
    assert {(c["score_bias"], c["score_scale"]) for c in found.detected} == {(-0.5, 2.0)}
    assert found.solved["score_bias"] == [-0.5] and found.solved["score_scale"] == [2.0]
    _recheck(dump, start, found)


def test_detect_with_constant_scores_proposes_the_score_map_class(tmp_path: Path) -> None:
    """One score on every row: the slot reward k·(s₀ + b) pins only the product. Detection lists the
    one-key members of the class (scale only, bias only), both re-checked through the pipeline, and
    says in one line why (before: it proposed nothing and found no convention, silently)."""
    import torch

    made = setup_for(None, {"score_bias": 0.5, "score_scale": 2.0})
    start = setup_for(None, {})
    x = make_inputs(B=8, T=16, seed=5)
    x["scores"] = torch.full_like(x["scores"], 1.25)  # k·(s₀ + b) = 2·1.75 = 3.5
    dump = load_dump(save(tmp_path, refppo_dump(x, made), start))
    assert not check(dump, start).match
    found = detect(dump, start)
    maps = {(c["score_bias"], c["score_scale"]) for c in found.detected}
    assert maps == {(0.0, 2.8), (2.25, 1.0)}, (maps, found.fitted)
    assert {"score_bias", "score_scale"} <= set(found.undetermined)
    _recheck(dump, start, found)
    assert len(found.notes) == 1, found.notes
    note = found.notes[0]
    assert "every score is 1.25" in note and "k·(1.25 + b) = 3.5" in note
    assert "score_bias=0 score_scale=2.8" in note and "score_bias=2.25 score_scale=1" in note
    from refppo.oracle.run import check_step

    out = check_step(dump, detect_conventions=True)
    assert [ln for ln in out.text().splitlines() if ln.strip().startswith("note:")] == [f"  note: {note}"]
    assert out.json()["detect_notes"] == [note]


def test_constant_score_note_names_only_maps_that_reproduce(tmp_path: Path) -> None:
    """rev2 BUG-4: with s₀ = 1.3 and k·(s₀ + b) = 3.5 the scale-only member 3.5/1.3 is no round
    number; before, the note printed ``score_scale=2.69`` (2.69·1.3 = 3.497, not the dump) and only
    the bias member was detected. Every example the note prints must be a detected map that the
    pipeline re-check confirms, and both one-key members must be there."""
    import re

    import torch

    made = setup_for(None, {"score_bias": 2.2})
    start = setup_for(None, {})
    x = make_inputs(B=8, T=16, seed=5)
    x["scores"] = torch.full_like(x["scores"], 1.3)
    dump = load_dump(save(tmp_path, refppo_dump(x, made), start))
    assert not check(dump, start).match
    found = detect(dump, start)
    assert len(found.notes) == 1, found.notes
    shown = [
        (float(b), float(k)) for b, k in re.findall(r"score_bias=(\S+) score_scale=(\S+)", found.notes[0])
    ]
    assert len(shown) == 2 and shown[1] == (2.2, 1.0), found.notes
    assert shown[0][0] == 0.0 and abs(shown[0][1] * 1.3 - 3.5) < 1e-9, found.notes
    for b, k in shown:
        hits = [c for c in found.detected if (c["score_bias"], c["score_scale"]) == (b, k)]
        assert hits, (b, k, {(c["score_bias"], c["score_scale"]) for c in found.detected})
        res = check(dump, setup_from_json(start, hits[0]), explain_divergence=False)
        assert res.match, (b, k, res.diagnosis)


def test_detect_identifies_the_loss_conventions_behind_advantages_it_cannot_reproduce(tmp_path: Path) -> None:
    # The advantages are normalised per row (no convention expresses that); the losses were computed
    # from THOSE advantages with seq-mean-token-mean aggregation and k2-over-all-positions approx_kl.
    # The policy and value stages must read the dump's own advantages and returns, so that only the
    # advantages stage stays unmatched and the nearest convention names the loss conventions.
    import torch

    from refppo.core.policy import approx_kl_k2_all_positions
    from refppo.pipeline.settings import Hyperparams
    from refppo.pipeline.step import update_quantities

    made = setup_for(None, {"whiten_advantages": "none", "loss_agg": "seq-mean-token-mean"})
    start = setup_for(None)
    d = refppo_dump(make_inputs(B=8, T=16, seed=3), made)
    m = d["response_mask"].bool()
    adv = [[0.0] * m.shape[1] for _ in range(m.shape[0])]
    for b in range(m.shape[0]):  # each row centred and scaled by its own population std
        vals = [float(d["advantages"][b, t]) for t in range(m.shape[1]) if m[b, t]]
        mu = sum(vals) / len(vals)
        sd = (sum((v - mu) ** 2 for v in vals) / len(vals)) ** 0.5
        for t in range(m.shape[1]):
            if m[b, t]:
                adv[b][t] = (float(d["advantages"][b, t]) - mu) / (sd + 1e-3)
    d["advantages"] = torch.tensor(adv, dtype=torch.float64)
    hp = Hyperparams(**{k: v for k, v in made.hparams_dict().items() if v is not None})
    vm = m.clone()
    lens = m.sum(1)
    vm[torch.arange(m.shape[0]), lens - 1] = True
    q = update_quantities(
        logprobs=d["logprobs"],
        values=d["values"],
        old_logprobs=d["old_logprobs"],
        old_values=d["old_values"],
        advantages=d["advantages"],
        returns=d["returns"],
        mask=m,
        value_mask_=vm,
        entropy=d["entropy"],
        hp=hp,
        conv=made.conv,
    )
    for k in ("loss", "pg_loss", "vf_loss", "entropy_loss", "pg_clipfrac", "vf_clipfrac"):
        d[k] = getattr(q, k).detach()
    d["approx_kl"] = approx_kl_k2_all_positions(d["logprobs"], d["old_logprobs"], m)
    found = detect(load_dump(save(tmp_path, d, start)), start)
    assert not found.detected and found.unmatched_stages == ["advantages"], found.unmatched_stages
    assert found.nearest is not None
    assert found.nearest["loss_agg"] == "seq-mean-token-mean"
    assert found.nearest["approx_kl"] == "k2_all_positions"


@pytest.mark.parametrize("eps_v", [0.35, 0.05])
def test_detect_solves_the_value_clip_range(tmp_path: Path, eps_v: float) -> None:
    # the sidecar says cliprange_value=0.2; the trainer clipped its values at eps_v
    made = setup_for(None, {}, {"cliprange_value": eps_v})
    start = setup_for(None)
    d = refppo_dump(make_inputs(B=8, T=16, seed=5), made)
    dump = load_dump(save(tmp_path, d, start))
    assert not check(dump, start).match
    found = detect(dump, start)
    assert found.detected, (found.unmatched_stages, found.fitted)
    assert {c["cliprange_value"] for c in found.detected} == {eps_v}
    assert found.solved["cliprange_value"] == [eps_v]
    _recheck(dump, start, found)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "token-sum"])
def test_value_clip_solver_terms_equal_the_core_value_loss(agg: str) -> None:
    # the solver's closed form of vf_loss(ε) against refppo.core.value.value_loss at several ε
    import torch

    from refppo.core.aggregate import aggregate_loss
    from refppo.core.value import value_loss
    from refppo.oracle.detect.solve import loss_weights
    from refppo.oracle.detect.solve_value import ValueTerms, solve_value_clip

    d = make_inputs(B=6, T=10, seed=2)
    m = d["response_mask"].bool()
    ret = torch.randn(6, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    w = loss_weights(lambda x: aggregate_loss(x, m, agg), m, torch.float64)
    terms = ValueTerms.of(d["values"], d["old_values"], ret, m, w)
    for eps in (0.0, 0.07, 0.3, 1.1, 50.0):
        core = value_loss(d["values"], d["old_values"], ret, m, clip=eps, kind="clipped", agg=agg).loss
        assert abs(terms.loss(eps) - float(core)) <= 1e-12 * max(1.0, abs(float(core)))
    target = float(value_loss(d["values"], d["old_values"], ret, m, clip=0.3, kind="clipped", agg=agg).loss)
    assert 0.3 in solve_value_clip(terms, target, tol=1e-9)


def test_detect_walks_every_approx_kl_metric(tmp_path: Path) -> None:
    # AReaL logs the mean of logprobs − old_logprobs (neg_k1); the search walked only k1 and k2
    dump, start, found = _detect(tmp_path, {"approx_kl": "neg_k1"})
    assert {c["approx_kl"] for c in found.detected} == {"neg_k1"}
    _recheck(dump, start, found)


def test_detect_reproduces_an_areal_dump_from_refppo_defaults(tmp_path: Path) -> None:
    made = setup_for("areal")
    start = setup_for(None)
    d = refppo_dump(make_inputs(B=8, T=16, seed=5), made)
    dump = load_dump(save(tmp_path, d, start))
    assert not check(dump, start).match
    found = detect(dump, start)
    _recheck(dump, start, found)
    assert all(c["approx_kl"] == "neg_k1" for c in found.detected)


def test_detect_finds_a_token_sum_value_loss(tmp_path: Path) -> None:
    # the value stage walked value_loss_agg over four of the five LossAgg modes: a token-sum value
    # loss (verl's agg_loss mode) was reported as "value, loss unmatched" (rev5)
    dump, start, found = _detect(tmp_path, {"value_loss_agg": "token-sum"})
    assert found.unmatched_stages == []
    assert {c["value_loss_agg"] for c in found.detected} == {"token-sum"}
    _recheck(dump, start, found)
