"""Four classic bugs that the oracle caught without naming (issue #21, item 4), now named and
re-checked through the pipeline: the KL penalty with the wrong sign, the ratio against the
reference log-probs, the value clip around the new values, and advantages from the live critic
output that are also whitened (the statistics held fixed or taken on the live values).

Each buggy quantity is written here from the bug's definition — plain loops over Python floats for
the values (``oracle_helpers``), a few hand-written torch lines and autograd for the gradients —
never with the oracle's re-enactment, so a wrong diagnosis fails the test. The dump also names no
other bug: each re-enactment explains only its own bug.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from oracle_helpers import (
    HP,
    gae_loop,
    lengths_of,
    make_inputs,
    refppo_dump,
    rows,
    save,
    setup_for,
    whiten_list,
)
from torch import Tensor

from refppo.dump.load import load_dump
from refppo.dump.write import write_dump
from refppo.oracle.check.diagnose import CheckResult, check

F64 = torch.float64
GAMMA, LAM, BETA, EPS, EPS_V = HP["gamma"], HP["lam"], HP["kl_coef"], HP["cliprange"], HP["cliprange_value"]


def _check(tmp_path: Path, d: dict[str, Tensor], **conv: str) -> CheckResult:
    s = setup_for(conv=conv)
    return check(load_dump(save(tmp_path, d, s)), s)


def _named(res: CheckResult) -> list[str]:
    return [str(f.get("bug", f.get("change"))) for f in res.explained_by]


def _text(res: CheckResult) -> str:
    return "\n".join(res.diagnosis)


def _base(seed: int = 3, **conv: str) -> tuple[dict[str, Tensor], list[int]]:
    inp = make_inputs(B=6, T=12, seed=seed)
    return refppo_dump(inp, setup_for(conv=conv)), lengths_of(inp["response_mask"])


def _loss(d: dict[str, Tensor], pg: float, vf: float) -> Tensor:
    """``pg + vf_coef·vf − ent_coef·H`` (spec/ppo.md; the KL sits in the reward)."""
    return torch.tensor(pg + HP["vf_coef"] * vf - HP["ent_coef"] * float(d["entropy_loss"]), dtype=F64)


def test_kl_penalty_added_with_the_wrong_sign_is_named(tmp_path: Path) -> None:
    d, lengths = _base()
    B, T = d["response_mask"].shape
    kl, v, scores = rows(d["kl"]), rows(d["old_values"]), d["scores"].tolist()
    r = [[(BETA * kl[b][t] if t < lengths[b] else 0.0) for t in range(T)] for b in range(B)]
    for b in range(B):
        r[b][lengths[b] - 1] += scores[b]  # the score at the last valid token
    raw = [gae_loop(r[b], v[b], lengths[b], GAMMA, LAM, 0.0) + [0.0] * (T - lengths[b]) for b in range(B)]
    mu, inv = whiten_list([raw[b][t] for b in range(B) for t in range(lengths[b])])
    d["token_rewards"] = torch.tensor(r, dtype=F64)
    d["advantages"] = torch.tensor(
        [[(raw[b][t] - mu) * inv if t < lengths[b] else 0.0 for t in range(T)] for b in range(B)], dtype=F64
    )
    d["returns"] = torch.tensor(
        [[raw[b][t] + v[b][t] if t < lengths[b] else 0.0 for t in range(T)] for b in range(B)], dtype=F64
    )
    for k in ("pg_loss", "pg_clipfrac", "vf_loss", "vf_clipfrac", "loss"):
        d.pop(k)
    res = _check(tmp_path, d)
    assert res.first_divergence == "token_rewards" and res.quantities["kl"].ok
    assert _named(res) == ["kl_reward_sign_flipped"], _text(res)
    assert res.explained_by[0]["all_match"]
    assert "r_t = +β·KL_t" in _text(res)
    assert "no single convention change" not in _text(res)


def test_the_sign_flip_is_not_tried_without_a_reward_kl(tmp_path: Path) -> None:
    """With the KL in the loss there is no reward penalty to flip: the bug is never named, even
    when the dump's rewards carry +β·KL (they are then a different mistake)."""
    d, _ = _base(kl_in="loss")
    kl = d["kl"]
    d["token_rewards"] = d["token_rewards"] + BETA * torch.where(d["response_mask"].bool(), kl, 0.0)
    for k in ("advantages", "returns", "pg_loss", "pg_clipfrac", "vf_loss", "vf_clipfrac", "loss"):
        d.pop(k)
    res = _check(tmp_path, d, kl_in="loss")
    assert res.first_divergence == "token_rewards"
    assert "kl_reward_sign_flipped" not in _named(res), _text(res)


def _pg_by_loops(d: dict[str, Tensor], lengths: list[int], against: str) -> tuple[float, float, float]:
    """``(pg_loss, pg_clipfrac, approx_kl)`` token-means with ``ρ = exp(l − l_<against>)``."""
    lp, base, adv = rows(d["logprobs"]), rows(d[against]), rows(d["advantages"])
    pg, clipped, kl, n = 0.0, 0, 0.0, 0
    for b, length in enumerate(lengths):
        for t in range(length):
            ratio = math.exp(lp[b][t] - base[b][t])
            cut = min(max(ratio, 1 - EPS), 1 + EPS)
            pg += max(-adv[b][t] * ratio, -adv[b][t] * cut)
            clipped += -adv[b][t] * cut > -adv[b][t] * ratio
            kl += base[b][t] - lp[b][t]
            n += 1
    return pg / n, clipped / n, kl / n


