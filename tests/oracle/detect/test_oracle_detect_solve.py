"""``--detect`` solves for what the named grid cannot reach: dual-clip constants, clip ranges and
KL clamps read off the data, and a fitted, named map where no convention reproduces a stage.

The dumps come from refppo's pipeline under settings outside the named options (or, for the
normalisations the pipeline cannot express, are rewritten here with loops over Python floats), and
every reported convention is re-checked through the pipeline.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from oracle_helpers import make_inputs, refppo_dump, save, setup_for

from refppo.dump.load import load_dump
from refppo.oracle.check.diagnose import check
from refppo.oracle.detect.detection import detect, setup_from_json


def _detect(tmp: Path, made_conv: dict[str, str], made_hp: dict[str, float] | None = None, **kw: float):
    made = setup_for(None, made_conv, made_hp)
    start = setup_for(None)  # the checked setting: refppo's defaults and the helpers' hyperparameters
    d = refppo_dump(make_inputs(B=8, T=16, seed=3, lp_noise=kw.get("lp_noise", 0.3)), made)
    dump = load_dump(save(tmp, d, start))
    assert not check(dump, start).match  # the setting really is outside the checked one
    return dump, start, detect(dump, start)


def _all_recheck(dump, start, found) -> None:  # type: ignore[no-untyped-def]
    for c in found.detected[:10]:
        res = check(dump, setup_from_json(start, c), explain_divergence=False)
        assert res.match, (c, res.diagnosis)


def test_detect_solves_a_dual_clip_constant_off_the_grid(tmp_path: Path) -> None:
    dump, start, found = _detect(tmp_path, {"dual_clip": "2.5"}, lp_noise=1.5)
    assert found.detected, (found.unmatched_stages, found.fitted)
    assert {c["dual_clip"] for c in found.detected} == {2.5}
    assert found.solved["dual_clip"] == [2.5]
    _all_recheck(dump, start, found)


def test_detect_reads_a_kl_value_clamp_off_the_tokens(tmp_path: Path) -> None:
    dump, start, found = _detect(tmp_path, {"kl_estimator": "k2", "kl_value_clamp": "0.03"})
    assert found.detected, (found.unmatched_stages, found.fitted)
    assert all(c["kl_estimator"] == "k2" for c in found.detected)
    assert any(c["kl_value_clamp"] == 0.03 and c["kl_log_ratio_clamp"] is None for c in found.detected)
    _all_recheck(dump, start, found)


def test_detect_reads_asymmetric_log_ratio_bounds(tmp_path: Path) -> None:
    dump, start, found = _detect(tmp_path, {"kl_estimator": "k2", "kl_log_ratio_clamp": "-0.3,0.4"})
    assert any(c["kl_log_ratio_clamp"] == [-0.3, 0.4] and c["kl_value_clamp"] is None for c in found.detected)
    _all_recheck(dump, start, found)


def test_detect_solves_an_asymmetric_clip_range(tmp_path: Path) -> None:
    # the sidecar says cliprange=0.2 (symmetric); the trainer ran clip_ratio_high=0.28 (DAPO)
    dump, start, found = _detect(tmp_path, {}, {"cliprange_high": 0.28}, lp_noise=0.5)
    assert found.detected, (found.unmatched_stages, found.fitted)
    assert all((c["cliprange"], c["cliprange_high"]) == (0.2, 0.28) for c in found.detected)
    _all_recheck(dump, start, found)


def _rewrite_advantages(d: dict[str, torch.Tensor], per_row: bool) -> None:
    """Centre the raw advantages (mean over all B·T entries, or over each row's valid tokens, then
    divide by the row's unbiased std + 1e-6) with loops over Python floats."""
    m = d["response_mask"].bool().tolist()
    a = d["advantages"].tolist()
    out = [[0.0] * len(r) for r in a]
    if not per_row:  # the mean over all B·T entries (padding's 0 included): no enum expresses it
        vals = [a[b][t] if m[b][t] else 0.0 for b in range(len(m)) for t in range(len(m[b]))]
        mu = sum(vals) / len(vals)
        for b, t in itertools.product(range(len(m)), range(len(m[0]))):
            if m[b][t]:
                out[b][t] = a[b][t] - mu
    else:
        for b in range(len(m)):
            vals = [a[b][t] for t in range(len(m[b])) if m[b][t]]
            mu = sum(vals) / len(vals)
            sd = (sum((v - mu) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5 if len(vals) > 1 else 0.0
            for t in range(len(m[b])):
                if m[b][t]:
                    out[b][t] = (a[b][t] - mu) / (sd + 1e-6)
    d["advantages"] = torch.tensor(out, dtype=d["advantages"].dtype)


@pytest.mark.parametrize("per_row", [False, True])
def test_detect_names_a_normalisation_no_convention_expresses(tmp_path: Path, per_row: bool) -> None:
    made = setup_for(None, {"whiten_advantages": "none"})
    start = setup_for(None)
    d = refppo_dump(
        make_inputs(B=8, T=16, seed=3), made, keep=("kl", "token_rewards", "returns", "advantages")
    )
    _rewrite_advantages(d, per_row)
    found = detect(load_dump(save(tmp_path, d, start)), start)
    assert not found.detected and found.unmatched_stages == ["advantages"]
    (fit,) = found.fitted
    if per_row:
        assert "one map per row" in fit and "the mean over each row's valid tokens" in fit
        assert "1/(std+eps) of each row, unbiased" in fit
    else:
        assert fit.startswith("advantages = (A − ")
        assert "centred with the mean over all B·T entries, padding included; not scaled" in fit


def test_solve_min_hinge_against_direct_evaluation() -> None:
    from refppo.oracle.detect.solve import solve_min_hinge

    g = torch.Generator().manual_seed(0)
    knots = torch.rand(50, generator=g, dtype=torch.float64) * 3.0
    coef = torch.rand(50, generator=g, dtype=torch.float64)
    const = 0.7

    def total(x: float) -> float:  # the definition, one term at a time
        return const + sum(float(c) * min(x, float(k)) for c, k in zip(coef, knots, strict=True))

    for x_true in (0.05, 0.9, 1.7, 2.95):
        (x,) = solve_min_hinge(knots, coef, const, total(x_true), 0.0, 4.0)
        assert abs(x - x_true) < 1e-9
    # beyond the last knot the sum is flat: the left end of the flat stretch is returned
    flat = total(5.0)
    (x,) = solve_min_hinge(knots, coef, const, flat, 0.0, 10.0)
    assert abs(x - float(knots.max())) < 1e-9


MADE = {
    "openrlhf-k3": {"kl_estimator": "k3"},
    # reward whitening (TRL) and AReaL's score bias/scale act in steps 1-2 too: a pre-test that
    # restated the reward step without them rejected every candidate of such a dump
    "whitened-biased": {
        "kl_estimator": "k3",
        "whiten_rewards": "masked",
        "score_bias": -0.3,
        "score_scale": 1.5,
    },
}


@pytest.mark.parametrize("made_key", sorted(MADE))
@pytest.mark.parametrize("first", ["kl", "token_rewards", "advantages", "pg_loss"])
def test_the_diagnosis_prefilter_agrees_with_the_pipeline(tmp_path: Path, first: str, made_key: str) -> None:
    """The cheap KL/reward pre-test of a diagnosis candidate rejects exactly the candidates whose
    pipeline recompute already differs at kl/token_rewards (up to ``first``): it never changes
    what explains a divergence, it only skips recomputes."""
    from refppo.oracle.check.alternatives import ALTERNATIVES
    from refppo.oracle.check.diagnose import compare_all
    from refppo.oracle.check.fastcheck import rollout_prefix_ok
    from refppo.oracle.check.recompute import BUGS, recompute

    made = setup_for("openrlhf", MADE[made_key])
    inp = make_inputs(B=6, T=12, seed=4)
    inp["scores"] = inp["scores"] * 4.0
    dump = load_dump(save(tmp_path, refppo_dump(inp, made), made))
    upto = ["kl"] if first == "kl" else ["kl", "token_rewards"]
    n_rejected = 0
    for alts in ALTERNATIVES.values():
        for upd in alts:
            alt = made.with_convention({k: tuple(v) if isinstance(v, list) else v for k, v in upd.items()})
            for bug in (None, *BUGS):
                try:
                    ref = recompute(dump, alt, bug=bug)
                except ValueError:  # a bug this setting cannot hold (the sign flip without a reward KL)
                    continue
                res = compare_all(dump, ref)
                truth = all(res[q].ok for q in upto)
                assert rollout_prefix_ok(dump, alt, first, bug) == truth, (upd, bug)
                n_rejected += not truth
    assert n_rejected > 10  # the pre-test does reject candidates here
