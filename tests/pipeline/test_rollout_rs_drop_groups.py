"""Group estimators under ``rollout_rs_effect=drop_mask`` (issue #22): the advantages read EVERY row's
score (group statistics over every row of the group, the rows the gate empties included), times the
gate's mask ``m'`` (verl 0.9.1 ``compute_grpo_outcome_advantage``; verl's own code:
tests/peers/test_peer_verl_rollout_rs_grpo.py); the emptied rows then leave the update's counts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from oracle_helpers import make_inputs

from refppo.conventions import Variance
from refppo.core.group import group_advantages
from refppo.errors import ConventionError, MaskError
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.stages import UPDATE_STAGES, walk
from refppo.pipeline.step import (
    rollout_quantities,
    rollout_quantities_naive,
    update_grads,
    update_inputs,
    update_quantities,
    update_quantities_naive,
)

HP = Hyperparams(gamma=1.0, lam=1.0, kl_coef=0.0, ent_coef=0.01, cliprange_value=0.3, vf_coef=0.0)
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])
SEQ_GATE = {
    "rollout_rs": "sequence",
    "rollout_rs_stat": "k3",
    "rollout_rs_order": "behaviour",
    "rollout_rs_reduce": "mean",
    "rollout_rs_high": 0.5,
    "rollout_rs_effect": "drop_mask",
}
"""verl ``seq_mean_k3`` at 0.5: row 2 (behaviour 1.5 below the proximal log-probs) is rejected whole."""


def _batch(seed: int, shift_row: int | None = 2, noise: float = 0.05) -> tuple[dict[str, Any], Any, Any]:
    x = make_inputs(B=6, T=8, seed=seed)
    m = x.pop("response_mask").bool()
    g = torch.Generator().manual_seed(seed + 100)
    beh = x["old_logprobs"] - noise * torch.randn(m.shape, generator=g, dtype=torch.float64)
    if shift_row is not None:
        beh[shift_row] = x["old_logprobs"][shift_row] - 1.5
    return x, m, torch.where(m, beh, 7.5)


def _rollout(x: dict[str, Any], m: Any, beh: Any, conv: Convention, naive: bool = False) -> Any:
    f = rollout_quantities_naive if naive else rollout_quantities
    return f(
        scores=x["scores"], old_logprobs=x["old_logprobs"], ref_logprobs=x["ref_logprobs"], old_values=None,
        mask=m, hp=HP, conv=conv, rollout_logprobs=beh, group_index=GROUPS,
    )  # fmt: skip


def _core_grpo(scores: torch.Tensor, m: torch.Tensor, rows: torch.Tensor, conv: Convention) -> torch.Tensor:
    """The core's GRPO on ``rows`` of the batch (``m``: the original mask), 0 elsewhere."""
    a = group_advantages(
        scores[rows].double(), GROUPS[rows], m[rows], unbiased_std=conv.adv.group_std is Variance.UNBIASED,
        eps=conv.adv.group_eps, singleton=conv.adv.group_singleton.value, whiten=False,
    )  # fmt: skip
    out = torch.zeros(m.shape, dtype=torch.float64)
    out[rows] = a
    return out


def test_grpo_under_a_row_emptying_gate_reads_every_rows_score() -> None:
    x, m, beh = _batch(3)
    conv = Convention.of(**SEQ_GATE, advantage="grpo", whiten_advantages="none", kl_in="loss")
    ro = _rollout(x, m, beh, conv)
    m2 = ro.value_mask
    kept = m2.any(1)
    assert kept.tolist() == [True, True, False, True, True, True]
    every = torch.where(m2, _core_grpo(x["scores"], m, torch.ones(6, dtype=torch.bool), conv), 0.0)
    assert float((ro.advantages - every).abs().max()) <= 1e-12
    assert float(ro.advantages[2].abs().max()) == 0.0
    kept_only = torch.where(m2, _core_grpo(x["scores"], m, kept, conv), 0.0)
    assert float((ro.advantages - kept_only).abs().max()) > 1e-2  # the control: kept rows' statistics
    nai = _rollout(x, m, beh, conv, naive=True)
    assert float((ro.advantages - nai.advantages).abs().max()) <= 1e-12


def test_opo_under_a_row_emptying_gate_is_refused_in_one_line() -> None:
    x, m, beh = _batch(3)
    conv = Convention.of(**SEQ_GATE, advantage="opo", whiten_advantages="none", kl_in="loss")
    with pytest.raises(ConventionError, match="advantage=opo"):
        _rollout(x, m, beh, conv)


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    est=st.sampled_from(["grpo", "dr-grpo", "rloo", "reinforce++-baseline", "gpg", "flash-reinforce"]),
    high=st.floats(0.02, 0.6),
    level=st.sampled_from(["token", "sequence"]),
    agg=st.sampled_from(["token-mean", "seq-mean-token-mean"]),
    whiten=st.sampled_from(["none", "masked"]),
)
def test_the_stage_walk_equals_the_naive_twins_for_group_estimators(
    seed: int, est: str, high: float, level: str, agg: str, whiten: str
) -> None:
    x, m, beh = _batch(seed, shift_row=seed % 6, noise=0.3)
    keys = {**SEQ_GATE, "rollout_rs": level, "rollout_rs_high": high}
    more = {"advantage": est, "whiten_advantages": whiten, "loss_agg": agg, "group_singleton": "zero"}
    conv = Convention.of(**keys, **more)
    try:
        vec = _rollout(x, m, beh, conv)
    except MaskError:
        assume(False)
    nai = _rollout(x, m, beh, conv, naive=True)
    assert torch.equal(vec.value_mask, nai.value_mask)
    km = vec.value_mask
    for name in ("advantages", "returns"):  # every position: 0 off m' in both
        assert float((getattr(vec, name) - getattr(nai, name)).abs().max()) <= 1e-12, name
    kw: dict[str, Any] = dict(
        logprobs=x["logprobs"], values=x["values"], old_logprobs=x["old_logprobs"],
        old_values=x["old_values"], advantages=vec.advantages, returns=vec.returns, mask=m,
        ref_logprobs=x["ref_logprobs"], entropy=x["entropy"], rollout_logprobs=beh,
    )  # fmt: skip
    q = update_inputs(**kw)
    uq, un = update_quantities(**kw, hp=HP, conv=conv), update_quantities_naive(q, hp=HP, conv=conv)
    for name in ("loss", "pg_loss", "entropy_loss", "pg_clipfrac", "approx_kl"):
        assert abs(float(getattr(uq, name)) - float(getattr(un, name))) <= 1e-12, name
    out = walk(UPDATE_STAGES, q, conv, HP, naive=True)
    assert abs(float(out["pg_loss"]) - float(uq.pg_loss)) <= 1e-12
    grad = update_grads(q, hp=HP, conv=conv)["grad_logprobs"]
    assert grad is not None and float(grad[~km.any(1)].abs().sum()) == 0.0  # emptied rows: no gradient
