"""Hand-worked examples and input validation of refppo/core/group.py.

Every expected value is worked out in the comments from the estimator's equation (spec/ppo.md,
"Critic-free advantages"), not taken from the code.
"""

from __future__ import annotations

import math

import pytest
import torch

from refppo.core.group import group_advantages, group_scalar_advantages, reinforce_pp_advantages
from refppo.errors import ConventionError, DtypeError, HyperparameterError, MaskError, ShapeError

F64 = torch.float64
# Two prompts, rows interleaved: prompt 7 -> scores 1, 2, 3; prompt 9 -> scores 4, 10.
SCORES = torch.tensor([1.0, 4.0, 2.0, 10.0, 3.0], dtype=F64)
GROUPS = torch.tensor([7, 9, 7, 9, 7])


def _close(got: torch.Tensor, want: list[float] | list[list[float]], tol: float = 1e-6) -> None:
    torch.testing.assert_close(got, torch.tensor(want, dtype=F64), atol=tol, rtol=0.0)


def test_grpo_unbiased_std_hand_worked() -> None:
    # prompt 7: μ = 2, σ = sqrt(((1−2)² + 0 + (3−2)²)/(3−1)) = 1 -> a = (−1, 0, 1)/(1 + 1e-6)
    # prompt 9: μ = 7, σ = sqrt((9 + 9)/1) = sqrt(18) = 4.242641 -> a = ∓3/(4.242641 + 1e-6) = ∓0.7071066
    a = group_scalar_advantages(SCORES, GROUPS, estimator="grpo", eps=1e-6)
    e = 1.0 / (1.0 + 1e-6)
    _close(a, [-e, -3 / (math.sqrt(18) + 1e-6), 0.0, 3 / (math.sqrt(18) + 1e-6), e], tol=1e-12)


def test_grpo_population_std_hand_worked() -> None:
    # prompt 7: σ = sqrt(2/3) = 0.8164966 -> a = ∓1/0.8164966 = ∓1.2247449; prompt 9: σ = 3 -> ∓1
    a = group_scalar_advantages(SCORES, GROUPS, unbiased_std=False, eps=0.0)
    _close(a, [-1.2247449, -1.0, 0.0, 1.0, 1.2247449])


def test_grpo_without_std_and_dr_grpo_hand_worked() -> None:
    # s − μ: prompt 7 -> (−1, 0, 1); prompt 9 -> (−3, 3)
    want = [-1.0, -3.0, 0.0, 3.0, 1.0]
    _close(group_scalar_advantages(SCORES, GROUPS, scale_by_std=False), want, tol=0.0)
    _close(group_scalar_advantages(SCORES, GROUPS, estimator="dr-grpo"), want, tol=0.0)


def test_rloo_hand_worked() -> None:
    # prompt 7: 1 − (2+3)/2 = −1.5; 2 − (1+3)/2 = 0; 3 − (1+2)/2 = 1.5. prompt 9: 4 − 10 = −6; 10 − 4 = 6
    _close(group_scalar_advantages(SCORES, GROUPS, estimator="rloo"), [-1.5, -6.0, 0.0, 6.0, 1.5], tol=0.0)


def test_broadcast_over_valid_tokens_and_token_penalty() -> None:
    # Dr. GRPO a = (−1, −3, 0, 3, 1); row 0 has 2 valid tokens of T = 3, the others 1.
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 0, 0], [1, 0, 0], [1, 0, 0]], dtype=torch.bool)
    a = group_advantages(SCORES, GROUPS, mask, estimator="dr-grpo")
    _close(a, [[-1, -1, 0], [-3, 0, 0], [0, 0, 0], [3, 0, 0], [1, 0, 0]], tol=0.0)
    # penalty p = 0.1, 0.2 on row 0 (junk on its padding): return-to-go 0.3, 0.2 -> −0.7, −0.8
    pen = torch.zeros(5, 3, dtype=F64)
    pen[0] = torch.tensor([0.1, 0.2, math.nan], dtype=F64)
    pen[1:, 1:] = math.inf
    a = group_advantages(SCORES, GROUPS, mask, estimator="dr-grpo", token_penalty=pen)
    _close(a, [[-0.7, -0.8, 0], [-3, 0, 0], [0, 0, 0], [3, 0, 0], [1, 0, 0]], tol=1e-12)