def test_ratio_against_the_reference_logprobs_is_named(tmp_path: Path) -> None:
    d, lengths = _base()
    pg, frac, akl = _pg_by_loops(d, lengths, "ref_logprobs")
    assert frac > 0  # the clip binds: the clipped branch is part of what is checked
    d["pg_loss"], d["pg_clipfrac"], d["approx_kl"] = (torch.tensor(x, dtype=F64) for x in (pg, frac, akl))
    d["loss"] = _loss(d, pg, float(d["vf_loss"]))
    res = _check(tmp_path, d)
    assert res.first_divergence == "pg_loss"
    assert _named(res) == ["ratio_against_ref"], _text(res)
    assert res.explained_by[0]["all_match"]
    assert "exp(log π − log π_ref)" in _text(res)
    assert "a constant factor can point at the loss aggregation" not in _text(res)


def _vf_by_loops(d: dict[str, Tensor], lengths: list[int]) -> tuple[float, float]:
    """``(vf_loss, vf_clipfrac)`` with ``V_clip = V + clip(V − V_old, ±ε_v)``, token-mean."""
    v, vo, ret = rows(d["values"]), rows(d["old_values"]), rows(d["returns"])
    total, clipped, n = 0.0, 0, 0
    for b, length in enumerate(lengths):
        for t in range(length):
            v_clip = v[b][t] + min(max(v[b][t] - vo[b][t], -EPS_V), EPS_V)
            e1, e2 = (v[b][t] - ret[b][t]) ** 2, (v_clip - ret[b][t]) ** 2
            total += 0.5 * max(e1, e2)
            clipped += e2 > e1
            n += 1
    return total / n, clipped / n


def test_value_clip_around_the_new_values_is_named(tmp_path: Path) -> None:
    d, lengths = _base()
    vf, frac = _vf_by_loops(d, lengths)
    d["vf_loss"], d["vf_clipfrac"] = torch.tensor(vf, dtype=F64), torch.tensor(frac, dtype=F64)
    d["loss"] = _loss(d, float(d["pg_loss"]), vf)
    res = _check(tmp_path, d)
    assert res.first_divergence == "vf_loss"
    assert _named(res) == ["value_clip_around_new"], _text(res)
    assert res.explained_by[0]["all_match"]
    assert "V + clip(V − V_old, ±ε_v)" in _text(res)


def _live_whitened_step(live: bool, seed: int = 5) -> dict[str, Tensor]:
    """One micro-batch (the whole step) of a hand-written trainer whose advantages are
    ``whiten(R − V)`` of the live critic output, the mean and unbiased std taken on the live tensor
    (``live``) or held as numbers; at ``V = V_old`` their values are the rollout's."""
    inp = make_inputs(B=6, T=12, seed=seed)
    inp["values"] = inp["old_values"].clone()  # the first update after the rollout
    d = refppo_dump(inp, setup_for())
    m = d["response_mask"].bool()
    lp = d["logprobs"].clone().requires_grad_(True)
    v = d["values"].clone().requires_grad_(True)
    raw = d["returns"] - v
    stats = raw[m] if live else raw[m].detach()
    mu, sigma = stats.mean(), torch.sqrt(stats.var() + 1e-8)
    adv = torch.where(m, (raw - mu) / sigma, 0.0)
    assert torch.allclose(adv.detach(), d["advantages"], rtol=0, atol=1e-12)  # the rollout's values
    ratio = torch.exp(lp - d["old_logprobs"])
    pg_tok = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - EPS, 1 + EPS))
    v_clip = torch.clamp(v, d["old_values"] - EPS_V, d["old_values"] + EPS_V)
    vf_tok = 0.5 * torch.maximum((v - d["returns"]) ** 2, (v_clip - d["returns"]) ** 2)
    n = m.sum()
    loss = torch.where(m, pg_tok, 0.0).sum() / n + HP["vf_coef"] * torch.where(m, vf_tok, 0.0).sum() / n
    g_lp, g_v = torch.autograd.grad(loss, (lp, v))
    return {**d, "grad_logprobs": torch.where(m, g_lp, 0.0), "grad_values": torch.where(m, g_v, 0.0)}


def _check_step(tmp_path: Path, d: dict[str, Tensor]) -> CheckResult:
    path = tmp_path / "step.safetensors"
    write_dump(path, d, hparams={**HP, "world_size": 1, "micro_batches": 1})
    return check(load_dump(path), setup_for())


def test_whitened_advantages_not_detached_fixed_statistics_are_named(tmp_path: Path) -> None:
    res = _check_step(tmp_path, _live_whitened_step(live=False))
    assert res.first_divergence == "grad_values"
    assert _named(res) == ["advantages_not_detached_whitened"], _text(res)
    assert res.explained_by[0]["all_match"]
    assert "A = (R − V − μ)/σ" in _text(res)


def test_whitened_advantages_not_detached_live_statistics_are_named(tmp_path: Path) -> None:
    res = _check_step(tmp_path, _live_whitened_step(live=True))
    assert res.first_divergence == "grad_values"
    assert _named(res) == ["advantages_not_detached_whitened_live"], _text(res)
    assert res.explained_by[0]["all_match"]
    assert "the mean and std taken on V in the graph" in _text(res)


def test_the_live_statistics_change_the_gradient() -> None:
    """Control: the two whitened forms are different gradients (so each name is a finding)."""
    a, b = _live_whitened_step(live=True), _live_whitened_step(live=False)
    scale = float(b["grad_values"].abs().max())
    assert float((a["grad_values"] - b["grad_values"]).abs().max()) > 1e-3 * scale
