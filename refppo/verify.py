"""``refppo verify``: every vectorized core step against its naive twin, on seeded ragged batches.

Each case builds a right-padded batch (random lengths, including length-1 rows) whose padded
positions hold junk (NaN, ±inf, huge values), runs the vectorized function and its naive twin
(plain Python floats, one token at a time), and compares them on every output. One table row per
(step, device, dtype); the exit status is non-zero if any row fails. Runs on CPU, and also on CUDA
when ``torch.cuda.is_available()``.

The tolerances live here, in :data:`TOLERANCES`, and the test suite imports them from here, so the
CLI and the property tests judge "equal to the naive twin" by one rule (:func:`compare`).
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from refppo.conventions import KLEstimator, LossAgg, ValueLoss

# The modules themselves, looked up by name: ``refppo.core`` re-exports the *function* ``gae``
# under the submodule's name, so ``from refppo.core import gae`` would give the function. Calling
# through the module at run time also lets a test monkeypatch one vectorised function.
aggregate_mod = importlib.import_module("refppo.core.aggregate")
gae_mod = importlib.import_module("refppo.core.gae")
grad_mod = importlib.import_module("refppo.core.grad")
gspo_mod = importlib.import_module("refppo.core.gspo")
kl_mod = importlib.import_module("refppo.core.kl")
logprobs_mod = importlib.import_module("refppo.core.logprobs")
masked_mod = importlib.import_module("refppo.core.masked")
objective_mod = importlib.import_module("refppo.core.objective")
policy_mod = importlib.import_module("refppo.core.policy")
rewards_mod = importlib.import_module("refppo.core.rewards")
value_mod = importlib.import_module("refppo.core.value")


@dataclass(frozen=True)
class Tolerance:
    """``|actual − expected| ≤ atol·S + rtol·|expected|`` elementwise, ``S = max(1, max|expected|)``.

    The absolute part is scaled by the largest magnitude ``S`` of the expected tensor because every
    core step is a sum (of tokens, of discounted TD residuals, of vocabulary terms): its rounding
    error is proportional to the magnitude of the terms summed, not to the (possibly cancelled,
    near-zero) result.
    """

    atol: float
    rtol: float


TOLERANCES: dict[torch.dtype, Tolerance] = {
    # float64 (u = 1.1e-16): the naive twin computes in IEEE double too; the two differ only in
    # summation order (pairwise/vectorised vs left-to-right), at most ~1e3 terms here, so errors
    # stay below ~1e3·u·S ≈ 1e-13·S. 1e-10 leaves three orders of magnitude of margin and still
    # catches any real formula error (those are O(1)).
    torch.float64: Tolerance(atol=1e-10, rtol=1e-10),
    # float32 (u = 6e-8): the vectorised path rounds every intermediate to float32 while the twin
    # works in double and rounds once at the end. The longest float32 chain is GAE's 64-step
    # recursion (≈ 64·u·S ≈ 4e-6·S worst case, ~sqrt(64)·u·S ≈ 5e-7·S typically) and the whitening's
    # mean/variance over ≤ 1024 tokens; 2e-5 covers the worst case with margin.
    torch.float32: Tolerance(atol=2e-5, rtol=2e-5),
}


def tolerance_for(dtype: torch.dtype) -> Tolerance:
    """The tolerance for ``dtype`` (float32 or float64)."""
    return TOLERANCES[dtype]


@dataclass(frozen=True)
class Comparison:
    """Result of :func:`compare`."""

    max_abs: float
    max_rel: float
    ok: bool


def compare(actual: Tensor, expected: Tensor, dtype: torch.dtype, mask: Tensor | None = None) -> Comparison:
    """Compare ``actual`` to ``expected`` by :data:`TOLERANCES` (only where ``mask`` is true if given).

    Non-finite values must agree exactly (a NaN/inf on one side only is a failure).
    """
    tol = tolerance_for(dtype)
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    if a.shape != e.shape:
        return Comparison(math.inf, math.inf, False)
    if mask is not None:
        sel = mask.detach().cpu().to(torch.bool)
        a, e = a[sel], e[sel]
    a, e = a.flatten(), e.flatten()
    if a.numel() == 0:
        return Comparison(0.0, 0.0, True)
    fin_a, fin_e = torch.isfinite(a), torch.isfinite(e)
    nonfinite_ok = bool(torch.equal(fin_a, fin_e)) and bool(
        (a[~fin_a].nan_to_num(0.0, 1.0, -1.0) == e[~fin_e].nan_to_num(0.0, 1.0, -1.0)).all()
    )
    a, e = a[fin_a & fin_e], e[fin_a & fin_e]
    if a.numel() == 0:
        return Comparison(0.0, 0.0, nonfinite_ok)
    diff = (a - e).abs()
    scale = max(1.0, float(e.abs().max()))
    max_abs = float(diff.max())
    nz = e != 0
    max_rel = float((diff[nz] / e[nz].abs()).max()) if bool(nz.any()) else 0.0
    ok = nonfinite_ok and bool((diff <= tol.atol * scale + tol.rtol * e.abs()).all())
    return Comparison(max_abs, max_rel, ok)


# ----------------------------------------------------------------------------------------------
# Seeded ragged batches with junk padding.
# ----------------------------------------------------------------------------------------------

JUNK_VALUES: tuple[float, ...] = (math.nan, math.inf, -math.inf, 1e30, -1e30)


@dataclass(frozen=True)
class Batch:
    """A seeded ragged batch: mask plus helpers that draw tensors with junk on the padding."""

    mask: Tensor
    dtype: torch.dtype
    gen: torch.Generator

    @property
    def shape(self) -> tuple[int, int]:
        B, T = self.mask.shape
        return int(B), int(T)

    def floats(self, low: float, high: float) -> Tensor:
        """``[B, T]`` uniform in ``[low, high)`` at valid positions, junk at padded ones."""
        x = torch.rand(self.shape, generator=self.gen, dtype=torch.float64) * (high - low) + low
        junk_idx = torch.randint(0, len(JUNK_VALUES), self.shape, generator=self.gen)
        junk = torch.tensor(JUNK_VALUES, dtype=torch.float64)[junk_idx]
        return torch.where(self.mask, x, junk).to(self.dtype)

    def scores(self, low: float = -5.0, high: float = 5.0) -> Tensor:
        B, _ = self.shape
        return (torch.rand(B, generator=self.gen, dtype=torch.float64) * (high - low) + low).to(self.dtype)


def make_batch(seed: int, dtype: torch.dtype, *, B: int | None = None, T: int | None = None) -> Batch:
    """Seeded right-padded batch (B in 2..8, T in 1..24 unless given).

    Row 0 has length 1 and row 1 is full; the other rows have random lengths.
    """
    gen = torch.Generator().manual_seed(seed)
    if B is None:
        B = int(torch.randint(2, 9, (), generator=gen))
    if T is None:
        T = int(torch.randint(1, 25, (), generator=gen))
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    lengths[0] = 1
    if B > 1:
        lengths[1] = T
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    return Batch(mask=mask, dtype=dtype, gen=gen)


# ----------------------------------------------------------------------------------------------
# The cases: each returns a list of (output name, vectorised, naive, mask-or-None) to compare.
# Vectorised functions are looked up on their module at call time (so a test can monkeypatch one).
# ----------------------------------------------------------------------------------------------

Pair = tuple[str, Tensor, Tensor, Tensor | None]
Case = Callable[[Batch, torch.device], list[Pair]]


def _t(x: float | list[list[float]], like: Tensor) -> Tensor:
    return torch.tensor(x, dtype=torch.float64, device=like.device)


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
    for where in ("last_valid", "after_last_valid", "last_position"):
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
    return out


def _case_policy(b: Batch, dev: torch.device) -> list[Pair]:
    lp_old = b.floats(-4.0, -0.1)
    lp = torch.where(b.mask, lp_old + b.floats(-0.6, 0.6), lp_old)
    adv = b.floats(-2.0, 2.0)
    out: list[Pair] = []
    for dual in (None, 3.0):
        for agg in LossAgg:
            res = policy_mod.clipped_policy_loss(
                lp.to(dev), lp_old.to(dev), adv.to(dev), b.mask.to(dev), clip_low=0.2, dual_clip=dual, agg=agg
            )
            nv = policy_mod.clipped_policy_loss_naive(lp, lp_old, adv, b.mask, dual_clip=dual, agg=agg)
            tag = f"{agg.value}{',dual' if dual else ''}"
            out.append((f"loss({tag})", res.loss, _t(nv.loss, res.loss), None))
            if agg is LossAgg.TOKEN_MEAN:
                out += [
                    (f"per_token({tag})", res.per_token, _t(nv.per_token, res.per_token), None),
                    (f"ratio({tag})", res.ratio, _t(nv.ratio, res.ratio), None),
                    (f"clipfrac({tag})", res.clipfrac, _t(nv.clipfrac, res.clipfrac), None),
                    (f"clipfrac_lower({tag})", res.clipfrac_lower, _t(nv.clipfrac_lower, res.loss), None),
                    (f"approx_kl({tag})", res.approx_kl, _t(nv.approx_kl, res.loss), None),
                    (f"approx_kl_k2({tag})", res.approx_kl_k2, _t(nv.approx_kl_k2, res.loss), None),
                ]
    return out


def _case_value(b: Batch, dev: torch.device) -> list[Pair]:
    v_old = b.floats(-2.0, 2.0)
    v = torch.where(b.mask, v_old + b.floats(-0.5, 0.5), v_old)
    ret = b.floats(-2.0, 2.0)
    out: list[Pair] = []
    for kind in ValueLoss:
        for agg in (LossAgg.TOKEN_MEAN, LossAgg.SEQ_MEAN_TOKEN_MEAN):
            res = value_mod.value_loss(
                v.to(dev), v_old.to(dev), ret.to(dev), b.mask.to(dev), kind=kind, agg=agg
            )
            nv = value_mod.value_loss_naive(v, v_old, ret, b.mask, kind=kind, agg=agg)
            tag = f"{kind.value},{agg.value}"
            out += [
                (f"loss({tag})", res.loss, _t(nv.loss, res.loss), None),
                (f"per_token({tag})", res.per_token, _t(nv.per_token, res.per_token), None),
                (f"clipfrac({tag})", res.clipfrac, _t(nv.clipfrac, res.clipfrac), None),
            ]
    return out


def _case_aggregate(b: Batch, dev: torch.device) -> list[Pair]:
    x = b.floats(-3.0, 3.0)
    out: list[Pair] = []
    norms = {"token_count": 97.0, "seq_count": 13.0, "horizon": 40.0}
    for agg in LossAgg:
        xd, md = x.to(dev), b.mask.to(dev)
        out.append(
            (
                agg.value,
                aggregate_mod.aggregate_loss(xd, md, agg),
                aggregate_mod.aggregate_loss_naive(x, b.mask, agg),
                None,
            )
        )
        out.append(
            (
                f"{agg.value}(global counts)",
                aggregate_mod.aggregate_loss(xd, md, agg, **norms),
                aggregate_mod.aggregate_loss_naive(x, b.mask, agg, **norms),
                None,
            )
        )
    return out


def _case_entropy_bonus(b: Batch, dev: torch.device) -> list[Pair]:
    ent = b.floats(0.0, 3.0)
    return [
        (
            agg.value,
            objective_mod.entropy_bonus(ent.to(dev), b.mask.to(dev), agg),
            objective_mod.entropy_bonus_naive(ent, b.mask, agg),
            None,
        )
        for agg in LossAgg
    ]


def _case_kl_loss(b: Batch, dev: torch.device) -> list[Pair]:
    lp, lr = b.floats(-5.0, -0.1), b.floats(-5.0, -0.1)
    agg = LossAgg.SEQ_MEAN_TOKEN_MEAN
    return [
        (
            est.value,
            objective_mod.kl_loss(lp.to(dev), lr.to(dev), b.mask.to(dev), est, agg),
            objective_mod.kl_loss_naive(lp, lr, b.mask, est, agg),
            None,
        )
        for est in KLEstimator
    ]


def _case_total_loss(b: Batch, dev: torch.device) -> list[Pair]:
    terms = [float(t) for t in torch.rand(5, generator=b.gen, dtype=torch.float64)]
    coefs = {"vf_coef": 0.1, "ent_coef": 0.01, "kl_coef": 0.05, "ptx_coef": 0.5}
    vec = objective_mod.total_loss(*(torch.tensor(t, dtype=b.dtype, device=dev) for t in terms), **coefs)
    return [("total", vec, _t(objective_mod.total_loss_naive(*terms, **coefs), vec), None)]


def _case_gspo(b: Batch, dev: torch.device) -> list[Pair]:
    lp_old = b.floats(-4.0, -0.1)
    lp = torch.where(b.mask, lp_old + b.floats(-0.6, 0.6), lp_old)
    adv = b.floats(-2.0, 2.0)
    out: list[Pair] = []
    for agg in LossAgg:
        args = (lp.to(dev), lp_old.to(dev), adv.to(dev), b.mask.to(dev))
        res = gspo_mod.gspo_policy_loss(*args, clip_high=0.28, agg=agg, log_ratio_max=10.0)
        nv = gspo_mod.gspo_policy_loss_naive(
            lp, lp_old, adv, b.mask, clip_high=0.28, agg=agg, log_ratio_max=10.0
        )
        out.append((f"loss({agg.value})", res.loss, _t(nv.loss, res.loss), None))
    out.append(("ratio", res.ratio, _t(nv.ratio, res.ratio), None))
    out.append(("per_token", res.per_token, _t(nv.per_token, res.per_token), None))
    return out


def _autograd(loss_fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    leaf = x.detach().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(loss_fn(leaf), leaf)
    return grad


def _case_gradients(b: Batch, dev: torch.device) -> list[Pair]:
    """Autograd through the losses vs the closed-form twins of refppo/core/grad.py (``token-sum``:
    the weight is 1, so the gradients are O(1) and the tolerance means what it says)."""
    lp_old, adv, ref = b.floats(-4.0, -0.1), b.floats(-2.0, 2.0), b.floats(-4.0, -0.1)
    lp = torch.where(b.mask, lp_old + b.floats(-0.6, 0.6), lp_old)
    v_old, ret = b.floats(-2.0, 2.0), b.floats(-2.0, 2.0)
    v = torch.where(b.mask, v_old + b.floats(-0.5, 0.5), v_old)
    m, md, agg = b.mask, b.mask.to(dev), LossAgg.TOKEN_SUM
    pol = {"clip_high": 0.28, "dual_clip": 3.0, "agg": agg, "log_ratio_clamp": 0.5}
    kl = {"log_ratio_clamp": (-1.0, 1.0), "value_clamp": 0.5}
    grads = {
        "policy": (
            _autograd(
                lambda x: policy_mod.clipped_policy_loss(x, lp_old.to(dev), adv.to(dev), md, **pol).loss,
                lp.to(dev),
            ),
            grad_mod.policy_grad_naive(lp, lp_old, adv, m, **pol),
        ),
        "gspo": (
            _autograd(
                lambda x: gspo_mod.gspo_policy_loss(x, lp_old.to(dev), adv.to(dev), md, agg=agg).loss,
                lp.to(dev),
            ),
            gspo_mod.gspo_policy_grad_naive(lp, lp_old, adv, m, agg=agg),
        ),
        "value": (
            _autograd(
                lambda x: value_mod.value_loss(x, v_old.to(dev), ret.to(dev), md, agg=agg).loss, v.to(dev)
            ),
            grad_mod.value_grad_naive(v, v_old, ret, m, agg=agg),
        ),
        "kl_k3": (
            _autograd(lambda x: objective_mod.kl_loss(x, ref.to(dev), md, "k3", agg, **kl), lp.to(dev)),
            grad_mod.kl_loss_grad_naive(lp, ref, m, "k3", agg, **kl),
        ),
    }
    return [(name, auto, twin, None) for name, (auto, twin) in grads.items()]


CASES: dict[str, Case] = {
    "masked_sum": _case_masked_sum,
    "masked_mean": _case_masked_mean,
    "masked_var": _case_masked_var,
    "masked_whiten": _case_masked_whiten,
    "logprobs_from_logits": _case_logprobs,
    "entropy_from_logits": _case_entropy,
    "token_kl": _case_kl,
    "token_rewards": _case_rewards,
    "gae": _case_gae,
    "clipped_policy_loss": _case_policy,
    "value_loss": _case_value,
    "aggregate_loss": _case_aggregate,
    "entropy_bonus": _case_entropy_bonus,
    "kl_loss": _case_kl_loss,
    "total_loss": _case_total_loss,
    "gspo_policy_loss": _case_gspo,
    "loss_gradients": _case_gradients,
}
"""Step (vectorized function) -> case. Together they call every vectorized function of the core."""


@dataclass(frozen=True)
class Row:
    """One table row: the worst comparison of a step over all its outputs and seeds."""

    step: str
    device: str
    dtype: str
    max_abs: float
    max_rel: float
    tolerance: str
    ok: bool
    worst: str


def run_step(name: str, device: torch.device, dtype: torch.dtype, seeds: Sequence[int]) -> Row:
    """Run one step's case on every seed; a raised exception counts as a failure."""
    tol = tolerance_for(dtype)
    max_abs = max_rel = 0.0
    ok, worst = True, ""
    for seed in seeds:
        batch = make_batch(seed, dtype)
        try:
            pairs = CASES[name](batch, device)
        except Exception as exc:  # a crash of either implementation is a FAIL row, not a traceback
            return Row(
                name, device.type, _dtype_name(dtype), math.inf, math.inf, _tol_str(tol), False, repr(exc)
            )
        for output, actual, expected, mask in pairs:
            c = compare(actual, expected, dtype, mask)
            if not c.ok and ok:
                worst = f"{output} (seed {seed})"
            ok = ok and c.ok
            max_abs, max_rel = max(max_abs, c.max_abs), max(max_rel, c.max_rel)
    return Row(name, device.type, _dtype_name(dtype), max_abs, max_rel, _tol_str(tol), ok, worst)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tol_str(tol: Tolerance) -> str:
    return f"atol={tol.atol:g}·S rtol={tol.rtol:g}"