def test_reinforce_pp_baseline_hand_worked() -> None:
    # centred scores (−1, −3, 0, 3, 1), one token each: μ = 0, Σ x² = 20, unbiased σ² = 20/4 = 5
    # -> x/sqrt(5) = x·0.4472136
    mask = torch.ones(5, 1, dtype=torch.bool)
    a = group_advantages(SCORES, GROUPS, mask, estimator="reinforce++-baseline", whiten_eps=0.0)
    _close(a, [[-0.4472136], [-1.3416408], [0.0], [1.3416408], [0.4472136]])
    # population σ² = 20/5 = 4 -> x/2
    a = group_advantages(
        SCORES, GROUPS, mask, estimator="reinforce++-baseline", whiten_eps=0.0, whiten_unbiased=False
    )
    _close(a, [[-0.5], [-1.5], [0.0], [1.5], [0.5]], tol=1e-12)


def test_reinforce_pp_hand_worked() -> None:
    # row 0 rewards (0, 1), row 1 (2, junk) with one valid token; γ = 0.5
    # returns: row 0 R_0 = 0 + 0.5·1 = 0.5, R_1 = 1; row 1 R_0 = 2. Values 0.5, 1, 2: μ = 7/6,
    # deviations −2/3, −1/6, 5/6, Σ d² = 7/6; unbiased σ² = 7/12, σ = 0.7637626
    # -> −0.8728716, −0.2182179, 1.0910895
    r = torch.tensor([[0.0, 1.0], [2.0, math.nan]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    a = reinforce_pp_advantages(r, mask, gamma=0.5, whiten_eps=0.0)
    _close(a, [[-0.8728716, -0.2182179], [1.0910895, 0.0]])
    # population σ² = 7/18, σ = 0.6236096 -> −1.0690450, −0.2672612, 1.3363062
    a = reinforce_pp_advantages(r, mask, gamma=0.5, whiten_eps=0.0, whiten_unbiased=False)
    _close(a, [[-1.0690450, -0.2672612], [1.3363062, 0.0]])
    # clamp form: max(σ², ε) with ε = 1.0 > 7/18 -> divide by 1: deviations themselves
    a = reinforce_pp_advantages(
        r, mask, gamma=0.5, whiten_eps=1.0, whiten_unbiased=False, whiten_eps_form="clamp"
    )
    _close(a, [[-2 / 3, -1 / 6], [5 / 6, 0.0]], tol=1e-12)


def test_group_of_one_each_convention() -> None:
    # prompt 3 has a single response with score 5
    s = torch.tensor([1.0, 3.0, 5.0], dtype=F64)
    g = torch.tensor([0, 0, 3])
    # verl ("score"): μ := 0, σ := 1 -> GRPO 5/(1 + 1e-6), RLOO 5; "zero": 0
    assert float(group_scalar_advantages(s, g, singleton="score", eps=1e-6)[2]) == 5 / (1 + 1e-6)
    assert float(group_scalar_advantages(s, g, estimator="rloo", singleton="score")[2]) == 5.0
    assert float(group_scalar_advantages(s, g, estimator="rloo", singleton="zero")[2]) == 0.0
    # the other group is untouched: RLOO 1 − 3 = −2, 3 − 1 = 2
    _close(group_scalar_advantages(s, g, estimator="rloo", singleton="zero")[:2], [-2.0, 2.0], tol=0.0)
    with pytest.raises(MaskError, match=r"group_index: groups \[3\] have one response"):
        group_scalar_advantages(s, g, estimator="rloo")


def test_equal_scores_with_eps_are_zero() -> None:
    # binary rewards all 1: μ = 1, σ = 0 -> (1 − 1)/(0 + ε) = 0, finite
    s = torch.ones(4, dtype=torch.float32)
    a = group_scalar_advantages(s, torch.zeros(4, dtype=torch.int64), eps=1e-6)
    assert torch.equal(a, torch.zeros(4))


# ------------------------------------------------------------------------------------------------
# Validation: one clear error naming the offending input.
# ------------------------------------------------------------------------------------------------

MASK = torch.ones(5, 2, dtype=torch.bool)


@pytest.mark.parametrize(
    ("kwargs", "exc", "pattern"),
    [
        ({"scores": [1.0] * 5}, DtypeError, "scores: expected a torch.Tensor"),
        ({"scores": torch.arange(5)}, DtypeError, "scores: expected a floating-point tensor"),
        ({"scores": torch.ones(5, 1, dtype=F64)}, ShapeError, r"scores: expected shape \[B\]"),
        ({"scores": torch.ones(4, dtype=F64)}, ShapeError, r"scores: expected shape \[B\] = \[5\]"),
        ({"group_index": [0] * 5}, DtypeError, "group_index: expected a torch.Tensor"),
        ({"group_index": torch.zeros(5)}, DtypeError, "group_index: expected an integer tensor"),
        ({"group_index": torch.zeros(5, dtype=torch.bool)}, DtypeError, "group_index: expected an integer"),
        (
            {"group_index": torch.zeros(4, dtype=torch.int64)},
            ShapeError,
            r"group_index: expected shape \[B\] = \[5\]",
        ),
        ({"mask": torch.zeros(5, 2, dtype=torch.bool)}, MaskError, "mask: rows"),
        ({"mask": torch.ones(5, dtype=torch.bool)}, ShapeError, "mask: expected 2 dims"),
        ({"estimator": "ppo"}, ConventionError, "estimator: unknown name 'ppo'"),
        ({"estimator": "gae"}, HyperparameterError, "estimator: 'gae' is not a group estimator"),
        ({"estimator": "reinforce++"}, HyperparameterError, "reinforce_pp_advantages"),
        ({"singleton": "drop"}, HyperparameterError, "singleton: expected"),
        ({"whiten_eps_form": "sqrt"}, HyperparameterError, "whiten_eps_form: expected"),
        ({"eps": -1.0}, HyperparameterError, "eps: expected a finite number >= 0"),
        ({"whiten_eps": math.nan}, HyperparameterError, "whiten_eps: expected"),
        (
            {"token_penalty": torch.zeros(5, 3, dtype=F64)},
            ShapeError,
            r"token_penalty: expected shape \[B, T\]",
        ),
        ({"token_penalty": torch.zeros(5, 2)}, DtypeError, "token_penalty=torch.float32"),
    ],
)
def test_group_advantages_validation(kwargs: dict[str, object], exc: type[Exception], pattern: str) -> None:
    args: dict[str, object] = {"scores": SCORES, "group_index": GROUPS, "mask": MASK, **kwargs}
    with pytest.raises(exc, match=pattern):
        group_advantages(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "exc", "pattern"),
    [
        ({"rewards": torch.zeros(5, 3, dtype=F64)}, ShapeError, r"rewards: expected shape \[B, T\]"),
        ({"rewards": torch.zeros(5, 2, dtype=torch.int64)}, DtypeError, "rewards: expected a floating-point"),
        ({"gamma": 1.5}, HyperparameterError, r"gamma: expected a number in \[0, 1\]"),
        ({"whiten_eps_form": "x"}, HyperparameterError, "whiten_eps_form: expected"),
        ({"mask": torch.tensor([[1, 0]] + [[0, 0]] * 4)}, MaskError, "mask: rows"),
    ],
)
def test_reinforce_pp_validation(kwargs: dict[str, object], exc: type[Exception], pattern: str) -> None:
    args: dict[str, object] = {"rewards": torch.zeros(5, 2, dtype=F64), "mask": MASK, **kwargs}
    with pytest.raises(exc, match=pattern):
        reinforce_pp_advantages(**args)  # type: ignore[arg-type]


def test_reinforce_pp_unbiased_needs_two_tokens() -> None:
    with pytest.raises(MaskError, match="at least 2 valid tokens"):
        reinforce_pp_advantages(torch.zeros(1, 2, dtype=F64), torch.tensor([[1, 0]]))


# ---- from the survivors of tools/mutate.py --module group ------------------------------------------


def test_grpo_default_eps_is_1e_6() -> None:
    # prompt 7: a = (−1, 0, 1)/(σ + ε) with σ = 1; the default ε = 1e-6 gives ∓0.999999000001
    a = group_scalar_advantages(SCORES, GROUPS, estimator="grpo")
    assert float(a[0]) == pytest.approx(-1.0 / (1.0 + 1e-6), rel=1e-12)


def test_group_advantages_forwards_every_group_option() -> None:
    # population std and ε = 0.5: prompt 7 σ = sqrt(2/3) = 0.816497 -> a = ∓1/(0.816497 + 0.5) = ∓0.759591;
    # prompt 9: σ = 3 -> a = ∓3/3.5 = ∓0.857143; a singleton (prompt 5, score 2) under "score" keeps
    # s/(1 + ε) = 2/1.5 = 1.333333
    scores = torch.cat([SCORES, torch.tensor([2.0], dtype=F64)])
    groups = torch.cat([GROUPS, torch.tensor([5])])
    mask = torch.ones(6, 2, dtype=torch.bool)
    adv = group_advantages(
        scores, groups, mask, estimator="grpo", unbiased_std=False, eps=0.5, singleton="score", whiten=False
    )
    _close(adv[:, 0], [-0.759591, -0.857143, 0.0, 0.857143, 0.759591, 1.333333])
    dr = group_advantages(scores, groups, mask, estimator="grpo", scale_by_std=False, singleton="zero")
    _close(dr[:, 1], [-1.0, -3.0, 0.0, 3.0, 1.0, 0.0])  # s − μ; the singleton 0


def test_group_index_of_the_wrong_shape_is_named_with_its_shape() -> None:
    with pytest.raises(
        ShapeError, match=r"group_index: expected shape \[B\] = \[5\] \(batch\), got \[5, 1\]$"
    ):
        group_scalar_advantages(SCORES, GROUPS.unsqueeze(1))


def test_singletons_are_named_eight_at_most() -> None:
    # nine prompts with one response each: the message lists the first eight ids
    scores = torch.arange(9, dtype=F64)
    with pytest.raises(MaskError, match=r"groups \[0, 1, 2, 3, 4, 5, 6, 7\] have one response"):
        group_scalar_advantages(scores, torch.arange(9))


def test_scores_of_another_batch_size_than_the_mask_are_refused() -> None:
    mask = torch.ones(4, 3, dtype=torch.bool)
    with pytest.raises(ShapeError, match="scores"):
        group_advantages(SCORES, GROUPS, mask)


def test_discounted_returns_default_gamma_is_one() -> None:
    # R_t = Σ_{k≥t} r_k with γ = 1 by default: rewards (1, 2, 3, pad) -> (6, 5, 3, 0)
    from refppo.core.group import discounted_returns

    r = torch.tensor([[1.0, 2.0, 3.0, 9.0]], dtype=F64)
    m = torch.tensor([[True, True, True, False]])
    _close(discounted_returns(r, m), [[6.0, 5.0, 3.0, 0.0]])


def test_reinforce_pp_default_gamma_is_one() -> None:
    # returns (1, 1, 1 | 0, 0, 0) with γ = 1, (0, 0, 1 | 0, 0, 0) with γ = 0: the default is γ = 1
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=F64)
    m = torch.ones(2, 3, dtype=torch.bool)
    default = reinforce_pp_advantages(r, m)
    assert torch.equal(default, reinforce_pp_advantages(r, m, gamma=1.0))
    assert not torch.equal(default, reinforce_pp_advantages(r, m, gamma=0.0))


def test_flash_reinforce_names_a_malformed_group_index() -> None:
    """flash-reinforce reads no group, yet a group_index of the wrong shape or dtype is an input error
    named in one line (it used to be accepted without a word)."""
    s = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64)
    with pytest.raises(ShapeError, match=r"group_index: expected shape \[B\] = \[4\]"):
        group_scalar_advantages(s, torch.tensor([[0], [1]]), estimator="flash-reinforce")
    with pytest.raises(DtypeError, match="group_index: expected an integer tensor"):
        group_scalar_advantages(s, torch.zeros(4), estimator="flash-reinforce")
    ok = group_scalar_advantages(s, torch.tensor([0, 0, 1, 1]), estimator="flash-reinforce")
    assert torch.equal(ok, s - s.mean())
