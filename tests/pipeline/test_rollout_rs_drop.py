"""``rollout_rs_effect=drop_mask`` (verl 0.9.1 rollout rejection sampling): the gate's kept tokens are
the response mask of every stage after the reward (spec/rollout-correction.md).

- truth table, value and gradient, for kept and rejected tokens under both effects (hand-worked);
- GAE reads the kept tokens: verl's ``compute_gae_advantage_return`` loop, restated here;
- a row the gate empties leaves every count: the losses and gradient of the batch without that row;
- property: the stage walk equals the naive twins' walk to 1e-12 (rollout, update, gradient).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from oracle_helpers import make_inputs

from refppo.errors import MaskError
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.stages import BY_NAME, UPDATE_STAGES, walk
from refppo.pipeline.step import (
    rollout_quantities,
    rollout_quantities_naive,
    update_grads,
    update_inputs,
    update_quantities,
    update_quantities_naive,
)

HP = Hyperparams(gamma=0.97, lam=0.9, kl_coef=0.1, ent_coef=0.0, cliprange_value=0.3, vf_coef=0.0)
GATE = {"rollout_rs": "token", "rollout_rs_stat": "ratio", "rollout_rs_order": "behaviour",
        "rollout_rs_low": 0.5, "rollout_rs_high": 2.0}  # fmt: skip
"""A token gate keeping ``e^x`` in [0.5, 2], ``x = l^beh − l^prox`` (verl ``token_k1`` "0.5_2.0")."""


def _table(effect: str, agg: str) -> tuple[Any, Any, Any]:
    """(pg_loss, entropy_loss, grad_logprobs) of a 2×3 batch with ratio 1 (``l = l^old = 0``), the
    advantages ``A`` and entropies ``H`` ``[[1, 2, 3], [4, 5, ·]]``; the behaviour log-probs make
    ``x = [[0, 1, 0], [0, −1, ·]]``: the gate rejects (0, 1) (``e^1 > 2``) and (1, 1) (``e^−1 < 0.5``)."""
    m = torch.tensor([[True, True, True], [True, True, False]])
    z = torch.zeros(2, 3, dtype=torch.float64)
    a = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]], dtype=torch.float64)
    beh = torch.tensor([[0.0, 1.0, 0.0], [0.0, -1.0, 7.5]], dtype=torch.float64)
    conv = Convention.of(**GATE, rollout_rs_effect=effect, loss_agg=agg)
    kw: dict[str, Any] = dict(
        logprobs=z, values=z, old_logprobs=z, old_values=z, advantages=a, returns=z, mask=m,
        ref_logprobs=z, entropy=a, rollout_logprobs=beh,
    )  # fmt: skip
    uq = update_quantities(**kw, hp=HP, conv=conv)
    un = update_quantities_naive(update_inputs(**kw), hp=HP, conv=conv)
    assert abs(float(uq.pg_loss) - float(un.pg_loss)) <= 1e-12
    assert abs(float(uq.entropy_loss) - float(un.entropy_loss)) <= 1e-12
    grad = update_grads(update_inputs(**kw), hp=HP, conv=conv, objective="pg_loss")["grad_logprobs"]
    return float(uq.pg_loss), float(uq.entropy_loss), grad


def test_truth_table_of_value_and_gradient_for_kept_and_rejected_tokens() -> None:
    t = torch.tensor
    # drop_mask: 3 kept tokens (1, 3 in row 0; 4 in row 1) are the whole step
    pg, ent, g = _table("drop_mask", "token-mean")
    assert abs(pg - (-8 / 3)) <= 1e-12 and abs(ent - 8 / 3) <= 1e-12
    want = t([[-1 / 3, 0.0, -1.0], [-4 / 3, 0.0, 0.0]], dtype=torch.float64)
    assert float((g - want).abs().max()) <= 1e-12
    pg, ent, g = _table("drop_mask", "seq-mean-token-mean")  # rows: −(1+3)/2, −4/1
    assert abs(pg - (-3.0)) <= 1e-12 and abs(ent - 3.0) <= 1e-12  # (2 + 4)/2
    want = t([[-1 / 4, 0.0, -3 / 4], [-2.0, 0.0, 0.0]], dtype=torch.float64)
    assert float((g - want).abs().max()) <= 1e-12
    # weight: rejected tokens have weight 0 but count (5 valid tokens); the entropy sees every token
    pg, ent, g = _table("weight", "token-mean")
    assert abs(pg - (-8 / 5)) <= 1e-12 and abs(ent - 3.0) <= 1e-12
    want = t([[-1 / 5, 0.0, -3 / 5], [-4 / 5, 0.0, 0.0]], dtype=torch.float64)
    assert float((g - want).abs().max()) <= 1e-12


def _batch(seed: int, noise: float = 0.6) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    x = make_inputs(B=6, T=10, seed=seed)
    m = x.pop("response_mask").bool()
    g = torch.Generator().manual_seed(seed + 100)
    beh = x["old_logprobs"] - noise * torch.randn(m.shape, generator=g, dtype=torch.float64)
    return x, m, torch.where(m, beh, 7.5)


def _rollout(
    x: dict[str, Any], m: torch.Tensor, beh: torch.Tensor, conv: Convention, naive: bool = False
) -> Any:
    f = rollout_quantities_naive if naive else rollout_quantities
    return f(
        scores=x["scores"], old_logprobs=x["old_logprobs"], ref_logprobs=x["ref_logprobs"],
        old_values=x["old_values"], mask=m, hp=HP, conv=conv, rollout_logprobs=beh,
    )  # fmt: skip


def test_gae_reads_the_kept_tokens_as_verl() -> None:
    """verl 0.9.1 ``compute_gae_advantage_return`` on the gate's mask (restated: the TD error of a
    rejected token is not carried, its value skipped); the rewards before the gate keep the score and
    the KL on every valid token (``apply_kl_penalty`` runs first)."""
    x, m, beh = _batch(11)
    conv = Convention.of(**GATE, rollout_rs_effect="drop_mask", gae_holes="skip", whiten_advantages="none")
    ro = _rollout(x, m, beh, conv)
    x1 = beh - x["old_logprobs"]
    kept = m & (x1.exp() >= 0.5) & (x1.exp() <= 2.0)
    assert 0 < int(kept.sum()) < int(m.sum()) and bool(kept.any(1).all())
    assert torch.equal(ro.value_mask, kept)
    r, v, k = ro.token_rewards, x["old_values"], kept.to(torch.float64)
    nv = lg = torch.zeros(6, dtype=torch.float64)
    adv = torch.zeros_like(r)
    for t in reversed(range(r.shape[1])):
        lg_new = r[:, t] + HP.gamma * nv - v[:, t] + HP.gamma * HP.lam * lg
        nv = v[:, t] * k[:, t] + (1 - k[:, t]) * nv
        lg = lg_new * k[:, t] + (1 - k[:, t]) * lg
        adv[:, t] = lg
    assert float((ro.advantages - adv)[kept].abs().max()) <= 1e-12
    assert float((ro.returns - (adv + v))[kept].abs().max()) <= 1e-12
    plain = _rollout(x, m, beh, conv.with_updates({"rollout_rs_effect": "weight"}))
    assert float((plain.advantages - adv)[kept].abs().max()) > 1e-3  # the gate's mask binds


def test_a_row_the_gate_empties_leaves_every_count() -> None:
    """A sequence gate rejecting whole rows: the losses and gradient equal those of the batch without
    those rows (no gate), the emptied rows' gradient is 0 (verl ``agg_loss``: "exclude fully masked
    sequences")."""
    x, m, beh = _batch(12, noise=0.5)
    gate = {"rollout_rs": "sequence", "rollout_rs_stat": "k3", "rollout_rs_order": "behaviour",
            "rollout_rs_reduce": "mean", "rollout_rs_high": 0.1}  # fmt: skip
    conv = Convention.of(**gate, rollout_rs_effect="drop_mask", loss_agg="seq-mean-token-mean")
    ro = _rollout(x, m, beh, conv)
    rows = ro.value_mask.any(1)
    assert 0 < int(rows.sum()) < 6, rows
    kw: dict[str, Any] = dict(
        logprobs=x["logprobs"], values=x["values"], old_logprobs=x["old_logprobs"],
        old_values=x["old_values"], advantages=ro.advantages, returns=ro.returns, mask=m,
        ref_logprobs=x["ref_logprobs"], entropy=x["entropy"], rollout_logprobs=beh,
    )  # fmt: skip
    hp = Hyperparams(gamma=0.97, lam=0.9, kl_coef=0.1, ent_coef=0.01, cliprange_value=0.3)
    full = update_quantities(**kw, hp=hp, conv=conv)
    sub = {k: v[rows] for k, v in kw.items()}
    alone = update_quantities(**sub, hp=hp, conv=Convention.of(loss_agg="seq-mean-token-mean"))
    for name in ("loss", "pg_loss", "vf_loss", "entropy_loss", "pg_clipfrac", "approx_kl", "vf_clipfrac"):
        assert abs(float(getattr(full, name)) - float(getattr(alone, name))) <= 1e-12, name
    g = update_grads(update_inputs(**kw), hp=hp, conv=conv)
    ga = update_grads(update_inputs(**sub), hp=hp, conv=Convention.of(loss_agg="seq-mean-token-mean"))
    for name in ("grad_logprobs", "grad_values"):
        assert float(g[name][~rows].abs().max()) == 0.0
        assert float((g[name][rows] - ga[name]).abs().max()) <= 1e-12, name


