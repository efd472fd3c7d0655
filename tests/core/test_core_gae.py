"""Unit tests of refppo/core/gae.py: hand-worked examples and every validation error path."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from strategies import assert_twin_close

from refppo.core.gae import gae, gae_naive
from refppo.errors import ConventionError, DtypeError, HyperparameterError, MaskError, ShapeError

NAN, INF = float("nan"), float("inf")


def test_gae_three_token_row_hand_example() -> None:
    # r = (0, 0, 1), V = (0.5, 0.6, 0.7), γ = 0.9, λ = 0.8 (γλ = 0.72); position 3 is padding.
    #   δ_2 = 1 + 0.9·0   − 0.7 = 0.3          (V after the last token := 0)
    #   δ_1 = 0 + 0.9·0.7 − 0.6 = 0.03
    #   δ_0 = 0 + 0.9·0.6 − 0.5 = 0.04
    #   A_2 = 0.3
    #   A_1 = 0.03 + 0.72·0.3   = 0.246
    #   A_0 = 0.04 + 0.72·0.246 = 0.21712
    #   R = A + V = (0.71712, 0.846, 1.0)
    r = torch.tensor([[0.0, 0.0, 1.0, NAN]], dtype=torch.float64)
    v = torch.tensor([[0.5, 0.6, 0.7, INF]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 1, 0]])
    for fn in (gae, gae_naive):
        adv, ret = fn(r, v, m, gamma=0.9, lam=0.8)
        assert adv[0].tolist() == pytest.approx([0.21712, 0.246, 0.3, 0.0], abs=1e-14)
        assert ret[0].tolist() == pytest.approx([0.71712, 0.846, 1.0, 0.0], abs=1e-14)


def test_gae_interior_hole_is_skipped_hand_example() -> None:
    # mask (1, 0, 1): the hole is transparent. Valid positions 0 and 2 with r = (0, 1), V = (0.5, 0.7):
    #   δ_2 = 1 − 0.7 = 0.3; δ_0 = 0 + 0.9·0.7 − 0.5 = 0.13; A_0 = 0.13 + 0.72·0.3 = 0.346.
    r = torch.tensor([[0.0, NAN, 1.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, -INF, 0.7]], dtype=torch.float64)
    adv, _ = gae(r, v, torch.tensor([[1, 0, 1]]), gamma=0.9, lam=0.8)
    assert adv[0].tolist() == pytest.approx([0.346, 0.0, 0.3], abs=1e-14)


def test_gae_length_one_row_hand_example() -> None:
    # One token: A = r − V = 2 − 0.5 = 1.5 whatever γ, λ.
    adv, ret = gae(torch.tensor([[2.0]]), torch.tensor([[0.5]]), torch.tensor([[1]]), gamma=0.3, lam=0.1)
    assert adv.item() == 1.5 and ret.item() == 2.0


R = torch.zeros(2, 3, dtype=torch.float64)
M = torch.ones(2, 3, dtype=torch.bool)


@pytest.mark.parametrize(
    ("gamma", "lam", "message"),
    [
        (1.5, 0.9, r"gamma: expected a number in \[0, 1\], got 1.5"),
        (-0.1, 0.9, r"gamma: expected a number in \[0, 1\], got -0.1"),
        (float("nan"), 0.9, r"gamma: expected a number in \[0, 1\], got nan"),
        (0.9, 1.01, r"lam: expected a number in \[0, 1\], got 1.01"),
    ],
)
def test_gae_out_of_range_gamma_or_lambda_is_rejected(gamma: float, lam: float, message: str) -> None:
    with pytest.raises(HyperparameterError, match=message):
        gae(R, R, M, gamma=gamma, lam=lam)


def test_gae_values_with_wrong_shape_name_the_tensor() -> None:
    with pytest.raises(
        ShapeError, match=r"values: expected shape \[B, T\] = \[2, 3\] \(batch, resp\), got \[2, 4\]"
    ):
        gae(R, torch.zeros(2, 4, dtype=torch.float64), M, gamma=1.0, lam=1.0)


def test_gae_integer_rewards_are_rejected() -> None:
    with pytest.raises(
        DtypeError, match=re.escape("rewards: expected a floating-point tensor, got dtype torch.int64")
    ):
        gae(torch.zeros(2, 3, dtype=torch.long), R, M, gamma=1.0, lam=1.0)


def test_gae_mixed_dtypes_are_rejected() -> None:
    with pytest.raises(DtypeError, match=re.escape("got rewards=torch.float32, values=torch.float64")):
        gae(R.float(), R, M, gamma=1.0, lam=1.0)


def test_gae_empty_row_is_rejected() -> None:
    with pytest.raises(MaskError, match=r"mask: rows \[1\] have no valid token"):
        gae(R, R, torch.tensor([[1, 0, 0], [0, 0, 0]]), gamma=1.0, lam=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize(("gamma", "lam"), [(0.99, 0.95), (0.5, 0.3), (1.0, 1.0), (1.0, 0.0)])
def test_gae_long_rows_with_holes_match_naive(dtype: torch.dtype, gamma: float, lam: float) -> None:
    # T = 700 exercises every step of the vectorized scan (and its early stop once (γλ)^s
    # underflows); interior holes exercise the compaction. Compared with the naive twin.
    g = torch.Generator().manual_seed(7)
    B, T = 3, 700
    m = torch.rand(B, T, generator=g) < 0.8
    m[:, 0] = True
    m[2, 400:] = False
    r = torch.where(m, torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 1, NAN).to(dtype)
    v = torch.where(m, torch.rand(B, T, generator=g, dtype=torch.float64), INF).to(dtype)
    adv, ret = gae(r, v, m, gamma=gamma, lam=lam)
    adv_n, ret_n = gae_naive(r, v, m, gamma=gamma, lam=lam)
    assert_twin_close(adv, adv_n, dtype, "advantages")
    assert_twin_close(ret, ret_n, dtype, "returns")


# ---- masks with holes (issue #11): one row, hand-computed, for each gae_holes convention ----------
# mask (1 1 0 0 1 1 0 0), r = (0 0 5 5 0 1 9 9), V = (1 … 8), γ = 0.9, λ = 0.8 (γλ = 0.72).
HOLE_R = torch.tensor([[0.0, 0.0, 5.0, 5.0, 0.0, 1.0, 9.0, 9.0]], dtype=torch.float64)
HOLE_V = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]], dtype=torch.float64)
HOLE_M = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 0]])
Twin = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@pytest.mark.parametrize("fn", [gae, gae_naive])
def test_gae_holes_skip_hand_example(fn: Twin) -> None:
    # valid 5: δ = 1 − 6 = −5; valid 4: δ = 0.9·6 − 5 = 0.4, A = 0.4 − 0.72·5 = −3.2;
    # valid 1 (next valid 4): δ = 0.9·5 − 2 = 2.5, A = 2.5 − 0.72·3.2 = 0.196;
    # valid 0: δ = 0.9·2 − 1 = 0.8, A = 0.8 + 0.72·0.196 = 0.94112. The holes' r = 5 are never read.
    # verl 0.9.1 compute_gae_advantage_return on this row gave (0.9411, 0.1960, ·, ·, −3.2, −5.0).
    adv, ret = fn(HOLE_R, HOLE_V, HOLE_M, gamma=0.9, lam=0.8, holes="skip")
    assert adv[0].tolist() == pytest.approx([0.94112, 0.196, 0, 0, -3.2, -5.0, 0, 0], abs=1e-12)
    assert ret[0].tolist() == pytest.approx([1.94112, 2.196, 0, 0, 1.8, 1.0, 0, 0], abs=1e-12)


@pytest.mark.parametrize("fn", [gae, gae_naive])
def test_gae_holes_zero_hand_example(fn: Twin) -> None:
    # r, V := 0 on the holes, recursion over positions 0..5: A5 = −5, A4 = −3.2,
    # A3 = 0.9·5 − 0 + 0.72·(−3.2) = 2.196, A2 = 0 + 0.72·2.196 = 1.58112,
    # A1 = 0 + 0 − 2 + 0.72·1.58112 = −0.8615936, A0 = 0.9·2 − 1 + 0.72·A1 = 0.179652608.
    adv, ret = fn(HOLE_R, HOLE_V, HOLE_M, gamma=0.9, lam=0.8, holes="zero")
    want = [0.179652608, -0.8615936, 1.58112, 2.196, -3.2, -5.0, 0, 0]
    assert adv[0].tolist() == pytest.approx(want, abs=1e-12)
    assert ret[0].tolist() == pytest.approx(
        [want[0] + 1, want[1] + 2, want[2], want[3], 1.8, 1.0, 0, 0], abs=1e-12
    )


@pytest.mark.parametrize("fn", [gae, gae_naive])
def test_gae_holes_through_hand_example(fn: Twin) -> None:
    # r, V as given on the holes, recursion over positions 0..5: A5 = −5, A4 = −3.2,
    # A3 = 5 + 0.9·5 − 4 − 0.72·3.2 = 3.196, A2 = 5 + 0.9·4 − 3 + 0.72·3.196 = 7.90112,
    # A1 = 0.9·3 − 2 + 0.72·7.90112 = 6.3888064, A0 = 0.9·2 − 1 + 0.72·6.3888064 = 5.399940608.
    adv, ret = fn(HOLE_R, HOLE_V, HOLE_M, gamma=0.9, lam=0.8, holes="through")
    want = [5.399940608, 6.3888064, 7.90112, 3.196, -3.2, -5.0, 0, 0]
    assert adv[0].tolist() == pytest.approx(want, abs=1e-12)
    ret_want = [want[t] + HOLE_V[0, t].item() for t in range(6)] + [0.0, 0.0]  # R = A + V on 0..5
    assert ret[0].tolist() == pytest.approx(ret_want, abs=1e-12)


def test_gae_holes_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(
        ConventionError, match=r"gae_holes: unknown name 'reset'; valid names are 'skip', 'zero', 'through'"
    ):
        gae(HOLE_R, HOLE_V, HOLE_M, gamma=0.9, lam=0.8, holes="reset")
