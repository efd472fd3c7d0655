"""The verify cases of the per-token steps (masked statistics, log-probs, entropy, KL, token
rewards, GAE) and :data:`CASES`, the table of every case (the losses' in :mod:`.cases_loss`).

Each case returns a list of (output name, vectorised, naive, mask-or-None) to compare.
Vectorised functions are looked up on their module at call time (so a test can monkeypatch one).
"""

from __future__ import annotations

import importlib
import math

import torch
from torch import Tensor

from refppo.agg_conventions import MASK_AGGS
from refppo.conventions import GaeHoles, KLEstimator, ScorePosition
from refppo.core import helpers_naive
from refppo.verify.batches import Batch, Case, Pair, with_holes
from refppo.verify.cases_adv import ADV_CASES
from refppo.verify.cases_dist import DIST_CASES
from refppo.verify.cases_loss import LOSS_CASES
from refppo.verify.cases_rollout import ROLLOUT_CASES
from refppo.verify.cases_rows import ROW_CASES

# The modules themselves, looked up by name at run time, so that a test can monkeypatch one
# vectorised function.
gae_mod = importlib.import_module("refppo.core.gae")
kl_mod = importlib.import_module("refppo.core.kl")
logprobs_mod = importlib.import_module("refppo.core.logprobs")
masked_mod = importlib.import_module("refppo.core.masked")
rewards_mod = importlib.import_module("refppo.core.rewards")


def _case_masked_sum(b: Batch, dev: torch.device) -> list[Pair]:
    x, m = b.floats(-3.0, 3.0), b.mask
    xd, md = x.to(dev), m.to(dev)
    return [
        ("all", masked_mod.masked_sum(xd, md), masked_mod.masked_sum_naive(x, m), None),
        ("row", masked_mod.masked_sum(xd, md, dim=-1), masked_mod.masked_sum_naive(x, m, dim=-1), None),
    ]


def _case_masked_mean(b: Batch, dev: torch.device) -> list[Pair]:
    x, m = b.floats(-3.0, 3.0), b.mask
    xd, md = x.to(dev), m.to(dev)
    return [
        ("all", masked_mod.masked_mean(xd, md), masked_mod.masked_mean_naive(x, m), None),
        ("row", masked_mod.masked_mean(xd, md, dim=-1), masked_mod.masked_mean_naive(x, m, dim=-1), None),
    ]


def _case_masked_var(b: Batch, dev: torch.device) -> list[Pair]:
    x, m = b.floats(-3.0, 3.0), b.mask
    return [
        (
            f"unbiased={unbiased}",
            masked_mod.masked_var(x.to(dev), m.to(dev), unbiased=unbiased),
            masked_mod.masked_var_naive(x, m, unbiased=unbiased),
            None,
        )
        for unbiased in (True, False)
    ]


def _case_masked_whiten(b: Batch, dev: torch.device) -> list[Pair]:
    x, m = b.floats(-3.0, 3.0), b.mask
    return [
        (
            f"unbiased={unbiased},shift_mean={shift}",
            masked_mod.masked_whiten(x.to(dev), m.to(dev), unbiased=unbiased, shift_mean=shift),
            masked_mod.masked_whiten_naive(x, m, unbiased=unbiased, shift_mean=shift),
            None,
        )
        for unbiased in (True, False)
        for shift in (True, False)
    ]


def _case_kept_rows_aggregate(b: Batch, dev: torch.device) -> list[Pair]:
    """Every other row out of the loss (row 0 in), counted in ``N_seq`` or not, per mode."""
    x, m = b.floats(-3.0, 3.0), b.mask
    keep = torch.arange(m.shape[0]) % 2 == 0
    return [
        (
            f"{agg.value},count_rows={count}",
            masked_mod.kept_rows_aggregate(x.to(dev), m.to(dev), keep.to(dev), agg, count_rows=count),
            masked_mod.kept_rows_aggregate_naive(x, m, keep, agg, count_rows=count),
            None,
        )
        for agg in MASK_AGGS
        for count in (True, False)
    ]


def _case_masked_moments(b: Batch, dev: torch.device) -> list[Pair]:
    x, m = b.floats(-3.0, 3.0), b.mask
    out: list[Pair] = []
    for unbiased in (True, False):
        mu, var = masked_mod.masked_moments(x.to(dev), m.to(dev), unbiased=unbiased)
        out.append((f"mean(unbiased={unbiased})", mu, masked_mod.masked_mean_naive(x, m), None))
        out.append(
            (f"var(unbiased={unbiased})", var, masked_mod.masked_var_naive(x, m, unbiased=unbiased), None)
        )
    return out


def _case_envelope(b: Batch, dev: torch.device) -> list[Pair]:
    out: list[Pair] = []
    for tag, mask in (("right-padded", b.mask), ("holes", with_holes(b).mask)):
        vec = gae_mod.envelope(mask.to(dev))
        out.append((tag, vec, torch.tensor(helpers_naive.envelope_naive(mask)), None))
    return out


def _case_has_holes(b: Batch, dev: torch.device) -> list[Pair]:
    out: list[Pair] = []
    for tag, mask in (("right-padded", b.mask), ("holes", with_holes(b).mask)):
        vec = torch.tensor(gae_mod.has_holes(mask.to(dev)))
        out.append((tag, vec, torch.tensor(helpers_naive.has_holes_naive(mask)), None))
    return out


