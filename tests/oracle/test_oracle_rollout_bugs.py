"""The rollout correction's classic bugs, named by the diagnosis (issue #22 item 3;
:mod:`refppo.pipeline.bugs_rollout`, spec/rollout-correction.md "Bugs the diagnosis names").

Each dump's buggy policy term is written here from the bug's definition — plain loops over Python
floats for the values (the weight, the clipped surrogate, the token mean), a few hand-written torch
lines and autograd for the one gradient-only bug — never with the oracle's re-enactment or the
core's weights, so a wrong diagnosis fails the test. The rest of the step (KL, rewards, advantages,
value and entropy terms) is the naive twins' (``oracle_helpers.naive_dump``). Each dump names its own
bug and no other; a clean dump names none; a bug the convention cannot run is refused in one line.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from oracle_helpers import HP, lengths_of, make_inputs, naive_dump, rows, setup_for, with_behaviour
from torch import Tensor

from refppo.dump.load import load_dump
from refppo.dump.write import write_dump
from refppo.oracle.check.diagnose import CheckResult, check, explain_bugs
from refppo.pipeline.bugs import BUGS
from refppo.pipeline.bugs_rollout import ROLLOUT_BUGS

F64 = torch.float64
EPS = HP["cliprange"]
RC_BUGS = [b.name for b in ROLLOUT_BUGS]
TIS2 = {"rollout_is": "token", "rollout_is_high": 2.0}
BAND = {"rollout_is": "token", "rollout_is_mode": "mask", "rollout_is_low": 0.5, "rollout_is_high": 2.0}
SEQ_GEO = {
    "rollout_is": "sequence", "rollout_is_agg": "geometric", "rollout_is_low": 0.8, "rollout_is_high": 1.25,
}  # fmt: skip

Weights = list[list[float]]


def _inputs(stale: bool = False) -> dict[str, Tensor]:
    """B=8, T=12; behaviour log-probs ``l^prox − N(0, 1)``. ``stale``: one valid token's engine
    log-prob is −1000 (an async trainer's stale rollout): ``exp(d)`` overflows to inf there."""
    x = with_behaviour(make_inputs(B=8, T=12, seed=5), scale=1.0)
    if stale:
        x["rollout_logprobs"][0, 3] = -1000.0
    return x


def _exp(d: float) -> float:
    return math.exp(d) if d < 709.0 else math.inf


def _d(x: dict[str, Tensor], num: str = "old_logprobs") -> list[list[float]]:
    """``d_t = l^num_t − l^beh_t`` per valid token (ragged rows)."""
    a, b = rows(x[num]), rows(x["rollout_logprobs"])
    return [[a[i][t] - b[i][t] for t in range(n)] for i, n in enumerate(lengths_of(x["response_mask"]))]


def _band(w: float, lo: float | None, hi: float | None) -> bool:
    return (lo is None or w >= lo) and (hi is None or w <= hi)


def _bounded(w: float, conv: dict[str, Any], multiply: bool = False) -> float:
    """``w'`` of one raw weight: truncate ``clamp(w, lo, hi)``, mask ``w·[lo ≤ w ≤ hi]`` (selected;
    ``multiply``: the band multiplied in, ``inf·0 = NaN``)."""
    lo, hi = conv.get("rollout_is_low"), conv.get("rollout_is_high")
    if conv.get("rollout_is_mode", "truncate") == "truncate":
        return min(max(w, lo if lo is not None else -math.inf), hi if hi is not None else math.inf)
    keep = _band(w, lo, hi)
    return w * float(keep) if multiply else (w if keep else 0.0)


def _token(x: dict[str, Tensor], conv: dict[str, Any], num: str = "old_logprobs", **kw: bool) -> Weights:
    return [[_bounded(_exp(d), conv, **kw) for d in row] for row in _d(x, num)]


def _sequence_sum(x: dict[str, Tensor], conv: dict[str, Any]) -> Weights:
    """The row weight ``exp(Σ_t d_t)`` (the bug: summed), bounded, on every valid token."""
    return [[_bounded(_exp(sum(row)), conv)] * len(row) for row in _d(x)]


def _log_capped(x: dict[str, Tensor], conv: dict[str, Any]) -> Weights:
    """Truncation on the log-ratio: ``exp(min(d, C_high))`` (no lower bound set)."""
    return [[math.exp(min(d, conv["rollout_is_high"])) for d in row] for row in _d(x)]


def _policy_term(x: dict[str, Tensor], w: Weights, old: str = "old_logprobs") -> dict[str, float]:
    """``pg_loss = (1/N)·Σ w'_t·max(−A·ρ, −A·clip(ρ, 1 ± ε))``, ``ρ = exp(l − l^old)``; the clip
    fraction and ``approx_kl = mean(l^old − l)`` unweighted (token means, the default convention)."""
    lp, base, adv = rows(x["logprobs"]), rows(x[old]), rows(x["advantages"])
    pg, clipped, kl, n = 0.0, 0, 0.0, 0
    for b, row in enumerate(w):
        for t, wt in enumerate(row):
            ratio = math.exp(lp[b][t] - base[b][t])
            cut = min(max(ratio, 1 - EPS), 1 + EPS)
            pg += wt * max(-adv[b][t] * ratio, -adv[b][t] * cut)
            clipped += -adv[b][t] * cut > -adv[b][t] * ratio
            kl += base[b][t] - lp[b][t]
            n += 1
    return {"pg_loss": pg / n, "pg_clipfrac": clipped / n, "approx_kl": kl / n}


WeightFn = Callable[[dict[str, Tensor]], Weights]


def _dump(
    conv: dict[str, Any], weights: WeightFn | None, *, old: str = "old_logprobs", stale: bool = False
) -> dict[str, Tensor]:
    """A correct step under ``conv`` (naive twins) whose policy term is rewritten by the loops with
    ``weights(x)`` (None: the correct step as it is)."""
    x = _inputs(stale)
    d = naive_dump(x, setup_for(None, conv))
    if weights is None:
        return d
    pg = _policy_term(d, weights(d), old)
    loss = pg["pg_loss"] + HP["vf_coef"] * float(d["vf_loss"]) - HP["ent_coef"] * float(d["entropy_loss"])
    return {**d, **{k: torch.tensor(v, dtype=F64) for k, v in {**pg, "loss": loss}.items()}}


def _check(tmp_path: Path, d: dict[str, Tensor], conv: dict[str, Any], **extra: int) -> CheckResult:
    s = setup_for(None, conv)
    hp = {k: v for k, v in s.hparams_dict().items() if v is not None}
    path = tmp_path / "step.safetensors"
    write_dump(path, d, hparams={**hp, **extra})
    return check(load_dump(path), s)


def _bugs(res: CheckResult) -> list[str]:
    return [str(f["bug"]) for f in res.explained_by if f["kind"] == "bug"]


CASES: dict[str, tuple[dict[str, Any], WeightFn, str]] = {
    "is_sum_not_mean": (SEQ_GEO, lambda x: _sequence_sum(x, SEQ_GEO), "old_logprobs"),
    "truncate_mask_swapped": (
        {**BAND, "rollout_is_mode": "truncate"}, lambda x: _token(x, BAND), "old_logprobs"),
    "cap_on_log_ratio": ({**TIS2, "rollout_is_high": 1.5}, lambda x: _log_capped(x, {"rollout_is_high": 1.5}),
                         "old_logprobs"),
    "old_is_behaviour": (TIS2, lambda x: [[1.0] * len(r) for r in _d(x)], "rollout_logprobs"),
    "is_weight_against_current": (TIS2, lambda x: _token(x, TIS2, "logprobs"), "old_logprobs"),
}  # fmt: skip
"""Bug → (the checked convention, the buggy weights by the loops, the ratio's old log-probs)."""


@pytest.mark.parametrize("bug", list(CASES))
def test_each_value_bug_is_named_at_pg_loss(tmp_path: Path, bug: str) -> None:
    conv, weights, old = CASES[bug]
    res = _check(tmp_path, _dump(conv, weights, old=old), conv)
    assert res.first_divergence == "pg_loss", (res.first_divergence, res.diagnosis)
    assert _bugs(res) == [bug], res.diagnosis
    assert res.explained_by[[str(f.get("bug")) for f in res.explained_by].index(bug)]["all_match"]
    assert any(f"known bug ({bug})" in line and "every quantity in the dump matches" in line
               for line in res.diagnosis), res.diagnosis  # fmt: skip


@pytest.mark.parametrize("bug", list(CASES))
def test_the_bug_changes_the_dump(bug: str) -> None:
    """Control: the loops' buggy policy term is not the correct one (else naming it is vacuous)."""
    conv, weights, old = CASES[bug]
    bad, good = _dump(conv, weights, old=old), _dump(conv, None)
    assert abs(float(bad["pg_loss"]) - float(good["pg_loss"])) > 1e-4


def test_a_stale_token_leaks_nan_through_a_multiplied_mask_and_is_named(tmp_path: Path) -> None:
    d = _dump(BAND, lambda x: _token(x, BAND, multiply=True), stale=True)
    assert math.isnan(float(d["pg_loss"]))  # inf·0 = NaN at the stale token, summed into the loss
    res = _check(tmp_path, d, BAND)
    assert res.first_divergence == "pg_loss"
    assert _bugs(res) == ["nonfinite_through_mask"], res.diagnosis
    assert res.explained_by[0]["all_match"]
    assert any("inf·0 = NaN" in line for line in res.diagnosis), res.diagnosis


def test_the_correct_step_selects_the_stale_token_away(tmp_path: Path) -> None:
    """Control: the same stale input, the band selected (the correct step): finite, it matches."""
    d = _dump(BAND, lambda x: _token(x, BAND), stale=True)
    assert math.isfinite(float(d["pg_loss"]))
    assert _check(tmp_path, d, BAND).match


def _on_policy_step(detach: bool, on_policy: bool = True) -> dict[str, Tensor]:
    """One micro-batch of a hand-written trainer on-policy (``l = l^old`` in value; ``on_policy``
    False: ``l`` as drawn): TIS cap 2 with the weight ``clamp(exp(l − l^beh), max=2)`` from the live
    ``l``, detached or not; the clipped surrogate, the clipped value loss, token means."""
    x = _inputs()
    if on_policy:
        x["logprobs"] = x["old_logprobs"].clone()
    d = naive_dump(x, setup_for(None, TIS2))
    m = d["response_mask"].bool()
    lp = d["logprobs"].clone().requires_grad_(True)
    v = d["values"].clone().requires_grad_(True)
    w = torch.clamp(torch.exp(torch.where(m, lp - d["rollout_logprobs"], 0.0)), max=2.0)
    w = w.detach() if detach else w
    ratio = torch.exp(torch.where(m, lp - d["old_logprobs"], 0.0))
    adv = d["advantages"]
    pg_tok = w * torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - EPS, 1 + EPS))
    eps_v = HP["cliprange_value"]
    v_clip = torch.clamp(v, d["old_values"] - eps_v, d["old_values"] + eps_v)
    vf_tok = 0.5 * torch.maximum((v - d["returns"]) ** 2, (v_clip - d["returns"]) ** 2)
    n = m.sum()
    pg = torch.where(m, pg_tok, 0.0).sum() / n
    g_lp, g_v = torch.autograd.grad(pg + HP["vf_coef"] * torch.where(m, vf_tok, 0.0).sum() / n, (lp, v))
    pg = pg.detach()
    loss = float(pg) + HP["vf_coef"] * float(d["vf_loss"]) - HP["ent_coef"] * float(d["entropy_loss"])
    out = {"pg_loss": pg, "loss": torch.tensor(loss, dtype=F64)}
    return {**d, **out, "grad_logprobs": torch.where(m, g_lp, 0.0), "grad_values": torch.where(m, g_v, 0.0)}


