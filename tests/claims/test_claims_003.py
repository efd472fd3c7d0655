"""Claims of note 003 (PPO study notes, §1–§5), checked exactly where the mathematics allows.

Importance sampling is checked with exact rational arithmetic on small discrete distributions;
the PPO facts on a tensor-level policy (a softmax over a logits parameter) with refppo.core and
torch autograd. Every expectation is derived by hand or from first principles in the test.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
import torch
from torch import Tensor

from refppo.core.logprobs import entropy_from_logits, logprobs_from_logits
from refppo.core.objective import entropy_bonus, total_loss
from refppo.core.policy import clipped_policy_loss, policy_ratio
from refppo.core.value import value_loss

F64 = torch.float64


def t64(x: object) -> Tensor:
    return torch.tensor(x, dtype=F64)


def _sample(logits: Tensor, g: torch.Generator) -> Tensor:
    B, T, V = logits.shape
    probs = torch.softmax(logits.detach(), dim=-1).reshape(B * T, V)
    return torch.multinomial(probs, 1, generator=g).reshape(B, T)


# ---------------------------------------------------------------- §1 on-policy vs sample reuse


def test_s1_single_update_per_batch_is_vanilla_policy_gradient() -> None:
    """§1.1: with one update per batch the data come from the policy being updated: ρ ≡ 1 and the
    PPO gradient is the on-policy REINFORCE gradient −mean(A·∇log π(y_t))."""
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(2, 3, 4, generator=g, dtype=F64).requires_grad_(True)
    tokens = _sample(theta, g)
    adv = torch.randn(2, 3, generator=g, dtype=F64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    logp = logprobs_from_logits(theta, tokens)
    out = clipped_policy_loss(logp, logp.detach(), adv, mask)
    torch.testing.assert_close(out.ratio.detach(), torch.ones(2, 3, dtype=F64), rtol=0, atol=0)
    (g_ppo,) = torch.autograd.grad(out.loss, theta)
    (g_pg,) = torch.autograd.grad(-(adv * logprobs_from_logits(theta, tokens)).mean(), theta)
    torch.testing.assert_close(g_ppo, g_pg, rtol=0, atol=1e-14)


def test_s1_ratio_is_one_at_first_minibatch_then_departs_and_resets_each_iteration() -> None:
    """§1.2 caveat: the reuse is off-policy only *within* an iteration (corrected by ρ); each
    iteration samples afresh from the current policy (on-policy across iterations), so ρ is exactly
    1 at its first minibatch, departs from 1 after an update, and stale data are not carried over."""
    g = torch.Generator().manual_seed(1)
    theta = torch.nn.Parameter(torch.randn(2, 3, 4, generator=g, dtype=F64))
    mask = torch.ones(2, 3, dtype=torch.bool)
    opt = torch.optim.SGD([theta], lr=1.0)
    previous: tuple[Tensor, Tensor] | None = None
    for _iteration in range(3):
        tokens = _sample(theta, g)  # rollout with the *current* policy
        with torch.no_grad():
            logp_old = logprobs_from_logits(theta, tokens)  # cached, frozen for this iteration
        adv = torch.randn(2, 3, generator=g, dtype=F64)
        ratios = []
        for _epoch in range(3):  # k updates on the same batch
            out = clipped_policy_loss(logprobs_from_logits(theta, tokens), logp_old, adv, mask)
            ratios.append(out.ratio.detach())
            opt.zero_grad()
            torch.autograd.backward(out.loss)
            opt.step()
        assert torch.equal(ratios[0], torch.ones(2, 3, dtype=F64))
        assert float((ratios[1] - 1).abs().max()) > 1e-3
        assert float((ratios[2] - 1).abs().max()) > 1e-3
        if previous is not None:  # last iteration's batch under today's policy: ρ ≠ 1
            old_tokens, old_logp = previous
            with torch.no_grad():
                stale = policy_ratio(logprobs_from_logits(theta, old_tokens), old_logp, mask)
            assert float((stale - 1).abs().max()) > 1e-3
        previous = (tokens, logp_old)


# ---------------------------------------------------------------- §2 importance sampling


def _random_dist(rng: random.Random, n: int, zeros: int = 0) -> list[Fraction]:
    weights = [Fraction(rng.randint(1, 9)) for _ in range(n)]
    for i in rng.sample(range(n), zeros):
        weights[i] = Fraction(0)
    total = sum(weights)
    return [w / total for w in weights]


def test_s2_importance_sampling_identity_is_exact_with_full_support() -> None:
    """§2.2: E_q[p/q·f] = E_p[f] exactly (rational arithmetic) when q > 0 everywhere; the weight is
    > 1 exactly where p > q (§2.3)."""
    rng = random.Random(0)
    for trial in range(200):
        n = rng.randint(2, 7)
        p = _random_dist(rng, n, zeros=trial % 2)  # p may have zeros; q never
        q = _random_dist(rng, n)
        f = [Fraction(rng.randint(-5, 5)) for _ in range(n)]
        assert sum(qx * (px / qx) * fx for px, qx, fx in zip(p, q, f, strict=True)) == sum(
            px * fx for px, fx in zip(p, f, strict=True)
        )
        for px, qx in zip(p, q, strict=True):
            assert (px / qx > 1) == (px > qx)


def test_s2_importance_weights_from_logprobs_reproduce_the_target_expectation() -> None:
    """§2/§3: the same identity with the weights built as refppo does, ρ = exp(log p − log q)."""
    p = t64([[0.5, 0.25, 0.125, 0.125]])
    q = t64([[0.1, 0.2, 0.3, 0.4]])
    f = [3.0, -1.0, 2.0, 0.5]
    rho = policy_ratio(p.log(), q.log(), torch.ones(1, 4, dtype=torch.bool))
    is_estimate = float((q * rho * t64([f])).sum())
    assert is_estimate == pytest.approx(0.5 * 3.0 - 0.25 + 0.25 + 0.0625, abs=1e-12)


def test_s2_support_violation_silently_biases_the_estimate() -> None:
    """§2.4 caveat: where q(x) = 0 the sampler never draws x, so nothing is undefined at run time —
    the estimate silently misses p(x)f(x). The exact requirement is q > 0 wherever p·f ≠ 0."""
    p = [Fraction(1, 2), Fraction(1, 4), Fraction(1, 4)]
    q = [Fraction(0), Fraction(1, 2), Fraction(1, 2)]

    def is_expectation(f: list[Fraction]) -> Fraction:  # E_q[p/q·f]: a sum over what q can draw
        return sum((qx * (px / qx) * fx for px, qx, fx in zip(p, q, f, strict=True) if qx > 0), Fraction(0))

    def target(f: list[Fraction]) -> Fraction:
        return sum((px * fx for px, fx in zip(p, f, strict=True)), Fraction(0))

    f = [Fraction(4), Fraction(1), Fraction(2)]
    assert target(f) == Fraction(11, 4)
    assert is_expectation(f) == Fraction(3, 4)  # off by exactly p(x0)·f(x0) = 2
    # the note's condition (supp q ⊇ supp p) is sufficient, not necessary: f(x0) = 0 is fine
    f0 = [Fraction(0), Fraction(1), Fraction(2)]
    assert is_expectation(f0) == target(f0) == Fraction(3, 4)


def test_s2_self_normalised_importance_sampling_is_biased() -> None:
    """§2.3 caveat: the self-normalised estimate Σ w_i f_i / Σ w_i (w = p/q) is biased for a finite
    sample. Exact over every ordered pair drawn from q: p = (½, ½), q = (¾, ¼), f = (0, 1), w = (⅔, 2).
    Pairs (0,0): 0; (1,1): 1; mixed: 2/(⅔ + 2) = ¾, with probability 2·¾·¼ = ⅜; so
    E[SNIS] = ⅜·¾ + 1/16·1 = 11/32 ≠ ½ = E_p[f], while the plain estimate ½(w_1 f_1 + w_2 f_2) is
    unbiased."""
    p = [Fraction(1, 2), Fraction(1, 2)]
    q = [Fraction(3, 4), Fraction(1, 4)]
    f = [Fraction(0), Fraction(1)]
    w = [px / qx for px, qx in zip(p, q, strict=True)]
    snis = plain = Fraction(0)
    for i in range(2):
        for j in range(2):
            prob = q[i] * q[j]
            snis += prob * (w[i] * f[i] + w[j] * f[j]) / (w[i] + w[j])
            plain += prob * (w[i] * f[i] + w[j] * f[j]) / 2
    assert plain == Fraction(1, 2) == sum(px * fx for px, fx in zip(p, f, strict=True))
    assert snis == Fraction(11, 32)


def test_s2_softmax_old_policy_has_full_support() -> None:
    """§2.4: in PPO q = π_old is a softmax over finite logits, so π_old(a|s) > 0 for every token
    and log π_old is finite — the support condition holds (sampling filters aside)."""
    logits = t64([[[30.0, 0.0, -30.0, -60.0]]])
    logp_all = torch.log_softmax(logits, dim=-1)
    assert bool(torch.isfinite(logp_all).all())
    assert bool((logp_all.exp() > 0).all())


# ---------------------------------------------------------------- §3 the ratio in LLM RLHF


def test_s3_ratio_from_cached_logprobs_equals_the_probability_ratio() -> None:
    """§3.3/§3.4: r = π_θ(a|s)/π_old(a|s) = exp(log π_θ − log π_old), probabilities from softmax."""
    z_old = t64([[[0.0, 0.0, 0.0]]])  # π_old(a=0) = 1/3
    z_new = t64([[[math.log(2.0), 0.0, 0.0]]])  # π_θ(a=0) = 2/4
    a = torch.tensor([[0]])
    logp_old, logp = logprobs_from_logits(z_old, a), logprobs_from_logits(z_new, a)
    assert float(logp_old) == pytest.approx(math.log(1 / 3), abs=1e-12)
    ratio = policy_ratio(logp, logp_old, torch.ones(1, 1, dtype=torch.bool))
    assert float(ratio) == pytest.approx((2 / 4) / (1 / 3), abs=1e-12)


def test_s3_log_space_ratio_survives_where_probabilities_underflow() -> None:
    """§3.4: log-probs are the stable route. In float32 e^-200 underflows to 0, so the
    probability ratio is 0/0 = NaN, while exp(log π_θ − log π_old) gives e^1."""
    z_old = torch.tensor([[[0.0, -201.0]]])
    z_new = torch.tensor([[[0.0, -200.0]]])
    a = torch.tensor([[1]])
    p_ratio = torch.softmax(z_new, -1)[..., 1] / torch.softmax(z_old, -1)[..., 1]
    assert bool(torch.isnan(p_ratio).all())
    ratio = policy_ratio(logprobs_from_logits(z_new, a), logprobs_from_logits(z_old, a), torch.ones(1, 1))
    assert float(ratio) == pytest.approx(math.e, rel=1e-5)


def _two_step_problem() -> tuple[Tensor, Tensor]:
    """Tabular 2-token LM over a 2-token vocabulary: logits for y1 and for y2 given y1."""
    theta1 = t64([0.3, -0.2])
    theta2 = t64([[0.1, 0.5], [-0.4, 0.2]])
    return theta1, theta2


REWARD = t64([[1.0, -1.0], [0.5, 2.0]])  # R(y1, y2), given at the end of the sequence


def _policy(theta1: Tensor, theta2: Tensor) -> tuple[Tensor, Tensor]:
    return torch.softmax(theta1, 0), torch.softmax(theta2, 1)


def test_s3_per_token_ratio_surrogate_is_exact_only_to_first_order() -> None:
    """§3.2 caveat: PPO applies IS per token with f = A(s_t, a_t) under π_old's states. Exact on all
    4 sequences: the surrogate L(θ) = E_old[Σ_t ρ_t A_t] has ∇L(θ_old) = ∇J(θ_old) (J the true
    expected reward), yet L(θ) − L(θ_old) ≠ J(θ) − J(θ_old) away from θ_old — the change of the
    state distribution is ignored. The sequence-level weight Π_t ρ_t is exact."""
    t1_old, t2_old = _two_step_problem()
    p1_old, p2_old = _policy(t1_old, t2_old)
    q_y1 = (p2_old * REWARD).sum(1)  # Q(y1) = E_{y2~π_old}[R]
    v0 = (p1_old * q_y1).sum()
    a1 = q_y1 - v0  # A(s0, y1)
    a2 = REWARD - q_y1.unsqueeze(1)  # A((y1), y2)
    seq_old = p1_old.unsqueeze(1) * p2_old  # π_old(y1, y2)

    def true_j(t1: Tensor, t2: Tensor) -> Tensor:
        p1, p2 = _policy(t1, t2)
        return (p1.unsqueeze(1) * p2 * REWARD).sum()

    def surrogate(t1: Tensor, t2: Tensor) -> Tensor:
        p1, p2 = _policy(t1, t2)
        rho1 = (p1 / p1_old).unsqueeze(1)
        rho2 = p2 / p2_old
        return (seq_old * (rho1 * a1.unsqueeze(1) + rho2 * a2)).sum()

    def sequence_is(t1: Tensor, t2: Tensor) -> Tensor:
        p1, p2 = _policy(t1, t2)
        return (seq_old * (p1.unsqueeze(1) * p2 / seq_old) * REWARD).sum()

    t1 = t1_old.clone().requires_grad_(True)
    t2 = t2_old.clone().requires_grad_(True)
    g_true = torch.autograd.grad(true_j(t1, t2), [t1, t2])
    g_sur = torch.autograd.grad(surrogate(t1, t2), [t1, t2])
    for a, b in zip(g_true, g_sur, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
    assert abs(float(surrogate(t1_old, t2_old))) < 1e-14  # E_old[A] = 0
    t1_new, t2_new = t1_old + t64([1.0, -1.0]), t2_old + t64([[-1.0, 1.0], [1.0, -0.5]])
    gain_true = float(true_j(t1_new, t2_new) - true_j(t1_old, t2_old))
    gain_sur = float(surrogate(t1_new, t2_new))
    assert abs(gain_true - gain_sur) > 1e-2
    assert float(sequence_is(t1_new, t2_new)) == pytest.approx(float(true_j(t1_new, t2_new)), abs=1e-12)


# ---------------------------------------------------------------- §4 the clip


def test_s4_importance_weights_can_inflate_the_variance() -> None:
    """§4.1: IS is unbiased but its variance can be large. Exact: p = (½, ½), q = (0.99, 0.01),
    f = (0, 1): Var_p[f] = ¼ but Var_q[p/q·f] = 0.01·50² − ¼ = 24.75."""
    p = [Fraction(1, 2), Fraction(1, 2)]
    q = [Fraction(99, 100), Fraction(1, 100)]
    f = [Fraction(0), Fraction(1)]
    w = [px / qx * fx for px, qx, fx in zip(p, q, f, strict=True)]
    mean_is = sum(qx * wx for qx, wx in zip(q, w, strict=True))
    var_is = sum(qx * wx * wx for qx, wx in zip(q, w, strict=True)) - mean_is**2
    mean_p = sum(px * fx for px, fx in zip(p, f, strict=True))
    var_p = sum(px * fx * fx for px, fx in zip(p, f, strict=True)) - mean_p**2
    assert mean_is == mean_p == Fraction(1, 2)
    assert var_p == Fraction(1, 4)
    assert var_is == Fraction(2475, 100)


EPS = 0.2

# (advantage, ratio, dual-clip c, expected per-token loss, expected d loss/d log π, clipped?)
# ids: note1..note4 are the note's four rows; extra_* the cells the note's table leaves out;
# "above"/"below"/"inside" place r relative to [1−ε, 1+ε], "c" is the dual-clip constant 3.
# loss = −min(ρA, clip(ρ, 0.8, 1.2)·A), then with dual clip min(loss, −c·A) where A < 0;
# the gradient w.r.t. log π of the active branch −ρA is −ρA; clipped branches are constant.
TRUTH_TABLE = {
    "note1_Apos_r_above": (2.0, 1.5, None, -2.4, 0.0, True),
    "note2_Apos_r_inside": (2.0, 1.1, None, -2.2, -2.2, False),
    "note3_Aneg_r_below": (-2.0, 0.5, None, 1.6, 0.0, True),
    "note4_Aneg_r_inside": (-2.0, 1.1, None, 2.2, 2.2, False),
    "extra_Apos_r_below": (2.0, 0.5, None, -1.0, -1.0, False),
    "extra_Aneg_r_above": (-2.0, 1.5, None, 3.0, 3.0, False),
    "extra_Aneg_r_above_c_nodual": (-2.0, 4.0, None, 8.0, 8.0, False),
    "extra_Aneg_r_above_c_dual": (-2.0, 4.0, 3.0, 6.0, 0.0, False),
    "extra_Aneg_r_between_dual": (-2.0, 1.5, 3.0, 3.0, 3.0, False),
    "extra_Apos_r_above_c_dual": (2.0, 4.0, 3.0, -2.4, 0.0, True),
    "extra_Azero_r_above": (0.0, 1.5, None, 0.0, 0.0, False),
    "extra_Azero_r_below": (0.0, 0.5, None, 0.0, 0.0, False),
}


@pytest.mark.parametrize(
    ("adv", "ratio", "dual", "loss", "grad", "clipped"), TRUTH_TABLE.values(), ids=TRUTH_TABLE.keys()
)
def test_s4_clip_truth_table(
    adv: float, ratio: float, dual: float | None, loss: float, grad: float, clipped: bool
) -> None:
    """§4.3/§4.4: every (sign of A, region of r) cell, not only the note's four rows."""
    logp_old = t64([[-1.3]])
    logp = (logp_old + math.log(ratio)).requires_grad_(True)
    out = clipped_policy_loss(
        logp, logp_old, t64([[adv]]), torch.ones(1, 1, dtype=torch.bool), clip_low=EPS, dual_clip=dual
    )
    assert float(out.per_token.detach()) == pytest.approx(loss, abs=1e-12)
    (g,) = torch.autograd.grad(out.loss, logp)
    assert float(g) == pytest.approx(grad, abs=1e-12)
    assert float(out.clipfrac) == (1.0 if clipped else 0.0)


