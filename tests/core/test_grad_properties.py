"""The closed-form gradients of refppo/core/grad.py equal torch autograd through the core.

For random ragged batches (float32 and float64, junk on the padding), every ``loss_agg`` mode,
local and global normalisers, every clip region, and ties forced *exactly* at the boundaries where
autograd must pick a subgradient (refppo/core/grad.py, "Ties"): values built on a dyadic grid so that
``d = l − l^old`` is exactly 0 (ρ = 1 on an ε = 0 side of the clip), exactly ±κ (log-ratio clamp),
``V − V^old = ±ε_v`` exactly (value clip boundary), ``R`` exactly midway between ``V`` and the bound
(a tie of the two squared errors), and, in float64, ``ρ = c = 2`` (dual-clip, ``d = ln 2``).

Comparison (:func:`strategies.assert_grad_close`): padded positions exactly 0 on both sides; elsewhere
:func:`strategies.assert_twin_close` after dividing both by ``max|twin|`` (gradients are ``O(1/N)``,
so the project tolerance is applied relative to the largest entry); at the forced ties, per token,
``|autograd − twin| ≤ rtol·|twin|`` — a half where the twin says whole (or the reverse) fails there.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import Ragged, assert_grad_close, ragged_batches
from torch import Tensor

from refppo.agg_conventions import MASK_AGGS
from refppo.conventions import KLEstimator, KLPlacement, LossAgg, ScorePosition, ValueClipForm, ValueLoss
from refppo.core.grad import kl_loss_grad_naive, policy_grad_naive, value_grad_naive
from refppo.core.kl import LogRatioClamp
from refppo.core.objective import kl_loss
from refppo.core.policy import clipped_policy_loss
from refppo.core.value import value_loss
from refppo.pipeline.blocks import Normalisers
from refppo.pipeline.grad_naive import objective_grads_naive
from refppo.pipeline.rollout import value_mask
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import update_quantities

pytestmark = pytest.mark.property

aggs = st.sampled_from(list(MASK_AGGS))
clip_ranges = st.sampled_from([(0.2, None), (0.1, 0.3), (0.28, 0.2), (0.0, None), (0.2, 0.0), (0.0, 0.3)])
duals = st.sampled_from([None, 3.0, 1.5, 2.0])
kappas = st.sampled_from([None, 0.5, 0.25, 20.0])
global_norms = st.one_of(st.none(), st.tuples(st.integers(0, 50), st.integers(0, 5), st.integers(0, 9)))


def _norm_kwargs(b: Ragged, extra: tuple[int, int, int] | None) -> dict[str, float]:
    """Global normalisers of a step that holds this batch and more (``extra`` tokens, rows, slots)."""
    if extra is None:
        return {}
    return {"token_count": b.n_valid + extra[0], "seq_count": b.B + extra[1], "horizon": b.T + extra[2]}


def _dyadic(b: Ragged, low: float, high: float) -> torch.Tensor:
    """Values on the grid k/16 in [low, high]: sums with other dyadic values are exact in float32."""
    return (torch.floor(b.valid(low, high).to(torch.float64) * 16) / 16).to(b.dtype)


def _pick(b: Ragged, p: float) -> torch.Tensor:
    """A random subset of the valid tokens (each with probability ``p``)."""
    return (torch.rand((b.B, b.T), generator=b.gen) < p) & b.mask


def _policy_inputs(
    b: Ragged, kappa: float | None, dual: float | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(lp, lp_old, adv, ties)``: d ∈ [−1, 1] with exact ties at d = 0, ±κ and (float64) ln 2."""
    lp_old = _dyadic(b, -5.0, 0.0)
    d = b.valid(-1.0, 1.0)
    at_one = _pick(b, 0.2)
    d = torch.where(at_one, torch.zeros_like(d), d)
    ties = at_one
    if kappa is not None:
        at_kappa, sign = _pick(b, 0.2) & ~ties, _pick(b, 0.5)
        d = torch.where(at_kappa, torch.where(sign, kappa, -kappa), d).to(b.dtype)
        beyond = _pick(b, 0.1) & ~ties & ~at_kappa  # strictly outside: the clamp blocks
        d = torch.where(beyond, torch.where(sign, kappa + 0.5, -kappa - 0.5), d).to(b.dtype)
        ties = ties | at_kappa
    adv = b.valid(-2.0, 2.0)
    adv = torch.where(_pick(b, 0.1), torch.zeros_like(adv), adv)
    if dual == 2.0 and b.dtype == torch.float64 and kappa is None:
        at_c = _pick(b, 0.2) & ~ties  # ρ = exp(ln 2) = 2 = c exactly (both exps round it to 2.0)
        lp_old = torch.where(at_c, 0.0, lp_old)
        d = torch.where(at_c, math.log(2.0), d)
        adv = torch.where(at_c, -adv.abs() - 0.25, adv)
        ties = ties | at_c
    lp = b.with_junk(lp_old + d)
    return lp, b.with_junk(lp_old), b.with_junk(adv), ties


