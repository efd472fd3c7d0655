"""CISPO and AReaL's decoupled PPO objective in the stage table, checked end to end (issue #22 items 2, 6).

``policy_loss=cispo`` (:class:`refppo.conventions.PolicyLoss`): the policy stage calls
:func:`refppo.core.cispo.cispo_policy_loss`, its naive twin ``cispo_policy_loss_naive``,
the gradient twin ``pipeline.grad_naive.cispo_grad_naive``. The decoupled objective (AReaL 1.0.4
``ppo_actor_loss_fn`` with ``use_decoupled_loss``) is the vanilla surrogate against the proximal
log-probs (``old_logprobs``) times the behaviour weight masked above ``behav_imp_weight_cap``: the
stage table's ``rollout_is=token, rollout_is_mode=mask, rollout_is_high=cap`` (no second member).

Dumps come from the naive twins (``oracle_helpers.naive_dump``) or, for the gradient, from a step
written here with torch ops (never the pipeline); each matches under its convention, a control with
the member flipped mismatches, and ``--detect`` from refppo's defaults lists the generating one.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from oracle_helpers import HP, make_inputs, naive_dump, rows, setup_for, with_behaviour
from torch import Tensor

from refppo.dump.load import load_dump
from refppo.dump.write import write_dump
from refppo.errors import ConventionError
from refppo.oracle.check.diagnose import CheckResult, check
from refppo.oracle.detect.detection import detect, setup_from_json

F64 = torch.float64
DECOUPLED = {"rollout_is": "token", "rollout_is_mode": "mask", "rollout_is_high": 5.0}
"""AReaL 1.0.4's decoupled loss, ``behav_imp_weight_cap`` 5 (``rejection_sampling`` token, mask)."""
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # name: (the generating convention, its control: one member flipped)
    "cispo": ({"policy_loss": "cispo"}, {"policy_loss": "vanilla"}),
    "cispo-k20": ({"policy_loss": "cispo", "log_ratio_clamp": 20.0}, {"policy_loss": "vanilla"}),
    "cispo-tis": (
        {"policy_loss": "cispo", "rollout_is": "token", "rollout_is_high": 2.0},
        {"rollout_is": None},
    ),
    "decoupled": (DECOUPLED, {"rollout_is_mode": "truncate"}),
    "decoupled-neg-k1": ({**DECOUPLED, "approx_kl": "neg_k1"}, {"rollout_is": None}),
}


def _inputs() -> dict[str, Tensor]:
    """B=8, T=12; behaviour log-probs ``l^prox − N(0, 1)`` (weights ≈ 0.1..10: the cap 5 and 2 bind)."""
    return with_behaviour(make_inputs(B=8, T=12, seed=5), scale=1.0)


def _save(tmp: Path, d: dict[str, Tensor], conv: dict[str, Any], **extra: int) -> CheckResult:
    s = setup_for(None, conv)
    hp = {k: v for k, v in s.hparams_dict().items() if v is not None}
    path = tmp / "step.safetensors"
    write_dump(path, d, hparams={**hp, **extra})
    return check(load_dump(path), s)


def test_the_inputs_make_each_member_act() -> None:
    """CISPO's clip binds on some tokens (not all), the cap 5 rejects some tokens (else a match
    proves nothing)."""
    x = _inputs()
    m = x["response_mask"].bool().tolist()
    d = [
        [a - b for a, b in zip(ra, rb, strict=True)]
        for ra, rb in zip(rows(x["logprobs"]), rows(x["old_logprobs"]), strict=True)
    ]
    w = [
        [a - b for a, b in zip(ra, rb, strict=True)]
        for ra, rb in zip(rows(x["old_logprobs"]), rows(x["rollout_logprobs"]), strict=True)
    ]
    valid = [(d[b][t], w[b][t]) for b in range(8) for t in range(12) if m[b][t]]
    clipped = [abs(math.exp(v) - 1) > HP["cliprange"] for v, _ in valid]
    assert any(clipped) and not all(clipped)
    rejected = [math.exp(v) > 5.0 for _, v in valid]
    assert any(rejected) and not all(rejected)


@pytest.mark.parametrize("case", list(CASES))
def test_a_naive_dump_matches_under_its_member_and_not_under_the_control(tmp_path: Path, case: str) -> None:
    conv, flip = CASES[case]
    d = naive_dump(_inputs(), setup_for(None, conv))
    res = _save(tmp_path, d, conv)
    assert res.match, (case, res.first_divergence, res.diagnosis)
    ctl = _save(tmp_path, d, {**conv, **flip})
    assert not ctl.match and ctl.first_divergence == "pg_loss", (case, ctl.first_divergence)


def _cispo_step(detach: bool) -> dict[str, Tensor]:
    """One hand-written CISPO micro-batch (torch ops, not refppo's): ``−sg(clamp(exp(l − l^old),
    0.8, 1.2))·A·l`` token-mean, the clipped value loss; ``detach`` False: the clipped ratio is
    left in the graph (a CISPO whose weight is not stopped)."""
    x = _inputs()
    d = naive_dump(x, setup_for(None, {"policy_loss": "cispo"}))
    m = d["response_mask"].bool()
    lp = d["logprobs"].clone().requires_grad_(True)
    v = d["values"].clone().requires_grad_(True)
    eps = HP["cliprange"]
    c = torch.clamp(torch.exp(torch.where(m, lp - d["old_logprobs"], 0.0)), 1 - eps, 1 + eps)
    c = c.detach() if detach else c
    pg_tok = -c * d["advantages"] * lp
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


