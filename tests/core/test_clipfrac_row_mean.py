"""The row-mean clip fraction (refppo/core/clipfrac.py, ``clipfrac_agg=row-mean``, oat-llm 0.2.4):
its naive twin, a hand-worked vector, its relation to refppo's token-mean ``clipfrac``, and the
pipeline's policy stage under ``clipfrac_agg`` against the naive stage."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import Ragged, assert_twin_close, ragged_batches

from refppo.core.clipfrac import clipfrac_row_mean, clipfrac_row_mean_naive
from refppo.core.policy import clipped_policy_token_loss
from refppo.errors import ConventionError
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.stages import BY_NAME

pytestmark = pytest.mark.property


def _policy_inputs(b: Ragged) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    old = b.floats(-3.0, -0.1)
    lp = b.with_junk(old + b.normal(b.B, b.T, scale=0.4))
    return lp, old, b.floats(-2.0, 2.0)


@given(ragged_batches(), st.sampled_from([None, 0.3]), st.sampled_from([None, 0.5]))
def test_row_mean_matches_naive(b: Ragged, clip_high: float | None, clamp: float | None) -> None:
    lp, old, adv = _policy_inputs(b)
    kw = {"clip_low": 0.2, "clip_high": clip_high, "log_ratio_clamp": clamp}
    got = clipfrac_row_mean(lp, old, adv, b.mask, **kw)
    want = torch.tensor(clipfrac_row_mean_naive(lp, old, adv, b.mask, **kw), dtype=b.dtype)
    assert_twin_close(got, want, b.dtype, "clipfrac row-mean")


@given(ragged_batches(dtypes=(torch.float64,)))
def test_equal_rows_give_the_token_mean(b: Ragged) -> None:
    """With every row of full length the mean of row means is the token mean (refppo's clipfrac)."""
    full = Ragged((b.T,) * b.B, b.T, b.dtype, b.junk, b.seed)
    lp, old, adv = _policy_inputs(full)
    token = clipped_policy_token_loss(lp, old, adv, full.mask, clip_low=0.2).clipfrac
    torch.testing.assert_close(clipfrac_row_mean(lp, old, adv, full.mask), token, rtol=1e-12, atol=1e-15)


def test_hand_worked_vector() -> None:
    """Row 0 (3 tokens): ρ = e^{0.5} > 1.2 with A > 0 clips, ρ = 1 does not, ρ = e^{-0.5} < 0.8 with A < 0
    clips → 2/3. Row 1 (1 token): ρ = e^{0.5} with A < 0 does not clip → 0. Row mean 1/3; the token
    mean would be 2/4."""
    m = torch.tensor([[True, True, True], [True, False, False]])
    old = torch.zeros(2, 3, dtype=torch.float64)
    lp = torch.tensor([[0.5, 0.0, -0.5], [0.5, 0.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -1.0], [-1.0, 0.0, 0.0]], dtype=torch.float64)
    assert float(clipfrac_row_mean(lp, old, adv, m)) == pytest.approx(1 / 3, abs=1e-15)
    assert clipfrac_row_mean_naive(lp, old, adv, m) == pytest.approx(1 / 3, abs=1e-15)
    assert float(clipped_policy_token_loss(lp, old, adv, m).clipfrac) == pytest.approx(0.5, abs=1e-15)
    q = {"logprobs": lp, "old_logprobs": old, "advantages": adv, "mask": m, "is_weights": None}
    hp = Hyperparams(cliprange=0.2)
    for agg, want in (("row-mean", 1 / 3), ("token-mean", 0.5)):
        conv = Convention.of(clipfrac_agg=agg)
        for naive in (False, True):
            got = BY_NAME["policy"].run(q, conv, hp, naive=naive)["pg_clipfrac"]
            assert float(got) == pytest.approx(want, abs=1e-15), (agg, naive)


def test_row_mean_is_refused_off_the_vanilla_loss() -> None:
    for loss in ("gspo", "cispo"):
        with pytest.raises(ConventionError, match=r"^clipfrac_agg=row-mean: policy_loss=vanilla only"):
            Convention.of(policy_loss=loss, clipfrac_agg="row-mean")