def format_table(rows: Sequence[Row]) -> str:
    """The table ``refppo verify`` prints."""
    header = ("step", "device", "dtype", "max abs err", "max rel err", "tolerance", "result")
    body = [
        (
            r.step,
            r.device,
            r.dtype,
            f"{r.max_abs:.3e}",
            f"{r.max_rel:.3e}",
            r.tolerance,
            "PASS" if r.ok else f"FAIL {r.worst}".rstrip(),
        )
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body, strict=True)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in body]
    return "\n".join(lines)


def devices() -> list[torch.device]:
    """CPU, and CUDA when available."""
    out = [torch.device("cpu")]
    if torch.cuda.is_available():
        out.append(torch.device("cuda"))
    return out


def device_problem(name: str) -> str | None:
    """``None`` if ``name`` is a device this process can run on, else one line saying why not."""
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        return f"--device {name!r}: not a device name ({e})"
    if dev.type == "cpu":
        return None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            return f"--device {name!r}: CUDA is not available (torch {torch.__version__}, {build})"
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            return f"--device {name!r}: only {torch.cuda.device_count()} CUDA device(s) visible"
        return None
    if dev.type == "mps" and torch.backends.mps.is_available():
        return None
    return f"--device {name!r}: device type {dev.type!r} is not available here"