def test_s4_note_case2_intermediate_arithmetic() -> None:
    """§4.3 case 2: for A < 0 and r < 1 − ε the note first says (1−ε)A is *larger* (closer to 0)
    and that rA has the larger magnitude — both wrong; its final conclusion (min picks the clipped
    term, zero gradient) is right."""
    adv, r = -2.0, 0.5
    unclipped, clipped = r * adv, (1 - EPS) * adv
    assert clipped < unclipped  # −1.6 < −1.0: the clipped term is the more negative one
    assert abs(unclipped) < abs(clipped)  # |rA| = 1.0 < |(1−ε)A| = 1.6
    assert min(unclipped, clipped) == clipped


def test_s4_clipping_does_not_keep_the_ratio_inside_the_trust_region() -> None:
    """§4.4 caveat: the clip removes the incentive, it does not bound ρ. One step from ρ = 1
    (unclipped, full gradient) can land far outside [1−ε, 1+ε]."""
    theta = torch.zeros(1, 1, 4, dtype=F64, requires_grad=True)
    tokens = torch.tensor([[2]])
    mask = torch.ones(1, 1, dtype=torch.bool)
    logp_old = logprobs_from_logits(theta, tokens).detach()
    out = clipped_policy_loss(logprobs_from_logits(theta, tokens), logp_old, t64([[1.0]]), mask)
    (g,) = torch.autograd.grad(out.loss, theta)
    theta_new = (theta - 10.0 * g).detach()
    ratio = policy_ratio(logprobs_from_logits(theta_new, tokens), logp_old, mask)
    # by hand: d(−ρA)/dz_a = −(1 − ¼) at ρ = 1 for the sampled token, +¼ for the others
    torch.testing.assert_close(g, t64([[[0.25, 0.25, -0.75, 0.25]]]), rtol=0, atol=1e-15)
    assert float(ratio) > 1 + EPS + 1.0