def test_a_weight_not_detached_is_named_from_the_gradient(tmp_path: Path) -> None:
    res = _check(tmp_path, _on_policy_step(detach=False), TIS2, world_size=1, micro_batches=1)
    assert res.first_divergence == "grad_logprobs", (res.first_divergence, res.diagnosis)
    assert res.quantities["pg_loss"].ok  # the values cannot show it: only the gradient
    assert _bugs(res) == ["is_weight_not_detached"], res.diagnosis
    assert [f["all_match"] for f in res.explained_by if f.get("bug") == "is_weight_not_detached"] == [True]


def test_off_policy_the_live_weight_is_named_and_the_detached_one_explains_the_values_only(
    tmp_path: Path,
) -> None:
    """Off-policy the live weight is also against the current policy: ``pg_loss`` diverges first;
    the weight not detached explains everything, the detached one against the current policy only
    the values (its gradient differs), and the diagnosis says so."""
    res = _check(
        tmp_path, _on_policy_step(detach=False, on_policy=False), TIS2, world_size=1, micro_batches=1
    )
    assert res.first_divergence == "pg_loss", (res.first_divergence, res.diagnosis)
    found = {f["bug"]: f["all_match"] for f in res.explained_by if f["kind"] == "bug"}
    assert found == {"is_weight_not_detached": True, "is_weight_against_current": False}, res.diagnosis
    assert any("(is_weight_against_current)" in line and "grad_logprobs still differs" in line
               for line in res.diagnosis), res.diagnosis  # fmt: skip


