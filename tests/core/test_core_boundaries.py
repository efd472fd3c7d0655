"""Boundary values of the core's arguments, ties, and rows without a valid token.

Each case sits exactly on a boundary that a ``<`` / ``<=`` slip would move (found by
``tools/mutate.py``): a KL clamp ``(c, c)``, a KL value clamp of 0.5, a token id equal to ``V``,
dual-clip ``c = 1`` and ``c = 1.5``, the ties ``ρ = c`` (dual-clip) and ``ρ = 1 + ε`` (clip) that
count as *not* clipped (spec/ppo.md: ``clipfrac = mean[L2 > L1]``, ``clipfrac_lower = mean[A < 0
and ℓ > −cA]``, strict), and the APIs that accept rows with no valid token
(``check_mask(require_nonempty_rows=False)``: ``token_kl``, ``policy_ratio``, ``masked_sum``, the
log-prob/entropy read-outs) against those that refuse them. Expected values are worked out in the
comments.
"""

from __future__ import annotations

import math

import pytest
import torch

from refppo.core.aggregate import aggregate_loss
from refppo.core.kl import token_kl
from refppo.core.logprobs import entropy_from_logits, logprobs_from_logits
from refppo.core.masked import masked_mean, masked_sum
from refppo.core.policy import clipped_policy_loss, policy_ratio
from refppo.core.value import value_loss
from refppo.errors import DtypeError, HyperparameterError, MaskError, ShapeError
from refppo.pipeline.settings import Convention, Hyperparams

F64 = torch.float64


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


# ---------------------------------------------------------------------------------------------
# KL clamps
# ---------------------------------------------------------------------------------------------


def test_kl_log_ratio_clamp_with_equal_bounds_is_accepted() -> None:
    # d = logp − ref = [−1, 0.2, 3] clamped to [0.3, 0.3] -> 0.3 everywhere (k1 = d); padding 0.
    logp = _t([[-1.0, 0.2, 3.0, math.nan]])
    ref = torch.zeros(1, 4, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]])
    kl = token_kl(logp, ref, mask, "k1", log_ratio_clamp=(0.3, 0.3))
    assert kl[0].tolist() == [0.3, 0.3, 0.3, 0.0]


def test_kl_log_ratio_clamp_with_crossed_bounds_is_refused() -> None:
    with pytest.raises(HyperparameterError, match=r"log_ratio_clamp: expected lo <= hi, got \(0.31, 0.3\)"):
        token_kl(_t([[0.0]]), _t([[0.0]]), torch.tensor([[1]]), log_ratio_clamp=(0.31, 0.3))