# ---------------------------------------------------------------- §5 the full objective


def test_s5_total_loss_is_the_negated_paper_objective() -> None:
    """§5: trainers minimise −(L_CLIP − c1·L_VF + c2·H) = pg_loss + c1·vf_loss − c2·H."""
    l_clip, l_vf, h, c1, c2 = 0.4, 2.0, 1.5, 0.5, 0.01
    got = total_loss(t64(-l_clip), t64(l_vf), t64(h), vf_coef=c1, ent_coef=c2)
    assert float(got) == pytest.approx(-(l_clip - c1 * l_vf + c2 * h), abs=1e-12)


def _l_clip_by_hand(logp: Tensor, logp_old: Tensor, adv: Tensor) -> float:
    r = torch.exp(logp - logp_old)
    return float(torch.minimum(r * adv, torch.clamp(r, 1 - EPS, 1 + EPS) * adv).mean())


def test_s5_gradient_descent_on_total_loss_raises_the_surrogate_and_fits_the_critic() -> None:
    """§5 sign: a small gradient-descent step on the minimised loss raises L_CLIP, lowers L_VF,
    and with the entropy term alone raises H."""
    g = torch.Generator().manual_seed(3)
    theta = torch.randn(2, 4, 5, generator=g, dtype=F64).requires_grad_(True)
    phi = torch.randn(2, 4, generator=g, dtype=F64).requires_grad_(True)
    tokens = _sample(theta, g)
    adv = t64([[1.0, -0.5, 2.0, -1.5], [0.3, -2.0, 0.7, 1.1]])
    ret = torch.randn(2, 4, generator=g, dtype=F64)
    mask = torch.ones(2, 4, dtype=torch.bool)
    logp_old = logprobs_from_logits(theta, tokens).detach()
    v_old = phi.detach().clone()

    def objective(th: Tensor, ph: Tensor, c1: float, c2: float) -> Tensor:
        logp = logprobs_from_logits(th, tokens)
        pg = clipped_policy_loss(logp, logp_old, adv, mask, clip_low=EPS).loss
        vf = value_loss(ph, v_old, ret, mask, kind="unclipped").loss
        ent = entropy_bonus(entropy_from_logits(th), mask)
        return total_loss(pg, vf, ent, vf_coef=c1, ent_coef=c2)

    gt, gp = torch.autograd.grad(objective(theta, phi, 0.5, 0.0), [theta, phi])
    th_new, ph_new = (theta - 0.05 * gt).detach(), (phi - 0.05 * gp).detach()
    before = _l_clip_by_hand(logp_old, logp_old, adv)
    after = _l_clip_by_hand(logprobs_from_logits(th_new, tokens), logp_old, adv)
    assert after > before + 1e-4
    vf_before = float(((v_old - ret) ** 2).mean()) / 2
    vf_after = float(((ph_new - ret) ** 2).mean()) / 2
    assert vf_after < vf_before - 1e-4
    zero_adv = torch.zeros_like(adv)
    logp = logprobs_from_logits(theta, tokens)
    pg0 = clipped_policy_loss(logp, logp_old, zero_adv, mask).loss
    ent = entropy_bonus(entropy_from_logits(theta), mask)
    (ge,) = torch.autograd.grad(total_loss(pg0, None, ent, ent_coef=0.1), theta)
    h_before = float(entropy_from_logits(theta.detach()).mean())
    h_after = float(entropy_from_logits((theta - 0.05 * ge).detach()).mean())
    assert h_after > h_before + 1e-5