def test_the_detached_on_policy_step_matches(tmp_path: Path) -> None:
    """Control: the same hand-written step with the weight detached is the correct one."""
    res = _check(tmp_path, _on_policy_step(detach=True), TIS2, world_size=1, micro_batches=1)
    assert res.match, (res.first_divergence, res.diagnosis)


@pytest.mark.parametrize("conv", [TIS2, BAND, SEQ_GEO], ids=["tis", "band", "seq-geo"])
def test_a_clean_dump_names_no_rollout_bug(tmp_path: Path, conv: dict[str, Any]) -> None:
    """Every rollout bug re-enacted on a correct dump (the diagnosis asked to explain ``pg_loss``):
    none reproduces it (each changes the step on these inputs)."""
    s = setup_for(None, conv)
    path = tmp_path / "clean.safetensors"
    hp = {k: v for k, v in s.hparams_dict().items() if v is not None}
    write_dump(path, _dump(conv, None, stale=conv is BAND), hparams=hp)
    dump = load_dump(path)
    assert check(dump, s).match
    _, found = explain_bugs(dump, s, "pg_loss")
    assert not [f["bug"] for f in found if f["bug"] in RC_BUGS], found


REFUSED = [
    ("is_sum_not_mean", TIS2, "rollout_is_agg=geometric"),
    ("truncate_mask_swapped", {"rollout_is": "token"}, "a bound"),
    ("cap_on_log_ratio", {}, "the rollout correction on"),
    ("nonfinite_through_mask", TIS2, "mask mode"),
    ("is_weight_against_current", {}, "the rollout correction on"),
]


