"""``kl_in=both`` (issue #23 item 5): the KL in the reward and a KL loss in one step (verl 0.9.1
with ``use_kl_in_reward`` and ``use_kl_loss`` both on; validated in
tests/peers/test_peer_verl_kl_both.py).

Properties, from the two placements alone (no expected value from the code under test): the
rollout of ``both`` is the rollout of ``reward`` (the reward's −β·KL), its KL loss is that of
``loss``, and its total is the ``reward`` total plus ``β·kl_loss``; the naive twins agree.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle_helpers import make_inputs

from refppo.conventions import KLPlacement
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import (
    rollout_quantities,
    rollout_quantities_naive,
    update_inputs,
    update_quantities,
    update_quantities_naive,
)

pytestmark = pytest.mark.property


def _step(conv: Convention, hp: Hyperparams, seed: int, naive: bool = False) -> tuple[object, object]:
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
        return ro, update_quantities_naive(update_inputs(**upd), hp=hp, conv=conv)  # type: ignore[arg-type]
    return ro, update_quantities(**upd, hp=hp, conv=conv)  # type: ignore[arg-type]


@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 10_000),
    st.sampled_from(["k1", "k2", "k3", "abs"]),
    st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]),
    st.floats(0.01, 0.5),
)
def test_both_is_the_reward_rollout_plus_the_loss_term(seed: int, est: str, agg: str, beta: float) -> None:
    hp = Hyperparams(kl_coef=beta, gamma=0.97, lam=0.9)
    conv = {
        kin: Convention.of(kl_in=kin, kl_estimator=est, loss_agg=agg) for kin in ("reward", "loss", "both")
    }
    ro_b, up_b = _step(conv["both"], hp, seed)
    ro_r, up_r = _step(conv["reward"], hp, seed)
    _, up_l = _step(conv["loss"], hp, seed)
    for name in ("kl", "token_rewards", "advantages", "returns"):
        assert torch.equal(getattr(ro_b, name), getattr(ro_r, name)), name
    assert torch.equal(up_b.kl_loss, up_l.kl_loss)  # type: ignore[attr-defined]
    want = float(up_r.loss) + beta * float(up_l.kl_loss)  # type: ignore[attr-defined]
    assert abs(float(up_b.loss) - want) <= 1e-12 * max(1.0, abs(want))  # type: ignore[attr-defined]
    _, up_n = _step(conv["both"], hp, seed, naive=True)
    for name in ("loss", "kl_loss", "pg_loss"):
        assert abs(float(getattr(up_b, name)) - float(getattr(up_n, name))) <= 1e-10, name


def test_placement_flags() -> None:
    assert [(p.in_reward, p.in_loss) for p in KLPlacement] == [(True, False), (False, True), (True, True)]
