"""A separate β and estimator for the KL loss under ``kl_in=both`` (issue #23 item 5; verl 0.9.1's
``algorithm.kl_ctrl.kl_coef`` + ``algorithm.kl_penalty`` for the reward beside ``actor.kl_loss_coef``
+ ``actor.kl_loss_type`` for the loss; validated in tests/peers/test_peer_verl_kl_both.py).

Properties, from the single placements alone (no expected value from the code under test): the
rollout of ``both`` with ``(β_r, e_r)`` for the reward and ``(β_l, e_l)`` for the loss is the
rollout of ``kl_in=reward`` under ``(β_r, e_r)``; its KL loss is that of ``kl_in=loss`` under
``e_l`` (with ``e_l``'s clamps); its total is the ``reward`` total plus ``β_l·kl_loss``; the naive
twins (values and the gradient twin) agree. The keys left unset give the shared β and estimator.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle_helpers import make_inputs

from refppo.errors import ConventionError
from refppo.pipeline.grad_naive import objective_grads_naive
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import (
    rollout_quantities,
    rollout_quantities_naive,
    update_inputs,
    update_quantities,
    update_quantities_naive,
)

pytestmark = pytest.mark.property

ESTIMATORS = ["k1", "k2", "k3", "abs"]
CLAMPS = [{}, {"log_ratio_clamp": (-0.3, 0.3), "value_clamp": 0.05}]


def _step(conv: Convention, hp: Hyperparams, seed: int, naive: bool = False) -> tuple[object, object, object]:
    x = make_inputs(B=5, T=9, seed=seed)
    m = x["response_mask"].bool()
    kw = dict(scores=x["scores"], old_logprobs=x["old_logprobs"], ref_logprobs=x["ref_logprobs"],
              old_values=x["old_values"], mask=m, hp=hp, conv=conv)  # fmt: skip
    ro = (rollout_quantities_naive if naive else rollout_quantities)(**kw)  # type: ignore[arg-type]
    upd = dict(
        logprobs=x["logprobs"], values=x["values"], old_logprobs=x["old_logprobs"],
        old_values=x["old_values"], advantages=ro.advantages, returns=ro.returns, mask=m,
        value_mask_=ro.value_mask, ref_logprobs=x["ref_logprobs"], entropy=x["entropy"],
    )  # fmt: skip
    if naive:
        up = update_quantities_naive(update_inputs(**upd), hp=hp, conv=conv)  # type: ignore[arg-type]
        return ro, up, objective_grads_naive(**upd, hp=hp, conv=conv)  # type: ignore[arg-type]
    lp = upd["logprobs"].clone().requires_grad_(True)
    up = update_quantities(**{**upd, "logprobs": lp}, hp=hp, conv=conv)  # type: ignore[arg-type]
    up.loss.backward()
    return ro, up, lp.grad


@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 10_000),
    st.sampled_from(ESTIMATORS),
    st.sampled_from(ESTIMATORS),
    st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]),
    st.floats(0.01, 0.5),
    st.floats(0.01, 0.5),
    st.sampled_from(range(len(CLAMPS))),
)
def test_both_with_own_loss_beta_and_estimator(
    seed: int, e_r: str, e_l: str, agg: str, b_r: float, b_l: float, ci: int
) -> None:
    """``both`` = ``reward`` rollout (β_r, e_r) + β_l·(the ``loss`` KL term under e_l and its clamps)."""
    clamp = CLAMPS[ci]
    hp_r, hp_l = Hyperparams(kl_coef=b_r, gamma=0.97, lam=0.9), Hyperparams(kl_coef=b_l, gamma=0.97, lam=0.9)
    both = Convention.of(
        kl_in="both", kl_estimator=e_r, loss_agg=agg, kl_loss_estimator=e_l,
        kl_loss_log_ratio_clamp=clamp.get("log_ratio_clamp"), kl_loss_value_clamp=clamp.get("value_clamp"),
    )  # fmt: skip
    hp_b = Hyperparams(kl_coef=b_r, kl_loss_coef=b_l, gamma=0.97, lam=0.9)
    loss_conv = Convention.of(
        kl_in="loss", kl_estimator=e_l, loss_agg=agg,
        kl_log_ratio_clamp=clamp.get("log_ratio_clamp"), kl_value_clamp=clamp.get("value_clamp"),
    )  # fmt: skip
    ro_b, up_b, g_b = _step(both, hp_b, seed)
    ro_r, up_r, g_r = _step(Convention.of(kl_in="reward", kl_estimator=e_r, loss_agg=agg), hp_r, seed)
    _, up_l, g_l = _step(loss_conv, hp_l, seed)
    for name in ("kl", "token_rewards", "advantages", "returns"):
        assert torch.equal(getattr(ro_b, name), getattr(ro_r, name)), name
    assert torch.equal(up_b.kl_loss, up_l.kl_loss)  # type: ignore[attr-defined]
    want = float(up_r.loss.detach()) + b_l * float(up_l.kl_loss.detach())  # type: ignore[attr-defined]
    assert abs(float(up_b.loss.detach()) - want) <= 1e-12 * max(1.0, abs(want))  # type: ignore[attr-defined]
    # ∂J_both = ∂J_reward + (∂J_loss − ∂J_loss without its KL term): β_l·∂kl_loss(e_l) added
    hp_0 = Hyperparams(kl_coef=0.0, gamma=0.97, lam=0.9)
    _, _, g_pg = _step(Convention.of(kl_in="reward", kl_estimator=e_l, loss_agg=agg), hp_0, seed)
    assert torch.allclose(g_b, g_r + (g_l - g_pg), atol=1e-12, rtol=1e-10)  # type: ignore[operator]
    _, up_n, g_n = _step(both, hp_b, seed, naive=True)
    for name in ("loss", "kl_loss", "pg_loss"):
        assert abs(float(getattr(up_b, name).detach()) - float(getattr(up_n, name))) <= 1e-10, name
    assert torch.allclose(g_b, g_n[0], atol=1e-12, rtol=1e-10)  # type: ignore[index]


def test_unset_keys_are_the_shared_ones() -> None:
    """No ``kl_loss_coef`` / ``kl_loss_estimator``: the step of before (loss and KL term equal), and
    ``kl_loss_coef`` is left out of the hyperparameters' dict (dumps and reports unchanged)."""
    hp = Hyperparams(kl_coef=0.1)
    conv = Convention.of(kl_in="both", kl_estimator="k3")
    same = Convention.of(kl_in="both", kl_estimator="k3", kl_loss_estimator="k3")
    _, a, _ = _step(conv, hp, 3)
    _, b, _ = _step(same, Hyperparams(kl_coef=0.1, kl_loss_coef=0.1), 3)
    assert float(a.loss.detach()) == float(b.loss.detach())
    assert float(a.kl_loss.detach()) == float(b.kl_loss.detach())  # type: ignore[attr-defined]
    assert "kl_loss_coef" not in hp.to_dict() and "kl_loss_estimator" not in conv.to_dict()
    assert Hyperparams(kl_loss_coef=0.2).to_dict()["kl_loss_coef"] == 0.2


def test_loss_clamps_without_a_loss_estimator_are_refused() -> None:
    with pytest.raises(ConventionError, match="kl_loss_value_clamp"):
        Convention.of(kl_in="both", kl_loss_value_clamp=10.0)
