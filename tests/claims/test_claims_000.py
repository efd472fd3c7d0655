"""Claims of note 000 (Q&A on the RLHF PPO data flow) checked on refppo.core and refppo.pipeline.

Every expected number is written out by hand (or from a first-principles formula in the test);
none is copied from the code under test.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import Tensor

from refppo.core.gae import gae
from refppo.core.kl import token_kl
from refppo.core.logprobs import entropy_from_logits, logprobs_from_logits
from refppo.core.objective import kl_loss, total_loss
from refppo.core.policy import clipped_policy_loss, policy_ratio
from refppo.core.rewards import token_rewards
from refppo.core.value import value_loss
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import rollout_quantities, update_quantities

F64 = torch.float64


def t64(x: object) -> Tensor:
    return torch.tensor(x, dtype=F64)


# ---------------------------------------------------------------- Q1: PPO loss vs actor loss, LM loss


def test_q1_ppo_loss_is_weighted_sum_of_actor_critic_entropy_terms() -> None:
    """PPO loss = actor loss + c1·critic loss − c2·entropy (+ KL-in-loss, + ptx), by hand."""
    # every weighted term has a distinct size (0.2, 0.015, 0.02, 0.18), so a wrong sign or a swapped
    # coefficient on any of them changes the sum; the entropy and KL terms do not cancel
    pg, vf, ent, kl, ptx = t64(0.7), t64(2.0), t64(1.5), t64(0.4), t64(0.9)
    got = total_loss(pg, vf, ent, kl, ptx, vf_coef=0.1, ent_coef=0.01, kl_coef=0.05, ptx_coef=0.2)
    assert float(got) == pytest.approx(0.7 + 0.2 - 0.015 + 0.02 + 0.18, abs=1e-12)
    # the actor loss alone is the pg term: the other terms are separate summands
    assert float(total_loss(pg)) == pytest.approx(0.7, abs=0)


def test_q1_lm_loss_is_pretraining_cross_entropy_not_an_entropy_bonus() -> None:
    """Q1 (wrong in the note): InstructGPT's LM/ptx loss is the NLL of *pretraining text* under π.

    It is the cross-entropy H(p_data, π) = −Σ p_data log π, which depends on the data; the entropy
    H(π) does not. Minimising it pulls π towards the data (from the uniform π it *lowers* H(π)),
    the opposite of "making outputs more diverse".
    """
    V = 4
    z = torch.zeros(1, 1, V, dtype=F64, requires_grad=True)  # uniform π over 4 tokens
    data = torch.tensor([[2, 2, 2, 1]])  # pretraining tokens, each under the same context
    logits = z.expand(1, 4, V)
    ptx = -logprobs_from_logits(logits, data).mean()
    # by hand: π = 1/4 everywhere, so NLL = log 4 for every token
    assert float(ptx.detach()) == pytest.approx(math.log(4), abs=1e-12)
    # another policy scored on two datasets: a cross-entropy changes with the data ...
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=F64)
    logits_p = p.log().expand(1, 4, V)
    nll_a = -logprobs_from_logits(logits_p, data).mean()
    nll_b = -logprobs_from_logits(logits_p, torch.tensor([[0, 0, 0, 1]])).mean()
    assert float(nll_a) == pytest.approx(-(3 * math.log(0.3) + math.log(0.2)) / 4, abs=1e-12)
    assert float(nll_b) == pytest.approx(-(3 * math.log(0.1) + math.log(0.2)) / 4, abs=1e-12)
    # ... while the entropy of that policy is −Σ p log p whatever the data
    ent = entropy_from_logits(logits_p[:, :1])
    h_by_hand = -sum(q * math.log(q) for q in (0.1, 0.2, 0.3, 0.4))
    assert float(ent) == pytest.approx(h_by_hand, abs=1e-12)
    assert abs(float(nll_b) - h_by_hand) > 0.5
    # one gradient-descent step on the ptx loss from the uniform policy lowers the entropy
    (grad,) = torch.autograd.grad(ptx, z)
    z_new = (z - 0.5 * grad).detach()
    h_before = float(entropy_from_logits(z.detach()))
    h_after = float(entropy_from_logits(z_new))
    assert h_before == pytest.approx(math.log(4), abs=1e-12)
    assert h_after < h_before - 1e-3
    # and the step moved mass towards the data's most frequent token
    assert int(torch.softmax(z_new[0, 0], -1).argmax()) == 2


def test_q1_ptx_term_enters_total_loss_with_its_own_coefficient() -> None:
    """Q1: the LM term is a separate summand ptx_coef·ptx, not part of the entropy term."""
    pg, ent, ptx = t64(0.0), t64(1.2), t64(3.0)
    with_ptx = total_loss(pg, None, ent, None, ptx, ent_coef=0.1, ptx_coef=0.5)
    no_ptx = total_loss(pg, None, ent, None, None, ent_coef=0.1)
    assert float(with_ptx - no_ptx) == pytest.approx(0.5 * 3.0, abs=1e-12)
    assert float(no_ptx) == pytest.approx(-0.1 * 1.2, abs=1e-12)


def test_q1_actor_loss_sends_no_gradient_to_the_critic() -> None:
    """Q1 table: the actor loss uses the critic's values (through A) but contains no critic term."""
    values = t64([[0.2, -0.1, 0.4]]).requires_grad_(True)
    rewards = t64([[0.0, 0.0, 1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert adv.requires_grad  # advantages are a function of the values ...
    logp = t64([[-1.0, -0.5, -2.0]]).requires_grad_(True)
    pg = clipped_policy_loss(logp, logp.detach(), adv, mask).loss
    grads: tuple[Tensor | None, ...] = torch.autograd.grad(pg, [values, logp], allow_unused=True)
    g_values, g_logp = grads
    assert g_values is None  # ... but the actor loss has no path into the critic
    assert g_logp is not None and float(g_logp.abs().sum()) > 0
    vf = value_loss(values, values.detach(), ret.detach(), mask, kind="unclipped").loss
    (g_vf,) = torch.autograd.grad(vf, [values])
    assert float(g_vf.abs().sum()) > 0


def test_q1_clipped_surrogate_matches_the_formula_by_hand() -> None:
    """Q1: per-token actor loss = −min(r·A, clip(r, 1−ε, 1+ε)·A), ε = 0.2."""
    r = [0.5, 1.1, 1.5, 0.5, 1.5]
    a = [1.0, -2.0, 3.0, -1.0, -1.0]
    logp_old = t64([[-1.0] * 5])
    logp = logp_old + t64([[math.log(x) for x in r]])
    out = clipped_policy_loss(logp, logp_old, t64([a]), torch.ones(1, 5, dtype=torch.bool))
    expected = [-0.5, 2.2, -3.6, 0.8, 1.5]  # −min(0.5, 0.8); −min(−2.2, −2.2); −min(4.5, 3.6); ...
    torch.testing.assert_close(out.per_token, t64([expected]), rtol=0, atol=1e-12)
    assert float(out.loss) == pytest.approx(sum(expected) / 5, abs=1e-12)


# ---------------------------------------------------------------- Q3/Q4: update order, "old" models


def test_q3_value_loss_uses_cached_old_values_only_through_the_clip() -> None:
    """Q3: there is no old critic; the critic's rollout-time values V_old enter only the clip.

    (a) unclipped loss: independent of V_old; (b) clipped, |V − V_old| ≤ ε: equal to the
    unclipped loss; (c) V_old gets no gradient; (d) outside the clip, by hand.
    """
    mask = torch.ones(1, 1, dtype=torch.bool)
    v, ret = t64([[1.0]]), t64([[0.5]])
    for v_old in (0.0, 0.9, 5.0):
        got = value_loss(v, t64([[v_old]]), ret, mask, kind="unclipped").loss
        assert float(got) == pytest.approx(0.5 * 0.5**2, abs=1e-12)
    for v_old in (0.85, 1.0, 1.15):  # within ε = 0.2 of V = 1.0
        got = value_loss(v, t64([[v_old]]), ret, mask, clip=0.2).loss
        assert float(got) == pytest.approx(0.5 * 0.5**2, abs=1e-12)
    v_old_t = t64([[0.0]]).requires_grad_(True)
    v_t = t64([[1.0]]).requires_grad_(True)
    # (d) V=1, V_old=0, R=2, ε=0.2: V_clip = 0.2, (0.2−2)² = 3.24 > (1−2)² = 1 → ½·3.24
    out = value_loss(v_t, v_old_t, t64([[2.0]]), mask, clip=0.2)
    assert float(out.loss.detach()) == pytest.approx(1.62, abs=1e-12)
    assert float(out.clipfrac) == 1.0
    grads: tuple[Tensor | None, ...] = torch.autograd.grad(out.loss, [v_t, v_old_t], allow_unused=True)
    g_v, g_v_old = grads
    assert g_v_old is None  # the cached values are constants
    assert g_v is not None and float(g_v) == 0.0  # clipped branch: constant in V
    # (d') V=1, V_old=0, R=0.5: (0.2−0.5)² = 0.09 < (1−0.5)² = 0.25 → ½·0.25, not clipped
    out2 = value_loss(t64([[1.0]]), t64([[0.0]]), t64([[0.5]]), mask, clip=0.2)
    assert float(out2.loss) == pytest.approx(0.125, abs=1e-12)
    assert float(out2.clipfrac) == 0.0


def test_q3_joint_loss_gives_each_network_its_own_gradient() -> None:
    """Q3: actor and critic updated "together or separately" is the same thing for disjoint
    parameters: ∇θ(pg + c1·vf) = ∇θ pg and ∇φ(pg + c1·vf) = c1·∇φ vf."""
    theta = t64([[0.3, -0.2, 0.1]]).requires_grad_(True)  # stands for the actor's log-probs
    phi = t64([[0.5, 0.0, -0.5]]).requires_grad_(True)  # stands for the critic's values
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = t64([[1.0, -1.0, 0.5]]), t64([[1.0, 1.0, 1.0]])

    def losses() -> tuple[Tensor, Tensor]:
        pg = clipped_policy_loss(theta, t64([[0.3, -0.2, 0.1]]), adv, mask).loss
        vf = value_loss(phi, phi.detach(), ret, mask, kind="unclipped").loss
        return pg, vf

    pg, vf = losses()
    g_theta_joint, g_phi_joint = torch.autograd.grad(total_loss(pg, vf, vf_coef=0.5), [theta, phi])
    pg, vf = losses()
    (g_theta,) = torch.autograd.grad(pg, [theta])
    (g_phi,) = torch.autograd.grad(vf, [phi])
    torch.testing.assert_close(g_theta_joint, g_theta, rtol=0, atol=1e-15)
    torch.testing.assert_close(g_phi_joint, 0.5 * g_phi, rtol=0, atol=1e-15)
    # by hand at ratio 1: d pg/d l_t = −A_t/3; d vf/d V_t = (V_t − R_t)/3
    torch.testing.assert_close(g_theta, -adv / 3, rtol=0, atol=1e-15)
    torch.testing.assert_close(g_phi, (phi.detach() - ret) / 3, rtol=0, atol=1e-15)


class _Policy(torch.nn.Module):
    """A tiny policy: logits = W·features(context)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(3, 5, generator=g, dtype=F64))

    def logprobs(self, feats: Tensor, tokens: Tensor) -> Tensor:
        return logprobs_from_logits(feats @ self.w, tokens)


def test_q4_cached_old_logprobs_are_equivalent_to_a_frozen_old_actor() -> None:
    """Q4: caching log π_old(y_t) at rollout is exactly what a frozen copy of the old actor would
    give in every PPO epoch; only the sampled tokens' log-probs are needed."""
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(2, 4, 3, generator=g, dtype=F64)
    tokens = torch.randint(0, 5, (2, 4), generator=g)
    adv = torch.randn(2, 4, generator=g, dtype=F64)
    mask = torch.ones(2, 4, dtype=torch.bool)
    actor = _Policy()
    snapshot = copy.deepcopy(actor)  # the "store the old network" way
    with torch.no_grad():
        cached = actor.logprobs(feats, tokens)  # the "cache the log-probs" way
    opt = torch.optim.SGD(actor.parameters(), lr=0.5)
    for _ in range(4):
        logp = actor.logprobs(feats, tokens)
        with torch.no_grad():
            from_snapshot = snapshot.logprobs(feats, tokens)
        torch.testing.assert_close(from_snapshot, cached, rtol=0, atol=0)
        loss_cached = clipped_policy_loss(logp, cached, adv, mask).loss
        loss_snapshot = clipped_policy_loss(logp, from_snapshot, adv, mask).loss
        assert float(loss_cached.detach()) == float(loss_snapshot.detach())
        opt.zero_grad()
        torch.autograd.backward(loss_cached)
        opt.step()
    assert not torch.equal(actor.logprobs(feats, tokens).detach(), cached)  # the actor did move


def test_q4_cached_logprobs_must_be_computed_like_the_training_forward() -> None:
    """Q4 caveat: the cache stands in for the old actor only if it is computed the same way as the
    update's forward — e.g. at the sampling temperature. A mismatch makes the ratio ≠ 1 before any
    update (which is why verl/OpenRLHF recompute old log-probs with the training engine)."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 6, 5, generator=g, dtype=F64)
    tokens = torch.randint(0, 5, (1, 6), generator=g)
    mask = torch.ones(1, 6, dtype=torch.bool)
    tau = 0.7
    logp_train = logprobs_from_logits(logits, tokens, temperature=tau)
    by_hand = torch.log_softmax(logits / tau, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logp_train, by_hand, rtol=0, atol=1e-12)
    same = policy_ratio(logp_train, logprobs_from_logits(logits, tokens, temperature=tau), mask)
    torch.testing.assert_close(same, torch.ones_like(same), rtol=0, atol=0)
    wrong = policy_ratio(logp_train, logprobs_from_logits(logits, tokens), mask)
    assert float((wrong - 1).abs().max()) > 1e-2


# ---------------------------------------------------------------- Q5/Q6: token rewards, pipeline


def test_q5_token_reward_is_zeros_then_score_minus_beta_kl() -> None:
    """Q5: r = [0, …, 0, score] − β·(log π_old − log π_ref), score on the last *valid* token."""
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    scores = t64([2.0, -1.0])
    lo = [[-1.0, -2.0, -0.5, 9.0], [-0.3, -0.7, -1.1, -0.2]]
    lr = [[-1.5, -1.0, -0.5, 7.0], [-0.3, -1.7, -0.1, -0.4]]
    beta = 0.1
    kl = token_kl(t64(lo), t64(lr), mask)
    # without KL: exactly [0, 0, s, 0] and [0, 0, 0, s]
    bare = token_rewards(scores, None, mask, beta)
    torch.testing.assert_close(bare, t64([[0, 0, 2.0, 0], [0, 0, 0, -1.0]]), rtol=0, atol=0)
    got = token_rewards(scores, kl, mask, beta)
    expected = [
        [-0.1 * 0.5, -0.1 * -1.0, 2.0 - 0.1 * 0.0, 0.0],  # padding stays 0 whatever the KL there
        [-0.1 * 0.0, -0.1 * 1.0, -0.1 * -1.0, -1.0 - 0.1 * 0.2],
    ]
    torch.testing.assert_close(got, t64(expected), rtol=0, atol=1e-12)
    # per row: Σ_t r_t = s − β·Σ_t KL_t
    torch.testing.assert_close(got.sum(1), t64([2.0 - 0.1 * -0.5, -1.0 - 0.1 * 0.2]), rtol=0, atol=1e-12)


def test_q5_advantage_is_return_to_go_minus_value_only_when_lambda_is_one() -> None:
    """Q5 caveat: A_t = R̂_t − V_old(s_t) with R̂ the discounted return-to-go is GAE at λ = 1.
    With λ < 1 (the usual 0.95) A_t is the GAE sum and the value target R_t = A_t + V_t ≠ R̂_t."""
    mask = torch.ones(1, 2, dtype=torch.bool)
    r, v = t64([[0.5, 2.0]]), t64([[1.0, 3.0]])
    g = 0.9
    adv1, ret1 = gae(r, v, mask, gamma=g, lam=1.0)
    rtg = [0.5 + g * 2.0, 2.0]
    torch.testing.assert_close(adv1, t64([[rtg[0] - 1.0, rtg[1] - 3.0]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(ret1, t64([rtg]), rtol=0, atol=1e-12)
    lam = 0.5
    adv, ret = gae(r, v, mask, gamma=g, lam=lam)
    d1 = 2.0 - 3.0  # δ_1 = r_1 − V_1 (episode ends)
    d0 = 0.5 + g * 3.0 - 1.0  # δ_0 = r_0 + γV_1 − V_0
    torch.testing.assert_close(adv, t64([[d0 + g * lam * d1, d1]]), rtol=0, atol=1e-12)
    assert abs(float(ret[0, 0]) - rtg[0]) > 0.1  # the λ-return is not the return-to-go


def test_q5_critic_regresses_values_on_returns() -> None:
    """Q5/Q6: the (unclipped) critic loss is ½·mean (V − R)² over valid tokens."""
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    v, ret = t64([[1.0, 2.0, 50.0]]), t64([[0.0, 4.0, 0.0]])
    got = value_loss(v, v, ret, mask, kind="unclipped").loss
    assert float(got) == pytest.approx(0.5 * (1.0 + 4.0) / 2, abs=1e-12)


def _rollout_inputs() -> dict[str, Tensor]:
    return {
        "scores": t64([1.0]),
        "old_logprobs": t64([[-1.0, -2.0, -0.5]]),
        "ref_logprobs": t64([[-1.5, -1.0, -0.5]]),
        "old_values": t64([[0.2, 0.4, 0.6]]),
        "mask": torch.ones(1, 3, dtype=torch.bool),
    }


def test_q6_rollout_layers_compute_rewards_and_advantages_from_cached_tensors() -> None:
    """Q6: layers 1–3 (rollout → ref/critic scoring → token rewards & advantages) need only the
    cached tensors — no current policy; by hand with γ = λ = 1, β = 0.1, no whitening."""
    hp = Hyperparams(gamma=1.0, lam=1.0, kl_coef=0.1)
    conv = Convention.of(whiten_advantages="none")  # type: ignore[arg-type]
    rq = rollout_quantities(**_rollout_inputs(), hp=hp, conv=conv)
    kl = [0.5, -1.0, 0.0]  # log π_old − log π_ref
    r = [-0.05, 0.1, 1.0]
    torch.testing.assert_close(rq.kl, t64([kl]), rtol=0, atol=1e-12)
    torch.testing.assert_close(rq.token_rewards, t64([r]), rtol=0, atol=1e-12)
    rtg = [sum(r), r[1] + r[2], r[2]]
    torch.testing.assert_close(rq.returns, t64([rtg]), rtol=0, atol=1e-12)
    torch.testing.assert_close(rq.advantages, t64([[rtg[0] - 0.2, rtg[1] - 0.4, rtg[2] - 0.6]]))


@pytest.mark.parametrize("kl_in", ["reward", "loss"])
def test_q6_kl_is_counted_once_in_the_reward_or_in_the_loss(kl_in: str) -> None:
    """Q6 (wrong as written: the note puts −β·KL in the token reward AND −β·E[kl] in the actor
    loss). Each convention counts KL once: in the reward (old vs ref, InstructGPT) or as a loss term
    on the *current* log-probs (verl use_kl_loss) — never both."""
    hp = Hyperparams(gamma=1.0, lam=1.0, kl_coef=0.1, vf_coef=0.0)
    conv = Convention.of(whiten_advantages="none", kl_in=kl_in)  # type: ignore[arg-type]
    inp = _rollout_inputs()
    rq = rollout_quantities(**inp, hp=hp, conv=conv)
    logp = t64([[-0.8, -1.8, -0.6]])
    uq = update_quantities(
        logprobs=logp,
        values=inp["old_values"],
        old_logprobs=inp["old_logprobs"],
        old_values=inp["old_values"],
        advantages=rq.advantages,
        returns=rq.returns,
        mask=inp["mask"],
        ref_logprobs=inp["ref_logprobs"],
        hp=hp,
        conv=conv,
    )
    if kl_in == "reward":
        torch.testing.assert_close(rq.token_rewards, t64([[-0.05, 0.1, 1.0]]), rtol=0, atol=1e-12)
        assert float(uq.kl_loss) == 0.0
        assert float(uq.loss) == pytest.approx(float(uq.pg_loss), abs=1e-15)
    else:
        torch.testing.assert_close(rq.token_rewards, t64([[0.0, 0.0, 1.0]]), rtol=0, atol=0)
        kl_current = (0.7 + -0.8 + -0.1) / 3  # mean(log π_θ − log π_ref), k1
        assert float(uq.kl_loss) == pytest.approx(kl_current, abs=1e-12)
        assert float(uq.loss) == pytest.approx(float(uq.pg_loss) + 0.1 * kl_current, abs=1e-12)


def test_q6_kl_both_counts_it_twice_as_verl_lets_a_user() -> None:
    """Q6's double count is not the algorithm, but verl 0.9.1 lets a user turn on both
    ``use_kl_in_reward`` and ``use_kl_loss``; ``kl_in=both`` expresses that step (hand-worked on
    the inputs above: the reward of ``kl_in=reward`` and the KL loss of ``kl_in=loss`` at once)."""
    hp = Hyperparams(gamma=1.0, lam=1.0, kl_coef=0.1, vf_coef=0.0)
    conv = Convention.of(whiten_advantages="none", kl_in="both")
    inp = _rollout_inputs()
    rq = rollout_quantities(**inp, hp=hp, conv=conv)
    logp = t64([[-0.8, -1.8, -0.6]])
    uq = update_quantities(
        logprobs=logp, values=inp["old_values"], old_logprobs=inp["old_logprobs"],
        old_values=inp["old_values"], advantages=rq.advantages, returns=rq.returns, mask=inp["mask"],
        ref_logprobs=inp["ref_logprobs"], hp=hp, conv=conv,
    )  # fmt: skip
    torch.testing.assert_close(rq.token_rewards, t64([[-0.05, 0.1, 1.0]]), rtol=0, atol=1e-12)
    kl_current = (0.7 + -0.8 + -0.1) / 3  # mean(log π_θ − log π_ref), k1
    assert float(uq.kl_loss) == pytest.approx(kl_current, abs=1e-12)
    assert float(uq.loss) == pytest.approx(float(uq.pg_loss) + 0.1 * kl_current, abs=1e-12)


def test_q6_kl_from_cached_rollout_logprobs_gives_the_actor_no_gradient() -> None:
    """Q6: "−β·E[kl_t]" with kl_t = log π_old − log π_ref (the rollout KL of layer 3) is a constant
    for the actor loss: zero gradient. A KL loss term must use the current log-probs."""
    z = torch.zeros(1, 3, 4, dtype=F64, requires_grad=True)
    tokens = torch.tensor([[0, 1, 3]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv = t64([[1.0, -0.5, 2.0]])
    beta = 0.1
    logp = logprobs_from_logits(z, tokens)
    logp_old = logp.detach()
    logp_ref = t64([[-2.0, -0.5, -1.0]])
    rollout_kl = token_kl(logp_old, logp_ref, mask)
    pg = clipped_policy_loss(logp, logp_old, adv, mask).loss
    # the note's actor loss −(L_CLIP − β·E[kl_t]) with the layer-3 kl_t: the same gradient as the
    # clip term alone, bit for bit — the KL term does nothing to the actor
    (g_pg,) = torch.autograd.grad(pg, z, retain_graph=True)
    (g_note,) = torch.autograd.grad(pg + beta * rollout_kl.mean(), z, retain_graph=True)
    assert torch.equal(g_note, g_pg)
    # the KL loss on the *current* log-probs (k1: mean(log π_θ − log π_ref)) does move the actor:
    # d/d log π_θ(y_t) = 1/3 per token, so its gradient w.r.t. the logits is (onehot − π)/3 with π
    # uniform (z = 0): +1/4 on the sampled token, −1/12 on the other three
    logp_leaf = logp.detach().requires_grad_(True)
    (g_logp,) = torch.autograd.grad(kl_loss(logp_leaf, logp_ref, mask, "k1"), logp_leaf)
    torch.testing.assert_close(g_logp, torch.full((1, 3), 1 / 3, dtype=F64), rtol=0, atol=1e-15)
    (grad,) = torch.autograd.grad(pg + beta * kl_loss(logp, logp_ref, mask, "k1"), z)
    by_hand = torch.full((1, 3, 4), -1 / 12, dtype=F64)
    by_hand[0, torch.arange(3), tokens[0]] = 1 / 4
    torch.testing.assert_close(grad - g_pg, beta * by_hand, rtol=0, atol=1e-15)


# ---------------------------------------------------------------- Q7: why the critic must not peek


def test_q7_action_dependent_baseline_biases_the_policy_gradient() -> None:
    """Q7 caveat: the real harm of a critic that sees y_t.. is not "too high values" but a baseline
    that depends on the action, which biases the policy gradient. Exact on 3 actions:
    Σ_a π(a)∇log π(a)(Q(a) − b) = ∇Σ_a π(a)Q(a) for a state-only b, but not for b = b(a)."""
    theta = t64([0.2, -0.4, 0.1]).requires_grad_(True)
    q = t64([1.0, 3.0, -2.0])
    pi = torch.softmax(theta, 0)
    (true_grad,) = torch.autograd.grad((pi * q).sum(), theta)

    def pg_estimate(baseline: Tensor) -> Tensor:
        logpi = torch.log_softmax(theta, 0)
        surrogate = (pi.detach() * logpi * (q - baseline)).sum()  # E_a[log π(a)·(Q(a) − b)]
        (g,) = torch.autograd.grad(surrogate, theta)
        return g

    torch.testing.assert_close(pg_estimate(t64(0.75)), true_grad, rtol=0, atol=1e-14)
    peeking = pg_estimate(q.clone())  # baseline that "knows" the action: b(a) = Q(a)
    assert float((peeking - true_grad).abs().max()) > 0.1