def main(argv: list[str]) -> int:
    """Entry point of ``refppo verify``; returns 0 iff every row passes, 2 for an unusable ``--device``."""
    parser = argparse.ArgumentParser(
        prog="refppo verify",
        description="Check every vectorized core step against its naive twin on seeded ragged batches.",
    )
    parser.add_argument("--seeds", type=int, default=20, help="seeded batches per step (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument(
        "--device", action="append", default=None, help="device to run on (repeatable; default cpu and cuda)"
    )
    args = parser.parse_args(argv)
    for name in args.device or ():
        problem = device_problem(name)
        if problem is not None:
            print(f"refppo verify: {problem}", file=sys.stderr)
            return 2
    devs = [torch.device(d) for d in args.device] if args.device else devices()
    seeds = list(range(args.seed, args.seed + args.seeds))
    start = time.perf_counter()
    rows = [
        run_step(name, dev, dtype, seeds)
        for name in CASES
        for dev in devs
        for dtype in (torch.float64, torch.float32)
    ]
    print(format_table(rows))
    n_fail = sum(not r.ok for r in rows)
    elapsed = time.perf_counter() - start
    print(f"\n{len(rows) - n_fail}/{len(rows)} passed on {len(seeds)} seeds in {elapsed:.1f} s")
    return 1 if n_fail else 0


__all__ = ["CASES", "TOLERANCES", "Comparison", "Row", "Tolerance", "compare", "main", "tolerance_for"]