@pytest.mark.parametrize(("bug", "conv", "why"), REFUSED, ids=[r[0] for r in REFUSED])
def test_a_convention_it_cannot_run_refuses_the_bug(bug: str, conv: dict[str, Any], why: str) -> None:
    s = setup_for(None, conv)
    present = set(_inputs()) | {"grad_logprobs"}
    with pytest.raises(ValueError, match=f"the bug {bug} needs") as err:
        BUGS[bug].check(present, s.conv, s.hp)
    assert why in str(err.value) and "\n" not in str(err.value)


def test_the_gradient_bug_needs_the_gradient_and_every_bug_needs_the_engine_logprobs() -> None:
    s = setup_for(None, TIS2)
    x = _inputs()
    with pytest.raises(ValueError, match="needs grad_logprobs"):
        BUGS["is_weight_not_detached"].check(set(x), s.conv, s.hp)
    without = set(x) - {"rollout_logprobs"}
    for name in RC_BUGS:
        with pytest.raises(ValueError, match="rollout_logprobs"):
            BUGS[name].check(without | {"grad_logprobs"}, s.conv, s.hp)


GATED = {**TIS2, "rollout_rs": "token", "rollout_rs_stat": "k2", "rollout_rs_high": 0.3}
"""TIS at 2 with AReaL's ``kl_k2`` token gate ``½d² ≤ 0.3`` on top (the gate keys, #22 item 2)."""


def _gated(x: dict[str, Tensor], w: Weights) -> Weights:
    """``w'·[½d_t² ≤ 0.3]``, ``d = l^prox − l^beh``: the gate restated by the loops."""
    pairs = zip(w, _d(x), strict=True)
    return [[v if d * d / 2 <= 0.3 else 0.0 for v, d in zip(wr, dr, strict=True)] for wr, dr in pairs]


def test_a_bug_under_a_gate_is_named_with_the_gate_kept(tmp_path: Path) -> None:
    """The weight against the current policy, gated: named ``is_weight_against_current`` (the bug's
    stage keeps the gate); the same bug without the gate in the loops is not explained by it."""
    gated = _dump(GATED, lambda x: _gated(x, _token(x, TIS2, "logprobs")))
    res = _check(tmp_path, gated, GATED)
    assert res.first_divergence == "pg_loss", (res.first_divergence, res.diagnosis)
    assert _bugs(res) == ["is_weight_against_current"], res.diagnosis
    ungated = _dump(GATED, lambda x: _token(x, TIS2, "logprobs"))
    assert "is_weight_against_current" not in _bugs(_check(tmp_path, ungated, GATED))