def test_kl_value_clamp_of_one_half_is_accepted_and_clamps_both_sides() -> None:
    # d = [2, 0.5, −3]: k2 = d²/2 = [2, 0.125, 4.5] -> clamp ±0.5 -> [0.5, 0.125, 0.5];
    # k1 = d = [2, 0.5, −3] -> [0.5, 0.5, −0.5] (the lower bound −c binds for k1 only).
    logp = _t([[2.0, 0.5, -3.0]])
    ref = torch.zeros(1, 3, dtype=F64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert token_kl(logp, ref, mask, "k2", value_clamp=0.5)[0].tolist() == [0.5, 0.125, 0.5]
    assert token_kl(logp, ref, mask, "k1", value_clamp=0.5)[0].tolist() == [0.5, 0.5, -0.5]


@pytest.mark.parametrize("c", [0.0, -0.5, math.inf, math.nan])
def test_kl_value_clamp_must_be_positive_and_finite(c: float) -> None:
    with pytest.raises(HyperparameterError, match="value_clamp: expected a number > 0"):
        token_kl(_t([[0.0]]), _t([[0.0]]), torch.tensor([[1]]), value_clamp=c)


# ---------------------------------------------------------------------------------------------
# Token ids
# ---------------------------------------------------------------------------------------------


def test_token_id_equal_to_vocab_size_is_refused() -> None:
    logits = torch.zeros(1, 2, 5, dtype=F64)
    with pytest.raises(ShapeError, match=r"tokens: id 5 at valid position \[0, 1\] is outside \[0, V=5\)"):
        logprobs_from_logits(logits, torch.tensor([[4, 5]]), torch.tensor([[1, 1]]))
    with pytest.raises(ShapeError, match=r"tokens: id -1 at valid position \[0, 0\] is outside \[0, V=5\)"):
        logprobs_from_logits(logits, torch.tensor([[-1, 0]]), torch.tensor([[1, 1]]))
    # The edges V − 1 and 0 are fine: uniform logits give log(1/5) at both.
    out = logprobs_from_logits(logits, torch.tensor([[4, 0]]), torch.tensor([[1, 1]]))
    assert out[0].tolist() == pytest.approx([-math.log(5.0)] * 2, abs=1e-15)


# ---------------------------------------------------------------------------------------------
# Dual-clip constant and the ties
# ---------------------------------------------------------------------------------------------

MASK2 = torch.tensor([[1, 1]])
ADV2 = _t([[-1.0, 2.0]])


def test_dual_clip_of_one_is_refused_by_the_core_and_the_convention() -> None:
    lp = torch.zeros(1, 2, dtype=F64)
    with pytest.raises(
        HyperparameterError, match=r"dual_clip: expected a constant c > 1 \(or None\), got 1.0"
    ):
        clipped_policy_loss(lp, lp, ADV2, MASK2, dual_clip=1.0)
    with pytest.raises(HyperparameterError, match=r"dual_clip: expected c > 1 or None, got 1\.0"):
        Convention.of(dual_clip=1.0)


def test_dual_clip_of_one_and_a_half_is_accepted_and_caps_the_loss() -> None:
    # Token 0: A = −1, ρ = 2 (> 1 + ε): ℓ = max(2, 1.2) = 2, capped at −cA = 1.5; dual-clip active.
    # Token 1: A = 2, ρ = 1: ℓ = −2. token-mean = (1.5 − 2)/2 = −0.25; clipfrac_lower = 1/2.
    assert Convention.of(dual_clip=1.5).policy.dual_clip == 1.5
    lp = _t([[math.log(2.0), 0.0]])
    out = clipped_policy_loss(lp, torch.zeros(1, 2, dtype=F64), ADV2, MASK2, dual_clip=1.5)
    assert out.per_token[0].tolist() == pytest.approx([1.5, -2.0], abs=1e-15)
    assert out.loss.item() == pytest.approx(-0.25, abs=1e-15)
    assert out.clipfrac_lower.item() == 0.5


def test_clipfrac_lower_does_not_count_the_tie_rho_equal_c() -> None:
    # ρ = exp(ln 1.5) is exactly 1.5 in float64 (checked below), A = −1, c = 1.5:
    # ℓ = −Aρ = 1.5 = −cA: the table row "A < 0, 1 + ε < ρ ≤ c" (not dual-clipped), so
    # clipfrac_lower = 0 and ℓ = 1.5. One ulp above c the cap is active (row "ρ > c").
    lp = _t([[math.log(1.5), 0.0]])
    old = torch.zeros(1, 2, dtype=F64)
    assert policy_ratio(lp, old, MASK2)[0, 0].item() == 1.5
    tie = clipped_policy_loss(lp, old, ADV2, MASK2, dual_clip=1.5)
    assert tie.clipfrac_lower.item() == 0.0
    assert tie.per_token[0, 0].item() == 1.5
    above = clipped_policy_loss(lp, old, ADV2, MASK2, dual_clip=math.nextafter(1.5, 0.0))
    assert above.clipfrac_lower.item() == 0.5


def test_clipfrac_does_not_count_the_tie_rho_equal_one_plus_eps() -> None:
    # ε = 0.5, ρ = 1.5 exactly, A = 1: L1 = −1.5 = L2 -> not clipped (strict L2 > L1).
    lp = _t([[math.log(1.5)]])
    old = torch.zeros(1, 1, dtype=F64)
    out = clipped_policy_loss(lp, old, _t([[1.0]]), torch.tensor([[1]]), clip_low=0.5)
    assert out.clipfrac.item() == 0.0
    out2 = clipped_policy_loss(lp, old, _t([[1.0]]), torch.tensor([[1]]), clip_low=0.5, clip_high=0.4999)
    assert out2.clipfrac.item() == 1.0


# ---------------------------------------------------------------------------------------------
# Value clip of 0.5
# ---------------------------------------------------------------------------------------------


def test_value_clip_of_one_half_hand_example() -> None:
    # V_old = 0, ε_v = 0.5, R = 0. V = 2: V^clip = 0.5, max(4, 0.25)/2 = 2 (not clipped: the
    # clipped error is smaller). V = −1 with R = −3: V^clip = −0.5, max(4, 6.25)/2 = 3.125, clipped.
    out = value_loss(_t([[2.0, -1.0]]), _t([[0.0, 0.0]]), _t([[0.0, -3.0]]), MASK2, clip=0.5)
    assert out.per_token[0].tolist() == [2.0, 3.125]
    assert out.clipfrac.item() == 0.5
    assert out.loss.item() == pytest.approx(2.5625, abs=1e-15)


# ---------------------------------------------------------------------------------------------
# Rows with no valid token
# ---------------------------------------------------------------------------------------------

EMPTY_ROW_MASK = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])


