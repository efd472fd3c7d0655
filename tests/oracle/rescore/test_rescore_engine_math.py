"""The engine-vs-trainer mathematics (refppo/oracle/rescore/engine_math.py): the sampling support's
mass against its per-position naive twin and against transformers' own warpers, the gate
statistics and the rounded logits on hand-worked vectors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refppo.oracle.rescore.engine_math import (
    gate_stats,
    rounded_logprobs,
    support_keep,
    support_log_mass,
    support_log_mass_naive,
)

pytestmark = pytest.mark.property

# Logits on a grid of 1/4 (ties happen), top_p and min_p just off a grid of 1/100 and 1/50: the
# partial sums of exp(grid)/Σ never land on them, so no rounding decides a boundary.
logit_rows = st.integers(1, 4).flatmap(
    lambda n: st.integers(2, 12).flatmap(
        lambda v: st.lists(
            st.lists(st.integers(-32, 32).map(lambda k: k / 4), min_size=v, max_size=v),
            min_size=n,
            max_size=n,
        )
    )
)
taus = st.sampled_from([0.5, 0.7, 1.0, 1.3])
top_ps = st.integers(1, 100).map(lambda k: min(k / 100 + 1e-6, 1.0))
top_ks = st.integers(-1, 14)
min_ps = st.one_of(st.just(0.0), st.integers(1, 49).map(lambda j: j / 50 + 1e-7))


@settings(max_examples=300, deadline=None)
@given(logit_rows, taus, top_ps, top_ks, min_ps)
def test_support_log_mass_matches_naive(
    rows: list[list[float]], tau: float, top_p: float, top_k: int, min_p: float
) -> None:
    z = torch.tensor(rows, dtype=torch.float64)
    kw = {"temperature": tau, "top_p": top_p, "top_k": top_k, "min_p": min_p}
    log_s, keep = support_log_mass(z, **kw)
    for i, row in enumerate(rows):
        want, kept = support_log_mass_naive(row, **kw)
        assert abs(float(log_s[i]) - want) <= 1e-12, (row, kw)
        if len(set(row)) == len(row):  # distinct logits: the kept set is unique
            assert set(keep[i].nonzero().flatten().tolist()) == kept, (row, kw)
        assert bool(keep[i, int(torch.tensor(row).argmax())])  # the top token is always kept


def _hf_keep(z: torch.Tensor, tau: float, top_p: float, top_k: int, min_p: float) -> torch.Tensor:
    """Tokens transformers' warpers leave finite (its order: top-k, top-p, min-p)."""
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    x, ids = z / tau, torch.zeros((z.shape[0], 1), dtype=torch.long)
    if top_k > 0:
        x = TopKLogitsWarper(top_k=top_k)(ids, x)
    if top_p < 1:
        x = TopPLogitsWarper(top_p=top_p)(ids, x)
    if min_p > 0:
        x = MinPLogitsWarper(min_p=min_p)(ids, x)
    return torch.isfinite(x)


@settings(max_examples=200, deadline=None)
@given(logit_rows, taus, top_ps, top_ks, min_ps, st.sampled_from(["top_p", "top_k", "min_p", "top_k+top_p"]))
def test_support_keep_is_transformers_warpers(
    rows: list[list[float]], tau: float, top_p: float, top_k: int, min_p: float, which: str
) -> None:
    """One filter at a time, and top-k then top-p (the orders agree there): the kept set equals
    HF ``TopPLogitsWarper`` / ``TopKLogitsWarper`` / ``MinPLogitsWarper`` (boundary token kept)."""
    kw = {
        "top_p": top_p if "top_p" in which else 1.0,
        "top_k": top_k if "top_k" in which else 0,
        "min_p": min_p if which == "min_p" else 0.0,
    }
    z = torch.tensor(rows, dtype=torch.float64)
    keep = support_keep(z, temperature=tau, **kw)
    hf = _hf_keep(z, tau, **kw)
    for i, row in enumerate(rows):
        if len(set(row)) == len(row):
            assert torch.equal(keep[i], hf[i]), (row, tau, kw)


def test_nucleus_boundary_token_is_kept_on_a_hand_worked_row() -> None:
    """p = (0.5, 0.3, 0.2) (logits log p): top_p 0.6 keeps the 0.3 token (0.5 above it < 0.6),
    S = 0.8; top_p 0.5 drops it (exactly 0.5 above it, not < 0.5), S = 0.5."""
    z = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]], dtype=torch.float64)
    ls, keep = support_log_mass(z, top_p=0.6)
    assert keep.tolist() == [[True, True, False]] and abs(float(ls) - math.log(0.8)) < 1e-12
    ls, keep = support_log_mass(z, top_p=0.5)
    assert keep.tolist() == [[True, False, False]] and abs(float(ls) - math.log(0.5)) < 1e-12
    ls, keep = support_log_mass(z, top_k=2)
    assert keep.tolist() == [[True, True, False]] and abs(float(ls) - math.log(0.8)) < 1e-12
    ls, keep = support_log_mass(z, min_p=0.5)  # keeps p ≥ 0.25
    assert keep.tolist() == [[True, True, False]] and abs(float(ls) - math.log(0.8)) < 1e-12


def test_gate_stats_hand_worked() -> None:
    """Δ = l_engine − l_trainer = [[ln 2, −ln 2], [ln 1.1, junk]], the last token padding.
    r = e^Δ = (2, 1/2, 1.1); ρ = 1/r = (1/2, 2, 1/1.1)."""
    l_tr = torch.tensor([[-1.0, -2.0], [-0.5, 7.0]], dtype=torch.float64)
    delta = torch.tensor([[math.log(2), -math.log(2)], [math.log(1.1), 123.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    g = gate_stats(l_tr + delta, l_tr, mask, delta=0.2)
    r, rho = [2.0, 0.5, 1.1], [0.5, 2.0, 1 / 1.1]
    want = {
        "ratio_mean": sum(r) / 3,
        "ratio_min": 0.5,
        "ratio_max": 2.0,
        "share_outside_trust": 2 / 3,  # 1.1 is inside [0.8, 1.2]
        "kl_k1": math.log(1.1) / 3,
        "kl_k3": sum(x - 1 - math.log(x) for x in rho) / 3,
        "chi2_token": sum(x * x for x in rho) / 3 - 1,
        "chi2_seq": (1.0 + (1 / 1.1) ** 2) / 2 - 1,  # row 0: Σ log ρ = 0; row 1: ρ = 1/1.1
        "max_abs_dlogp": math.log(2),
        "tokens": 3.0,
        "trust_delta": 0.2,
    }
    assert g.keys() == want.keys()
    for k, v in want.items():
        assert abs(g[k] - v) < 1e-12, (k, g[k], v)


def test_rounded_logprobs_hand_worked() -> None:
    """bf16 has 8 significant bits: 2 + 2^-9 rounds to 2 (spacing 2^-6 there); fp16 (11 bits,
    spacing 2^-9) keeps it."""
    z = torch.tensor([[1.0, 2.0 + 2.0**-9]], dtype=torch.float32)
    y = torch.tensor([1])
    bf = float(rounded_logprobs(z, y, 1.0, torch.bfloat16))
    assert abs(bf - (2.0 - math.log(math.exp(1.0) + math.exp(2.0)))) < 1e-12
    fp = float(rounded_logprobs(z, y, 0.5, torch.float16))
    x = (2.0 + 2.0**-9) / 0.5
    assert abs(fp - (x - math.log(math.exp(2.0) + math.exp(x)))) < 1e-12