@given(ragged_batches(), clip_ranges, duals, aggs, kappas, global_norms)
def test_policy_grad_matches_autograd(
    b: Ragged,
    clip: tuple[float, float | None],
    dual: float | None,
    agg: LossAgg,
    kappa: float | None,
    extra: tuple[int, int, int] | None,
) -> None:
    lp, lp_old, adv, ties = _policy_inputs(b, kappa, dual)
    kw = {"clip_low": clip[0], "clip_high": clip[1], "dual_clip": dual, "agg": agg, "log_ratio_clamp": kappa}
    kw |= _norm_kwargs(b, extra)
    x = lp.clone().requires_grad_(True)
    clipped_policy_loss(x, lp_old, adv, b.mask, **kw).loss.backward()  # type: ignore[arg-type]  # kwargs dict
    twin = policy_grad_naive(lp, lp_old, adv, b.mask, **kw)  # type: ignore[arg-type]  # same
    what = f"∂pg/∂logp ({agg}, clip {clip}, dual {dual}, κ {kappa})"
    assert_grad_close(x.grad, twin, b.mask, b.dtype, what, ties)


def _value_inputs(b: Ragged, eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(v, v_old, ret, ties)`` with exact ties at ``V = V^old ± ε`` and ``R`` midway (dyadic ε)."""
    v_old = _dyadic(b, -2.0, 2.0)
    v = v_old + b.valid(-1.0, 1.0)
    ret = b.valid(-2.0, 2.0)
    sign = torch.where(_pick(b, 0.5), 1.0, -1.0).to(b.dtype)
    at_bound, at_mid = _pick(b, 0.2), _pick(b, 0.2)
    at_mid = at_mid & ~at_bound
    v = torch.where(at_bound, v_old + sign * eps, v)
    v = torch.where(at_mid, v_old + sign * 3 * eps, v)  # outside; bound V^old ± ε; R midway
    ret = torch.where(at_mid, v_old + sign * 2 * eps, ret)
    return b.with_junk(v), b.with_junk(v_old), b.with_junk(ret), at_bound | at_mid


@given(
    ragged_batches(),
    st.sampled_from(list(ValueLoss)),
    st.sampled_from(list(ValueClipForm)),
    st.sampled_from([0.25, 0.5, 0.125]),
    aggs,
    global_norms,
)
def test_value_grad_matches_autograd(
    b: Ragged,
    kind: ValueLoss,
    form: ValueClipForm,
    eps: float,
    agg: LossAgg,
    extra: tuple[int, int, int] | None,
) -> None:
    v, v_old, ret, ties = _value_inputs(b, eps)
    kw = {"clip": eps, "kind": kind, "agg": agg, "clip_form": form} | _norm_kwargs(b, extra)
    x = v.clone().requires_grad_(True)
    value_loss(x, v_old, ret, b.mask, **kw).loss.backward()  # type: ignore[arg-type]  # kwargs dict
    twin = value_grad_naive(v, v_old, ret, b.mask, **kw)  # type: ignore[arg-type]  # same
    assert_grad_close(x.grad, twin, b.mask, b.dtype, f"∂vf/∂V ({kind}, {form}, {agg})", ties)


@given(
    ragged_batches(),
    st.sampled_from(list(KLEstimator)),
    st.sampled_from([None, (-1.0, 1.5), (None, 1.5), (-2.0, None), (0.25, 5.0)]),
    st.sampled_from([None, 0.5, 1.0]),
    aggs,
    global_norms,
)
def test_kl_loss_grad_matches_autograd(
    b: Ragged,
    est: KLEstimator,
    clamp: LogRatioClamp | None,
    vc: float | None,
    agg: LossAgg,
    extra: tuple[int, int, int] | None,
) -> None:
    ref = _dyadic(b, -5.0, 0.0)
    d = b.valid(-2.5, 2.5)
    # exact ties: d = 0 (abs: sign 0), d on a clamp bound, |k| = c_v (k1/abs: |d| = c_v; k2: d = ±1, c_v = ½)
    at_zero, at_bound, at_value = _pick(b, 0.15), _pick(b, 0.15), _pick(b, 0.15)
    sign = torch.where(_pick(b, 0.5), 1.0, -1.0).to(b.dtype)
    lo, hi = clamp if clamp is not None else (None, None)
    bound = hi if hi is not None else lo
    if bound is not None:
        d = torch.where(at_bound, bound, d)
    if vc is not None:
        d = torch.where(at_value, sign * (1.0 if est == KLEstimator.K2 else vc), d)
    d = torch.where(at_zero, 0.0, d).to(b.dtype)
    lp = b.with_junk(ref + d)
    kw = {"log_ratio_clamp": clamp, "value_clamp": vc} | _norm_kwargs(b, extra)
    x = lp.clone().requires_grad_(True)
    kl_loss(x, b.with_junk(ref), b.mask, est, agg, **kw).backward()  # type: ignore[arg-type]  # kwargs dict
    twin = kl_loss_grad_naive(lp, b.with_junk(ref), b.mask, est, agg, **kw)  # type: ignore[arg-type]  # same
    ties = (at_bound | at_value) & ~at_zero
    if est != KLEstimator.K3:  # k3's 1 − e^{−d} cancels near d = 0: no per-token relative check there
        ties = ties | at_zero
    assert_grad_close(x.grad, twin, b.mask, b.dtype, f"∂kl/∂logp ({est}, {clamp}, {vc}, {agg})", ties)


def _convs(policy_loss: str, duals: list[float | None]) -> st.SearchStrategy[Convention]:
    return st.builds(
        lambda **flat: Convention.of(**flat),
        kl_estimator=st.sampled_from(list(KLEstimator)),
        kl_in=st.sampled_from(list(KLPlacement)),
        score_at=st.sampled_from(list(ScorePosition)),
        loss_agg=aggs,
        value_loss=st.sampled_from(list(ValueLoss)),
        dual_clip=st.sampled_from(duals),
        log_ratio_clamp=st.sampled_from([None, 0.5]),
        kl_log_ratio_clamp=st.sampled_from([None, (-1.0, 1.0)]),
        kl_value_clamp=st.sampled_from([None, 0.8]),
        value_loss_agg=st.one_of(st.none(), aggs),
        kl_loss_agg=st.one_of(st.none(), aggs),
        value_clip_form=st.sampled_from(list(ValueClipForm)),
        policy_loss=st.just(policy_loss),
    )


# GSPO has no dual-clip (a Convention with both is refused)
convs = st.one_of(_convs("vanilla", [None, 3.0]), _convs("gspo", [None]))
hps = st.builds(
    Hyperparams,
    kl_coef=st.sampled_from([0.05, 0.5]),
    cliprange=st.sampled_from([0.2, 0.0]),
    cliprange_high=st.sampled_from([None, 0.28, 0.0]),
    cliprange_value=st.sampled_from([0.25, 0.2]),
    vf_coef=st.sampled_from([0.1, 1.0]),
    horizon=st.sampled_from([None, 80.0]),
)


def _step_tensors(b: Ragged, vm: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rollout and current tensors of a step; valid on ``mask`` (policy) or ``vm`` (value)."""
    lp_old = _dyadic(b, -5.0, 0.0)
    d = torch.where(_pick(b, 0.2), 0.0, b.valid(-1.0, 1.0)).to(b.dtype)
    v_old = b.valid(-1.0, 1.0)

    def junk(x: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        return torch.where(where, x, b.with_junk(x, "nan"))

    return {
        "logprobs": b.with_junk(lp_old + d),
        "old_logprobs": b.with_junk(lp_old),
        "ref_logprobs": b.with_junk(lp_old + b.valid(-1.0, 1.0)),
        "advantages": b.with_junk(b.valid(-2.0, 2.0)),
        "entropy": b.with_junk(b.valid(0.0, 3.0)),
        "values": junk(v_old + b.valid(-0.5, 0.5), vm),
        "old_values": junk(v_old, vm),
        "returns": junk(b.valid(-2.0, 2.0), vm),
    }


@given(ragged_batches(), convs, hps, st.booleans())
def test_objective_grads_match_autograd_through_update_quantities(
    b: Ragged, conv: Convention, hp: Hyperparams, global_norm: bool
) -> None:
    vm = value_mask(b.mask, conv.reward.score_at)
    ts = _step_tensors(b, vm)
    n_v = int(vm.sum())
    norm = Normalisers(b.n_valid + 7, b.B + 2, n_v + 7) if global_norm else None
    lp = ts["logprobs"].clone().requires_grad_(True)
    v = ts["values"].clone().requires_grad_(True)
    inputs = ts | {"logprobs": lp, "values": v}
    update_quantities(**inputs, mask=b.mask, value_mask_=vm, hp=hp, conv=conv, norm=norm).loss.backward()
    twin_lp, twin_v = objective_grads_naive(**ts, mask=b.mask, value_mask_=vm, hp=hp, conv=conv, norm=norm)
    assert_grad_close(lp.grad, twin_lp, b.mask, b.dtype, f"∂J/∂logprobs ({conv}, {hp})")
    assert_grad_close(v.grad, twin_v, vm, b.dtype, f"∂J/∂values ({conv}, {hp})")


@given(ragged_batches(min_B=2), convs, hps, st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_micro_batches_with_global_normalisers_give_the_twin_of_the_whole_step(
    b: Ragged, conv: Convention, hp: Hyperparams, sizes: list[int]
) -> None:
    """Rows split into micro-batches, each loss with the step's global counts, gradients accumulated
    by autograd: equal to the twin of the whole step computed once with its own (local) counts."""
    vm = value_mask(b.mask, conv.reward.score_at)
    ts = _step_tensors(b, vm)
    lp = ts["logprobs"].clone().requires_grad_(True)
    v = ts["values"].clone().requires_grad_(True)
    norm = Normalisers(float(b.n_valid), float(b.B), float(vm.sum()))
    start, k = 0, 0
    while start < b.B:
        rows = slice(start, min(b.B, start + sizes[k % len(sizes)]))
        part = {name: t[rows] for name, t in ts.items()} | {"logprobs": lp[rows], "values": v[rows]}
        q = update_quantities(**part, mask=b.mask[rows], value_mask_=vm[rows], hp=hp, conv=conv, norm=norm)
        q.loss.backward()
        start, k = rows.stop, k + 1
    twin_lp, twin_v = objective_grads_naive(**ts, mask=b.mask, value_mask_=vm, hp=hp, conv=conv)
    assert_grad_close(lp.grad, twin_lp, b.mask, b.dtype, "∂J/∂logprobs, micro-batched")
    assert_grad_close(v.grad, twin_v, vm, b.dtype, "∂J/∂values, micro-batched")