_STATS = st.sampled_from(["ratio", "k1", "k2", "k3"])


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    level=st.sampled_from(["token", "sequence"]),
    stat=_STATS,
    reduce=st.sampled_from(["sum", "mean", "max"]),
    high=st.floats(0.05, 1.5),
    agg=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]),
    tis=st.booleans(),
)
def test_the_stage_walk_equals_the_naive_twins(
    seed: int, level: str, stat: str, reduce: str, high: float, agg: str, tis: bool
) -> None:
    x, m, beh = _batch(seed, noise=0.4)
    low = 1 / (1 + high) if stat == "ratio" else None
    keys: dict[str, Any] = {
        "rollout_rs": level, "rollout_rs_stat": stat, "rollout_rs_order": "behaviour",
        "rollout_rs_reduce": reduce,
        "rollout_rs_low": low, "rollout_rs_high": 1 + high if stat == "ratio" else high,
        "rollout_rs_effect": "drop_mask", "loss_agg": agg,
    }  # fmt: skip
    if tis:
        keys.update(rollout_is="sequence", rollout_is_mode="truncate", rollout_is_high=2.0)
    conv = Convention.of(**keys)
    try:
        vec = _rollout(x, m, beh, conv)
    except MaskError as e:  # the gate rejected every token: one line, the naive twin says the same
        assert "rejects every token of the batch" in str(e)
        with pytest.raises(MaskError, match="rejects every token of the batch"):
            _rollout(x, m, beh, conv, naive=True)
        assume(False)
    nai = _rollout(x, m, beh, conv, naive=True)
    assert torch.equal(vec.value_mask, nai.value_mask)
    km = vec.value_mask
    for name in ("token_rewards", "advantages", "returns"):
        a, b = getattr(vec, name), getattr(nai, name)
        assert float(torch.where(km, a - b, 0.0).abs().max()) <= 1e-12, name
    hp = Hyperparams(gamma=0.97, lam=0.9, kl_coef=0.1, ent_coef=0.01, cliprange_value=0.3)
    kw: dict[str, Any] = dict(
        logprobs=x["logprobs"], values=x["values"], old_logprobs=x["old_logprobs"],
        old_values=x["old_values"], advantages=vec.advantages, returns=vec.returns, mask=m,
        ref_logprobs=x["ref_logprobs"], entropy=x["entropy"], rollout_logprobs=beh,
    )  # fmt: skip
    q = update_inputs(**kw)
    uq, un = update_quantities(**kw, hp=hp, conv=conv), update_quantities_naive(q, hp=hp, conv=conv)
    for name in ("loss", "pg_loss", "vf_loss", "entropy_loss", "pg_clipfrac", "approx_kl"):
        assert abs(float(getattr(uq, name)) - float(getattr(un, name))) <= 1e-12, name
    auto = update_grads(q, hp=hp, conv=conv)
    out = walk(UPDATE_STAGES, q, conv, hp, naive=True)
    naive = BY_NAME["grads"].run(out, conv, hp, naive=True)
    for name in ("grad_logprobs", "grad_values"):
        assert float((auto[name] - naive[name]).abs().max()) <= 1e-12, name
