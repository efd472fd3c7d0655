"""Presets: refppo's own dumps under every preset match; the preset values are the survey's; detection
recovers the convention a dump was made with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from oracle_helpers import make_inputs, naive_dump, naive_outputs, refppo_dump, save, setup_for

from refppo.conventions import KLPlacement
from refppo.dump.load import load_dump
from refppo.oracle.check.diagnose import check
from refppo.oracle.check.settings import Setup
from refppo.oracle.detect.detection import detect
from refppo.oracle.presets.registry import PEER_PRESETS, PRESETS, resolve_preset


def _inputs(s: Setup, seed: int, lp_noise: float = 0.3) -> dict[str, torch.Tensor]:
    """:func:`make_inputs`, plus behaviour log-probs ``l^old − 0.5·|N(0, 1)|`` where the preset has a
    rollout correction (oat's ``tis_c``), so that its cap binds on some tokens."""
    x = make_inputs(seed=seed, lp_noise=lp_noise)
    if s.conv.rollout.level is not None:
        g = torch.Generator().manual_seed(seed + 1000)
        x["rollout_logprobs"] = (
            x["old_logprobs"] - 0.5 * torch.randn(x["old_logprobs"].shape, generator=g).abs()
        )
    return x


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("preset", [*PEER_PRESETS, "refppo"])
def test_refppo_dump_matches_under_every_preset(tmp_path: Path, preset: str, dtype: torch.dtype) -> None:
    s = setup_for(preset)
    d = refppo_dump(_inputs(s, seed=11), s, dtype=dtype)
    res = check(load_dump(save(tmp_path, d, s)), s)
    assert res.match, res.diagnosis
    # kl_loss is dumped (and compared) only with the KL in the loss (the skyrl preset's default)
    assert len(res.quantities) == (12 if s.conv.kl.placement is KLPlacement.LOSS else 11)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("preset", [*PEER_PRESETS, "refppo"])
def test_naive_twin_dump_matches_under_every_preset(tmp_path: Path, preset: str, dtype: torch.dtype) -> None:
    """A dump whose outputs come from the naive twins (not from the recompute) matches under the
    preset it was made with, every output compared."""
    s = setup_for(preset)
    d = naive_dump(_inputs(s, seed=11), s, dtype=dtype)
    res = check(load_dump(save(tmp_path, d, s)), s)
    assert res.match, res.diagnosis
    assert set(res.quantities) == set(naive_outputs(_inputs(s, seed=11), s))


@pytest.mark.parametrize("preset", PEER_PRESETS)
def test_a_preset_dump_does_not_match_the_refppo_defaults(tmp_path: Path, preset: str) -> None:
    s = setup_for(preset)
    d = naive_dump(_inputs(s, seed=12, lp_noise=1.5), s)  # ratios > 3 so verl's dual clip acts
    assert not check(load_dump(save(tmp_path, d, s)), setup_for(None, hp=s.hparams_dict())).match


def test_preset_values_follow_the_survey() -> None:
    # shared/conventions.md section 1 (comparison table)
    verl, orl, trl, ds = (resolve_preset(n)[0] for n in ("verl", "openrlhf", "trl", "deepspeed-chat"))
    assert (
        verl["dual_clip"] == 3.0 and verl["log_ratio_clamp"] == 20.0 and verl["whiten_variance"] == "unbiased"
    )
    assert (
        orl["whiten_variance"] == "population" and orl["kl_value_clamp"] == 10.0 and orl["score_clip"] == 10.0
    )
    assert trl["score_at"] == "after_last_valid" and trl["approx_kl"] == "k2_all_positions"
    assert (
        ds["score_at"] == "after_last_valid" and ds["whiten_advantages"] == "none" and ds["score_clip"] == 5.0
    )
    assert resolve_preset("verl", "k3")[0]["kl_log_ratio_clamp"] == (-20.0, 20.0)
    assert resolve_preset("verl", "k1")[0]["kl_value_clamp"] is None
    assert resolve_preset("openrlhf", "k3")[0]["kl_log_ratio_clamp"] == (-10.0, None)
    assert PRESETS["trl"].hparams["lam"] == 0.95 and PRESETS["verl"].hparams["lam"] == 1.0


def _canon(conv: dict[str, object]) -> dict[str, object]:
    """``value_loss_agg``/``kl_loss_agg``/``entropy_agg`` equal to ``loss_agg`` is the same convention as
    None (= loss_agg)."""
    out = dict(conv)
    for key in ("value_loss_agg", "kl_loss_agg", "entropy_agg"):  # = loss_agg is the same as None
        if out.get(key) == out.get("loss_agg"):
            out[key] = None
    # whiten_eps_at clamp (OpenRLHF) and variance differ by a relative eps/σ² (1e-8 here): the same
    # advantages on these dumps, so detection cannot (and need not) tell them apart.
    if out.get("whiten_eps_at") == "clamp":
        out["whiten_eps_at"] = "variance"
    return out


def _pinned(conv: dict[str, object], got: dict[str, object]) -> bool:
    conv, got = _canon(conv), _canon(got)
    return all(got[k] == v for k, v in conv.items())


DETECT_CASES: list[tuple[str | None, dict[str, str]]] = [
    ("trl", {}),
    ("verl", {"kl_estimator": "k3", "loss_agg": "seq-mean-token-sum"}),
    ("openrlhf", {"whiten_advantages": "masked_no_shift"}),
    ("deepspeed-chat", {}),
    (None, {"kl_estimator": "k2", "score_at": "last_position", "value_loss": "unclipped", "kl_in": "loss"}),
]


@pytest.mark.parametrize(("preset", "conv"), DETECT_CASES)
def test_detect_recovers_the_convention(tmp_path: Path, preset: str | None, conv: dict[str, str]) -> None:
    made = setup_for(preset, conv)
    inp = make_inputs(B=6, T=10, seed=21)
    inp["scores"] = inp["scores"] * 4.0  # large enough that score clipping is visible
    d = refppo_dump(inp, made)
    dump = load_dump(save(tmp_path, d, made))
    start = setup_for(None, hp=made.hparams_dict())  # search from refppo's defaults
    found = detect(dump, start)
    assert found.detected, found.unmatched_stages
    truth = {k: (list(v) if isinstance(v, tuple) else v) for k, v in made.convention_dict().items()}
    pinned = {k: v for k, v in truth.items() if k not in found.undetermined}
    assert any(_pinned(pinned, c) for c in found.detected)
    assert {"score_at", "whiten_advantages", "loss_agg", "value_loss", "kl_estimator"}.isdisjoint(
        found.undetermined
    )
    for c in found.detected:  # every reported convention really reproduces the dump
        res = check(
            dump, start.with_convention({k: tuple(v) if isinstance(v, list) else v for k, v in c.items()})
        )
        assert res.match, (c, res.diagnosis)


def test_detect_reports_the_nearest_when_nothing_matches(tmp_path: Path) -> None:
    s = setup_for("trl")
    d = refppo_dump(make_inputs(seed=5), s)
    d["vf_loss"] = d["vf_loss"] * 1.37  # no convention produces this
    found = detect(load_dump(save(tmp_path, d, s)), s)
    assert not found.detected
    assert found.nearest is not None and found.nearest["score_at"] == "after_last_valid"
    assert "value" in found.unmatched_stages


def _openrlhf_split_dump(inp: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An OpenRLHF ``actor.loss_agg_mode=seq-mean-token-mean`` step: the critic's ``ValueLoss(value_clip)``
    keeps the value loss token-mean. ``vf_loss`` (and ``loss``) are rewritten here with loops."""
    both_seq = setup_for("openrlhf", {"loss_agg": "seq-mean-token-mean", "value_loss_agg": "none"})
    d = refppo_dump(inp, both_seq)
    m = d["response_mask"].bool().tolist()
    v, v_old, ret = d["values"].tolist(), d["old_values"].tolist(), d["returns"].tolist()
    eps_v = both_seq.hp.cliprange_value
    per_tok = []
    for b in range(len(m)):
        for t in range(len(m[b])):
            if m[b][t]:
                v_clip = v_old[b][t] + min(max(v[b][t] - v_old[b][t], -eps_v), eps_v)
                per_tok.append(0.5 * max((v_clip - ret[b][t]) ** 2, (v[b][t] - ret[b][t]) ** 2))
    vf = sum(per_tok) / len(per_tok)
    assert abs(vf - float(d["vf_loss"])) > 1e-3  # the two aggregations really differ here
    d["loss"] = d["loss"] + both_seq.hp.vf_coef * (vf - d["vf_loss"])
    d["vf_loss"] = torch.tensor(vf, dtype=torch.float64)
    # Without the entropy: OpenRLHF's entropy is token-mean too (entropy_agg), which --detect does not
    # search yet; this test is about the value loss alone.
    d["loss"] = d["loss"] + both_seq.hp.ent_coef * d["entropy_loss"]  # loss = pg + c1·vf − c2·H
    del d["entropy"], d["entropy_loss"]
    return d


def test_openrlhf_split_value_aggregation(tmp_path: Path) -> None:
    inp = make_inputs(B=6, T=10, seed=33)
    d = _openrlhf_split_dump(inp)
    good = setup_for("openrlhf", {"loss_agg": "seq-mean-token-mean"})
    assert good.conv.agg.value is not None and good.conv.agg.value.value == "token-mean"
    dump = load_dump(save(tmp_path, d, good))
    res = check(dump, good)
    assert res.match, res.diagnosis
    bad = setup_for("openrlhf", {"loss_agg": "seq-mean-token-mean", "value_loss_agg": "none"})
    res = check(dump, bad)
    assert res.first_divergence == "vf_loss", res.diagnosis
    change = {"value_loss_agg": "token-mean"}
    explained = [e for e in res.explained_by if e["kind"] == "convention" and e["change"] == change]
    assert explained and explained[0]["all_match"]
    assert any("value_loss_agg=token-mean (as in preset openrlhf, rlinf)" in line for line in res.diagnosis)
    assert PRESETS["openrlhf"].conventions["value_loss_agg"] == "token-mean"
    assert PRESETS["verl"].conventions["value_loss_agg"] is None  # critic.loss_agg_mode = the actor's
    assert bad.convention_dict()["value_loss_agg"] is None
    assert good.convention_dict()["value_loss_agg"] == "token-mean"
    # --detect from refppo's defaults finds the split aggregation.
    found = detect(dump, setup_for(None, hp=good.hparams_dict()))
    assert found.detected, found.unmatched_stages
    assert all(c["loss_agg"] == "seq-mean-token-mean" for c in found.detected)
    assert all(c["value_loss_agg"] == "token-mean" for c in found.detected)


def test_detect_rechecks_its_result_through_the_pipeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The staged search is not trusted alone: conventions that fail the pipeline re-check are dropped."""
    import refppo.oracle.detect.detection as det
    from refppo.dump.load import Dump
    from refppo.oracle.check.diagnose import CheckResult
    from refppo.oracle.check.fastcheck import RolloutMemo

    s = setup_for("trl")
    dump = load_dump(save(tmp_path, refppo_dump(make_inputs(seed=9), s), s))
    assert detect(dump, s).detected  # the honest search finds it
    calls: list[int] = []

    def failing_check(
        dump: Dump, setup: Setup, *, explain_divergence: bool = True, rollouts: RolloutMemo | None = None
    ) -> CheckResult:
        calls.append(1)
        res = check(dump, setup, explain_divergence=explain_divergence, rollouts=rollouts)
        res.first_divergence = "kl"  # as if the pipeline disagreed with the staged search
        return res

    monkeypatch.setattr(det, "check", failing_check)
    found = detect(dump, s)
    assert calls and not found.detected and found.nearest is not None