def test_rows_without_valid_token_are_allowed_where_the_api_says_so() -> None:
    logp = _t([[0.5, -1.0, math.nan], [math.nan, math.inf, 1.0], [2.0, math.nan, 3.0]])
    ref = _t([[0.25, 1.0, 0.0], [math.inf, 0.0, 0.0], [-1.0, 0.0, math.nan]])
    m = EMPTY_ROW_MASK
    # k1 = logp − ref on valid positions: row 0 [0.25, −2], row 1 nothing, row 2 [3].
    assert token_kl(logp, ref, m, "k1").tolist() == [[0.25, -2.0, 0.0], [0.0, 0.0, 0.0], [3.0, 0.0, 0.0]]
    ratio = policy_ratio(logp, ref, m)
    want = [[math.exp(0.25), math.exp(-2.0), 0.0], [0.0, 0.0, 0.0], [math.exp(3.0), 0.0, 0.0]]
    torch.testing.assert_close(ratio, _t(want), rtol=1e-15, atol=0.0)
    assert masked_sum(logp, m, dim=-1).tolist() == [-0.5, 0.0, 2.0]
    assert masked_sum(logp, m).item() == 1.5
    logits = torch.zeros(3, 3, 4, dtype=F64)
    logits[1] = math.nan  # the empty row holds junk only
    tokens = torch.tensor([[0, 3, 99], [99, 99, 99], [2, -7, 99]])
    ln4 = math.log(4.0)  # uniform logits over V = 4
    want_h = _t([[ln4, ln4, 0.0], [0.0, 0.0, 0.0], [ln4, 0.0, 0.0]])
    torch.testing.assert_close(logprobs_from_logits(logits, tokens, m), -want_h, rtol=0.0, atol=1e-15)
    torch.testing.assert_close(entropy_from_logits(logits, m), want_h, rtol=0.0, atol=1e-15)


def test_rows_without_valid_token_are_refused_where_a_mean_needs_them() -> None:
    x = torch.zeros(3, 3, dtype=F64)
    msg = r"mask: rows \[1\] have no valid token"
    with pytest.raises(MaskError, match=msg):
        masked_mean(x, EMPTY_ROW_MASK)
    with pytest.raises(MaskError, match=msg):
        clipped_policy_loss(x, x, x, EMPTY_ROW_MASK)
    with pytest.raises(MaskError, match=msg):
        value_loss(x, x, x, EMPTY_ROW_MASK)


