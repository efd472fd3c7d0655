"""Properties of the oracle over random conventions and inputs (small dumps, few examples); the dumps' outputs
come from the naive twins (``oracle_helpers.naive_dump``), not from the recompute that checks them."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle_helpers import make_inputs, naive_dump, save, setup_for

from refppo.dump.load import load_dump
from refppo.oracle.check.diagnose import check

pytestmark = pytest.mark.property

CONVS = st.fixed_dictionaries(
    {
        "kl_estimator": st.sampled_from(["k1", "k2", "k3", "abs"]),
        "kl_in": st.sampled_from(["reward", "loss"]),
        "score_at": st.sampled_from(["last_valid", "after_last_valid", "last_position"]),
        "whiten_advantages": st.sampled_from(["none", "masked", "masked_no_shift"]),
        "whiten_variance": st.sampled_from(["unbiased", "population"]),
        "loss_agg": st.sampled_from(
            ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
        ),
        "value_loss": st.sampled_from(["clipped", "unclipped"]),
        "dual_clip": st.sampled_from(["none", "3"]),
        "vf_mask": st.sampled_from(["value", "response"]),
    }
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conv=CONVS, seed=st.integers(0, 10_000), dtype=st.sampled_from([torch.float64, torch.float32]))
def test_a_dump_matches_the_convention_it_was_made_with(
    conv: dict[str, str], seed: int, dtype: torch.dtype
) -> None:
    s = setup_for(None, conv)
    d = naive_dump(make_inputs(B=4, T=8, seed=seed), s, dtype=dtype)
    with tempfile.TemporaryDirectory() as tmp:
        res = check(load_dump(save(Path(tmp), d, s)), s)
    assert res.match, res.diagnosis


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conv=CONVS, seed=st.integers(0, 10_000), scale=st.sampled_from([-1.0, 0.5, 2.0]))
def test_scaling_a_loss_is_caught_at_that_loss(conv: dict[str, str], seed: int, scale: float) -> None:
    s = setup_for(None, conv)
    d = naive_dump(make_inputs(B=4, T=8, seed=seed), s)
    d["vf_loss"] = d["vf_loss"] * scale
    with tempfile.TemporaryDirectory() as tmp:
        res = check(load_dump(save(Path(tmp), d, s)), s, explain_divergence=False)
    assert res.first_divergence == "vf_loss"