def test_the_cispo_gradient_is_checked_through_the_update(tmp_path: Path) -> None:
    """v2: the hand-written CISPO step's gradient matches under ``policy_loss=cispo`` (its gradient
    ``−c·A/N`` on every token, clipped ones too), and not under ``vanilla`` (0 where clipped)."""
    conv = {"policy_loss": "cispo"}
    d = _cispo_step(detach=True)
    res = _save(tmp_path, d, conv, world_size=1, micro_batches=1)
    assert res.match and "grad_logprobs" in res.quantities, (res.first_divergence, res.diagnosis)
    van = _save(tmp_path, d, {}, world_size=1, micro_batches=1)
    assert not van.match and van.first_divergence == "pg_loss"


def test_a_cispo_weight_left_in_the_graph_is_caught_at_the_gradient(tmp_path: Path) -> None:
    """The clipped ratio not detached: the values are CISPO's, the gradient adds ``−A·l·∂c/∂l``."""
    res = _save(tmp_path, _cispo_step(detach=False), {"policy_loss": "cispo"}, world_size=1, micro_batches=1)
    assert not res.match and res.first_divergence == "grad_logprobs", (res.first_divergence, res.diagnosis)
    assert res.quantities["pg_loss"].ok


def test_cispo_refuses_a_dual_clip() -> None:
    with pytest.raises(ConventionError, match="dual_clip: policy_loss=cispo has no dual-clip"):
        setup_for(None, {"policy_loss": "cispo", "dual_clip": 3.0})


def _same(c: dict[str, Any], conv: dict[str, Any], w: list[float]) -> bool:
    """``c`` has ``conv``'s members; a different ``rollout_is_high`` rejects the same tokens of ``w``
    (the dump's weights): no dump can tell a cap from another between two observed weights."""
    if any(c.get(k) != v for k, v in conv.items() if k not in ("log_ratio_clamp", "rollout_is_high")):
        return False
    hi, own = c.get("rollout_is_high"), conv.get("rollout_is_high")
    if own is None or hi is None:
        return hi == own
    return [v > hi for v in w] == [v > own for v in w]


@pytest.mark.parametrize("case", ["cispo", "cispo-k20", "decoupled"])
def test_detect_from_the_defaults_lists_the_generating_member(tmp_path: Path, case: str) -> None:
    """From refppo's defaults (vanilla, no correction) ``--detect`` lists the generating member
    (re-checked: each listed one matches), and never the control's token-level flip."""
    conv, flip = CASES[case]
    x = _inputs()
    d = naive_dump(x, setup_for(None, conv))
    start = setup_for(None, {})
    hp = {k: v for k, v in start.hparams_dict().items() if v is not None}
    write_dump(tmp_path / "s.safetensors", d, hparams=hp)
    dump = load_dump(tmp_path / "s.safetensors")
    assert not check(dump, start).match
    det = detect(dump, start, limit=100000)
    assert det.detected, (det.unmatched_stages, det.nearest)
    m = x["response_mask"].bool()
    w = (x["old_logprobs"] - x["rollout_logprobs"]).exp()[m].tolist()
    listed = [c for c in det.detected if _same(c, conv, w)]
    assert listed, (case, det.detected[:5])
    for c in listed[:5]:
        assert check(dump, setup_from_json(start, c), explain_divergence=False).match, c
    flipped = [c for c in det.detected if _same(c, {**conv, **flip}, w)]
    assert not flipped, (case, flipped[:3])


def test_cispo_without_a_graph_gives_the_graph_paths_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """CISPO has no by-rows kernel: without a graph (the oracle's big-dump path, blocks of rows) the
    policy stage runs the whole batch under ``no_grad`` and gives the graph path's values exactly."""
    from refppo.pipeline import blocks as m_blocks
    from refppo.pipeline.blocks import Normalisers
    from refppo.pipeline.step import rollout_quantities, update_quantities

    x = _inputs()
    s = setup_for(None, CASES["cispo-tis"][0])
    m = x["response_mask"].bool()
    rq = rollout_quantities(
        scores=x["scores"], old_logprobs=x["old_logprobs"], ref_logprobs=x["ref_logprobs"],
        old_values=x["old_values"], mask=m, hp=s.hp, conv=s.conv,
    )  # fmt: skip

    def run(lp: Tensor, v: Tensor) -> Any:
        return update_quantities(
            logprobs=lp, values=v, old_logprobs=x["old_logprobs"], old_values=x["old_values"],
            advantages=rq.advantages, returns=rq.returns, mask=m, value_mask_=rq.value_mask,
            ref_logprobs=x["ref_logprobs"], hp=s.hp, conv=s.conv, norm=Normalisers(),
            rollout_logprobs=x["rollout_logprobs"],
        )  # fmt: skip

    want = run(x["logprobs"].clone().requires_grad_(), x["values"].clone().requires_grad_())
    monkeypatch.setattr(m_blocks, "ROW_BLOCK_ELEMENTS", 24)  # blocks of two rows
    got = run(x["logprobs"], x["values"])
    for f in ("pg_loss", "pg_clipfrac", "approx_kl", "loss"):
        assert torch.equal(getattr(got, f).detach(), getattr(want, f).detach()), f
    assert not got.pg_loss.requires_grad