# ---------------------------------------------------------------------------------------------
# The pipeline's Convention/Hyperparams refuse at construction what the core would refuse later
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dual_clip": math.inf}, r"dual_clip: expected c > 1 or None, got inf"),
        ({"dual_clip": math.nan}, r"dual_clip: expected c > 1 or None, got nan"),
        ({"log_ratio_clamp": 0.0}, r"log_ratio_clamp: expected a finite number > 0, got 0\.0"),
        ({"log_ratio_clamp": math.inf}, r"log_ratio_clamp: expected a finite number > 0, got inf"),
        ({"kl_log_ratio_clamp": (1.0, -1.0)}, r"kl_log_ratio_clamp: expected lo <= hi, got \(1\.0, -1\.0\)"),
        ({"kl_log_ratio_clamp": (None, math.inf)}, r"kl_log_ratio_clamp: hi must be finite or None, got inf"),
        ({"kl_value_clamp": 0.0}, r"kl_value_clamp: expected a number > 0, got 0\.0"),
    ],
)
def test_convention_refuses_at_construction_what_the_core_refuses(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(HyperparameterError, match=f"^{message}$"):
        Convention.of(**kwargs)  # type: ignore[arg-type]  # parametrized kwargs


def test_convention_accepts_the_boundary_values_the_core_accepts() -> None:
    c = Convention.of(dual_clip=1.5, log_ratio_clamp=20.0, kl_log_ratio_clamp=(0.3, 0.3), kl_value_clamp=0.5)
    assert (c.policy.dual_clip, c.kl.log_ratio_clamp, c.kl.value_clamp) == (1.5, (0.3, 0.3), 0.5)


def test_hyperparams_refuse_a_cliprange_above_one() -> None:
    with pytest.raises(HyperparameterError, match=r"^cliprange: expected a number in \[0, 1\], got 1\.5$"):
        Hyperparams(cliprange=1.5)
    assert Hyperparams(cliprange=1.0).cliprange == 1.0  # no lower bound (TRL 1.16.0 cispo)


# ---------------------------------------------------------------------------------------------
# Mixed dtypes in the value loss: each of the three inputs is checked
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("odd", ["values", "values_old", "returns"])
def test_value_loss_refuses_any_one_input_of_another_dtype(odd: str) -> None:
    x = {k: torch.zeros(1, 2, dtype=F64) for k in ("values", "values_old", "returns")}
    x[odd] = x[odd].float()
    with pytest.raises(
        DtypeError, match=f"expected one floating dtype for all inputs, got .*{odd}=torch.float32"
    ):
        value_loss(x["values"], x["values_old"], x["returns"], MASK2)


# ---------------------------------------------------------------------------------------------
# The policy and value losses pass their normalisers to the aggregation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "norm"),
    [
        ("token-mean", {"token_count": 5.0}),
        ("seq-mean-token-mean", {"seq_count": 5.0}),
        ("seq-mean-token-sum", {"seq_count": 5.0}),
        ("seq-mean-token-sum-norm", {"horizon": 5.0}),
        ("seq-mean-token-sum-norm", {"seq_count": 5.0}),
    ],
)
def test_policy_and_value_losses_pass_their_normalisers_on(mode: str, norm: dict[str, float]) -> None:
    # Compared with aggregate_loss (the core's aggregation) called directly on the per-token loss.
    m = torch.tensor([[1, 1, 0]])
    v = value_loss(
        _t([[1.0, 2.0, 0.0]]),
        _t([[0.0, 0.0, 0.0]]),
        _t([[0.0, 0.0, 0.0]]),
        m,
        kind="unclipped",
        agg=mode,
        **norm,
    )
    want_v = aggregate_loss(v.per_token, m, mode, **norm)
    assert v.loss.item() == want_v.item()
    assert want_v.item() != aggregate_loss(v.per_token, m, mode).item()  # the normaliser matters
    lp = _t([[0.1, -0.2, 0.0]])
    p = clipped_policy_loss(lp, torch.zeros(1, 3, dtype=F64), _t([[1.0, 2.0, 0.0]]), m, agg=mode, **norm)
    want_p = aggregate_loss(p.per_token, m, mode, **norm)
    assert p.loss.item() == want_p.item()
    assert want_p.item() != aggregate_loss(p.per_token, m, mode).item()