def _logits(b: Batch) -> tuple[Tensor, Tensor]:
    B, T = b.shape
    V = 11
    logits = (torch.randn(B, T, V, generator=b.gen, dtype=torch.float64) * 3.0).to(b.dtype)
    logits[~b.mask] = torch.tensor(math.nan, dtype=b.dtype)
    tokens = torch.randint(0, V, (B, T), generator=b.gen)
    tokens[~b.mask] = -7  # out-of-range ids on padding must be ignored
    return logits, tokens


def _case_logprobs(b: Batch, dev: torch.device) -> list[Pair]:
    logits, tokens = _logits(b)
    md = b.mask.to(dev)
    return [
        (
            f"T={temp}",
            logprobs_mod.logprobs_from_logits(logits.to(dev), tokens.to(dev), md, temperature=temp),
            logprobs_mod.logprobs_from_logits_naive(logits, tokens, b.mask, temperature=temp),
            None,
        )
        for temp in (1.0, 0.7)
    ]


def _case_entropy(b: Batch, dev: torch.device) -> list[Pair]:
    logits, _ = _logits(b)
    return [
        (
            f"T={temp}",
            logprobs_mod.entropy_from_logits(logits.to(dev), b.mask.to(dev), temperature=temp),
            logprobs_mod.entropy_from_logits_naive(logits, b.mask, temperature=temp),
            None,
        )
        for temp in (1.0, 0.7)
    ]


def _case_kl(b: Batch, dev: torch.device) -> list[Pair]:
    lp, lr = b.floats(-6.0, -0.1), b.floats(-6.0, -0.1)
    out: list[Pair] = []
    for est in KLEstimator:
        for lrc, vc in ((None, None), ((-3.0, 3.0), 2.0)):
            out.append(
                (
                    f"{est.value}{'_clamped' if vc else ''}",
                    kl_mod.token_kl(
                        lp.to(dev), lr.to(dev), b.mask.to(dev), est, log_ratio_clamp=lrc, value_clamp=vc
                    ),
                    kl_mod.token_kl_naive(lp, lr, b.mask, est, log_ratio_clamp=lrc, value_clamp=vc),
                    None,
                )
            )
    return out


def _case_rewards(b: Batch, dev: torch.device) -> list[Pair]:
    kl, s = b.floats(-1.0, 1.0), b.scores()
    out: list[Pair] = []
    for where in ScorePosition:
        for k in (kl, None):
            kd = k.to(dev) if k is not None else None
            out.append(
                (
                    f"{where}{'' if k is not None else '_nokl'}",
                    rewards_mod.token_rewards(s.to(dev), kd, b.mask.to(dev), 0.05, score_at=where),
                    rewards_mod.token_rewards_naive(s, k, b.mask, 0.05, score_at=where),
                    None,
                )
            )
    return out


def _case_gae(b: Batch, dev: torch.device) -> list[Pair]:
    r, v = b.floats(-1.0, 1.0), b.floats(-2.0, 2.0)
    out: list[Pair] = []
    for gamma, lam in ((1.0, 1.0), (0.99, 0.95), (0.9, 0.0)):
        adv, ret = gae_mod.gae(r.to(dev), v.to(dev), b.mask.to(dev), gamma=gamma, lam=lam)
        adv_n, ret_n = gae_mod.gae_naive(r, v, b.mask, gamma=gamma, lam=lam)
        out.append((f"advantages(γ={gamma},λ={lam})", adv, adv_n, None))
        out.append((f"returns(γ={gamma},λ={lam})", ret, ret_n, None))
    # Interior holes (multi-turn): `skip` and `zero` never read r, V there (junk); `through` does.
    hb = with_holes(b)
    r_junk, v_junk = hb.floats(-1.0, 1.0), hb.floats(-2.0, 2.0)
    for how in GaeHoles:
        rh, vh = (r, v) if how is GaeHoles.THROUGH else (r_junk, v_junk)
        adv, ret = gae_mod.gae(rh.to(dev), vh.to(dev), hb.mask.to(dev), gamma=0.99, lam=0.95, holes=how)
        adv_n, ret_n = gae_mod.gae_naive(rh, vh, hb.mask, gamma=0.99, lam=0.95, holes=how)
        out.append((f"advantages(holes={how.value})", adv, adv_n, None))
        out.append((f"returns(holes={how.value})", ret, ret_n, None))
    return out


TOKEN_CASES: dict[str, Case] = {
    "masked_sum": _case_masked_sum,
    "masked_mean": _case_masked_mean,
    "masked_var": _case_masked_var,
    "masked_whiten": _case_masked_whiten,
    "masked_moments": _case_masked_moments,
    "kept_rows_aggregate": _case_kept_rows_aggregate,
    "logprobs_from_logits": _case_logprobs,
    "entropy_from_logits": _case_entropy,
    "token_kl": _case_kl,
    "token_rewards": _case_rewards,
    "gae": _case_gae,
    "envelope": _case_envelope,
    "has_holes": _case_has_holes,
}
"""The per-token steps' cases, in table order (before :data:`.cases_loss.LOSS_CASES`)."""

CASES: dict[str, Case] = {
    **TOKEN_CASES,
    **ADV_CASES,
    **LOSS_CASES,
    **ROLLOUT_CASES,
    **ROW_CASES,
    **DIST_CASES,
}
"""Step (vectorized function) -> case. Together they call every public vectorized function of the
core directly, each against its naive twin (``tests/verify/test_verify_coverage.py`` checks this and
lists the deliberate exceptions, the argument validators ``check_*``)."""
