"""Properties of the corrected surrogates (refppo/core/rollout_losses.py, refppo/core/cispo.py).

- ``corrected_policy_loss``, ``decoupled_policy_loss``, ``cispo_policy_loss`` and
  ``weighted_logprob_loss`` equal their naive twins (float64 to 1e-12, float32 within the twin
  tolerance), rejected tokens zeroed or dropped, under every ``loss_agg``;
- with ``l^beh = l^prox`` (every weight exactly 1) the corrected and the decoupled losses ARE the plain
  clipped surrogate of refppo.core.policy, bit for bit, values, statistics and gradients;
- the autograd gradient of the corrected loss (rejected zero) is ``w'`` times the clipped surrogate's
  closed-form gradient (refppo/core/grad.py), the weight detached;
- rejected ``drop`` is the plain clipped surrogate over the kept rows with the kept mask (token and
  sequence counts of what is kept), loss and gradient; 0 with a zero gradient when nothing is kept;
- CISPO's and the weighted REINFORCE's gradients are ``−c·A·w_agg`` on every valid token, clipped or
  not; junk on the padding changes nothing;
- ``clip_low = 1`` is no lower bound: CISPO's ``clip_low=None`` bit for bit, the clipped surrogate's
  ``max(−A·ρ, −A·min(ρ, 1 + ε_high))``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import Ragged, assert_exactly_equal, assert_grad_close, assert_twin_close, ragged_batches

from refppo.agg_conventions import MASK_AGGS
from refppo.conventions import LossAgg
from refppo.core.aggregate import agg_weights_naive
from refppo.core.cispo import (
    cispo_policy_loss,
    cispo_policy_loss_naive,
    weighted_logprob_loss,
    weighted_logprob_loss_naive,
)
from refppo.core.grad import policy_grad_naive
from refppo.core.policy import clipped_policy_loss
from refppo.core.rollout_correction import is_weights, rejection_mask
from refppo.core.rollout_losses import (
    BehaviourWeight,
    Norms,
    PolicyClip,
    corrected_policy_loss,
    corrected_policy_loss_naive,
    decoupled_policy_loss,
    decoupled_policy_loss_naive,
)
from refppo.rollout_conventions import ISLevel, ISMode, Rejected

pytestmark = pytest.mark.property

F64 = torch.float64
aggs = st.sampled_from(list(MASK_AGGS))
clips = st.sampled_from([PolicyClip(), PolicyClip(0.2, 0.28, 3.0, None), PolicyClip(0.1, 0.3, None, 0.5)])
rejecteds = st.sampled_from(list(Rejected))


def _inputs(b: Ragged) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(l, l^prox, l^beh, A)``, junk on the padding: every clip region and weights on both sides."""
    beh = b.valid(-5.0, -0.1)
    prox = beh + b.normal(b.B, 1, scale=0.3) + b.valid(-0.6, 0.6)
    cur = prox + b.valid(-0.8, 0.8)
    return b.with_junk(cur), b.with_junk(prox), b.with_junk(beh), b.floats(-2.0, 2.0)


def _weights(
    b: Ragged, prox: torch.Tensor, beh: torch.Tensor, kind: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w', keep)``: a token mask (IcePop), a sequence truncation, or raw weights under a veto gate."""
    if kind == 0:
        w = is_weights(prox, beh, b.mask, mode=ISMode.MASK, low=0.7, high=1.4)
        return w.weight, w.keep
    if kind == 1:
        w = is_weights(prox, beh, b.mask, level=ISLevel.SEQUENCE, high=2.0)
        return w.weight, w.keep
    keep = rejection_mask(prox, beh, b.mask, level="sequence", reduce="max", order="behaviour", high=1.6)
    return is_weights(prox, beh, b.mask).raw, keep


def _norms(b: Ragged, agg: LossAgg, global_norm: bool) -> Norms:
    if global_norm:
        return Norms(agg, token_count=b.n_valid + 5.0, seq_count=b.B + 1.0, horizon=b.T + 3.0)
    return Norms(agg)


@given(ragged_batches(), aggs, clips, rejecteds, st.integers(0, 2), st.booleans())
def test_corrected_policy_loss_matches_naive(
    b: Ragged, agg: LossAgg, clip: PolicyClip, rejected: Rejected, kind: int, global_norm: bool
) -> None:
    cur, prox, beh, adv = _inputs(b)
    w, keep = _weights(b, prox, beh, kind)
    kw = {"keep": keep, "rejected": rejected, "clip": clip, "norms": _norms(b, agg, global_norm)}
    got = corrected_policy_loss(cur, prox, adv, b.mask, w, **kw)  # type: ignore[arg-type]  # kwargs dict
    want = corrected_policy_loss_naive(cur, prox, adv, b.mask, w, **kw)  # type: ignore[arg-type]  # same
    tol = {"rtol": 1e-12, "atol": 1e-12} if b.dtype == F64 else None
    for name in ("loss", "per_token", "clipfrac", "clipfrac_lower", "approx_kl", "approx_kl_k2"):
        a, e = getattr(got, name), torch.as_tensor(getattr(want, name), dtype=F64)
        if tol is None:
            assert_twin_close(a, e, b.dtype, name)
        else:
            torch.testing.assert_close(a.to(F64), e, **tol, msg=name)


@given(ragged_batches(), aggs, clips, st.booleans())
def test_unit_weights_give_the_plain_clipped_surrogate_bit_for_bit(
    b: Ragged, agg: LossAgg, clip: PolicyClip, decoupled: bool
) -> None:
    cur, prox, _, adv = _inputs(b)
    norms = Norms(agg)
    x, y = cur.clone().requires_grad_(True), cur.clone().requires_grad_(True)
    if decoupled:  # l^beh = l^prox: the behaviour weight is exp(0) = 1 on every token, kept
        got = decoupled_policy_loss(x, prox, prox, adv, b.mask, clip=clip, norms=norms).policy
    else:
        got = corrected_policy_loss(x, prox, adv, b.mask, torch.ones_like(prox), clip=clip, norms=norms)
    c = clip
    want = clipped_policy_loss(
        y, prox, adv, b.mask, clip_low=c.clip_low, clip_high=c.clip_high, dual_clip=c.dual_clip, agg=agg,
        log_ratio_clamp=c.log_ratio_clamp,
    )  # fmt: skip
    for name in ("loss", "per_token", "ratio", "clipfrac", "clipfrac_lower", "approx_kl", "approx_kl_k2"):
        assert_exactly_equal(getattr(got, name), getattr(want, name), what=name)
    got.loss.backward()
    want.loss.backward()
    assert x.grad is not None and y.grad is not None
    assert_exactly_equal(x.grad, y.grad, what="grad")


@given(ragged_batches(), aggs, clips, st.integers(0, 2))
def test_corrected_gradient_is_the_weight_times_the_clip_gradient(
    b: Ragged, agg: LossAgg, clip: PolicyClip, kind: int
) -> None:
    cur, prox, beh, adv = _inputs(b)
    w, keep = _weights(b, prox, beh, kind)
    x = cur.clone().requires_grad_(True)
    corrected_policy_loss(x, prox, adv, b.mask, w, keep=keep, clip=clip, norms=Norms(agg)).loss.backward()
    c = clip
    g = policy_grad_naive(
        cur, prox, adv, b.mask, clip_low=c.clip_low, clip_high=c.clip_high, dual_clip=c.dual_clip, agg=agg,
        log_ratio_clamp=c.log_ratio_clamp,
    )  # fmt: skip
    want = torch.where(keep & b.mask, w.to(F64) * g, 0.0)
    assert_grad_close(x.grad, want, b.mask, b.dtype, f"∂corrected/∂l ({agg}, kind {kind})")


@given(ragged_batches(dtypes=(F64,)), aggs, clips)
def test_drop_is_the_clipped_surrogate_over_the_kept_rows(b: Ragged, agg: LossAgg, clip: PolicyClip) -> None:
    cur, prox, beh, adv = _inputs(b)
    keep = rejection_mask(prox, beh, b.mask, level="sequence", reduce="max", order="behaviour", high=1.6)
    keep = keep | (
        rejection_mask(prox, beh, b.mask, low=0.8, high=1.25) & (torch.arange(b.B) % 2 == 0).unsqueeze(1)
    )
    x = cur.clone().requires_grad_(True)
    ones = torch.ones_like(prox)
    got = corrected_policy_loss(
        x, prox, adv, b.mask, ones, keep=keep, rejected="drop", clip=clip, norms=Norms(agg)
    )
    got.loss.backward()
    assert x.grad is not None
    rows = keep.any(1)
    if not bool(rows.any()):
        assert float(got.loss.detach()) == 0.0 and bool((x.grad == 0).all())
        return
    y = cur[rows].clone().requires_grad_(True)
    c = clip
    want = clipped_policy_loss(
        y, prox[rows], adv[rows], keep[rows], clip_low=c.clip_low, clip_high=c.clip_high,
        dual_clip=c.dual_clip, agg=agg, log_ratio_clamp=c.log_ratio_clamp,
    )  # fmt: skip
    want.loss.backward()
    assert y.grad is not None
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(x.grad[rows], y.grad, rtol=1e-12, atol=1e-14)
    assert bool((x.grad[~rows] == 0).all()), "a rejected row gets no gradient"
    torch.testing.assert_close(got.clipfrac, want.clipfrac, rtol=1e-12, atol=1e-14)


BEHAVIOUR = [
    BehaviourWeight(),
    BehaviourWeight(mode="truncate", low=0.8, high=1.25),
    BehaviourWeight(level="sequence", mode="mask", low=0.8, high=1.25),
    BehaviourWeight(high=None),
]


@given(ragged_batches(), aggs, st.sampled_from(BEHAVIOUR))
def test_decoupled_policy_loss_matches_naive(b: Ragged, agg: LossAgg, bw: BehaviourWeight) -> None:
    cur, prox, beh, adv = _inputs(b)
    clip = PolicyClip(0.2, 0.28, 3.0)
    got = decoupled_policy_loss(cur, prox, beh, adv, b.mask, behaviour=bw, clip=clip, norms=Norms(agg))
    want, weights = decoupled_policy_loss_naive(
        cur, prox, beh, adv, b.mask, behaviour=bw, clip=clip, norms=Norms(agg)
    )
    assert_twin_close(got.policy.loss, torch.tensor(want.loss, dtype=F64), b.dtype, "loss")
    assert_twin_close(got.policy.per_token, torch.tensor(want.per_token, dtype=F64), b.dtype, "per_token")
    assert_twin_close(got.weights.weight, torch.tensor(weights, dtype=F64), b.dtype, "weight")


@given(
    ragged_batches(),
    aggs,
    st.sampled_from([(0.2, 0.28, None), (None, 4.0, None), (0.2, 0.2, 0.5), (1.0, 0.5, None)]),
    st.booleans(),
)
def test_cispo_matches_naive_and_its_gradient_is_minus_c_a(
    b: Ragged, agg: LossAgg, c: tuple[float | None, float, float | None], weighted: bool
) -> None:
    cur, prox, beh, adv = _inputs(b)
    w = is_weights(prox, beh, b.mask, high=2.0).weight if weighted else None
    kw = {"clip_low": c[0], "clip_high": c[1], "log_ratio_clamp": c[2], "weight": w, "norms": Norms(agg)}
    x = cur.clone().requires_grad_(True)
    got = cispo_policy_loss(x, prox, adv, b.mask, **kw)  # type: ignore[arg-type]  # kwargs dict
    want = cispo_policy_loss_naive(cur, prox, adv, b.mask, **kw)  # type: ignore[arg-type]  # same
    for name in ("loss", "per_token", "ratio", "clipfrac", "approx_kl", "approx_kl_k2"):
        assert_twin_close(getattr(got, name), torch.as_tensor(getattr(want, name), dtype=F64), b.dtype, name)
    got.loss.backward()
    rho = torch.exp(torch.where(b.mask, cur - prox, 0.0).to(F64))
    if c[2] is not None:
        rho = torch.exp(torch.where(b.mask, cur - prox, 0.0).to(F64).clamp(-c[2], c[2]))
    coef = rho.clamp(min=1 - c[0] if c[0] is not None else None, max=1 + c[1])
    coef = coef * (w.to(F64) if w is not None else 1.0)
    aw = torch.tensor(agg_weights_naive(b.mask, agg), dtype=F64)
    want_grad = torch.where(b.mask, -coef * adv.to(F64) * aw, 0.0)
    assert_grad_close(x.grad, want_grad, b.mask, b.dtype, f"∂cispo/∂l ({agg})")


@given(ragged_batches(), aggs, st.sampled_from([0.28, 4.0]))
def test_a_lower_clip_of_one_is_no_lower_bound(b: Ragged, agg: LossAgg, hi: float) -> None:
    """``clip_low = 1`` (TRL 1.16.0 ``loss_type="cispo"``: ``min(ρ, ε_max)``) IS ``clip_low=None``:
    CISPO bit for bit; the clipped surrogate then clips no token below (``clipfrac_lower`` 0) and
    equals its naive twin."""
    cur, prox, _, adv = _inputs(b)
    one = cispo_policy_loss(cur, prox, adv, b.mask, clip_low=1.0, clip_high=hi, norms=Norms(agg))
    none = cispo_policy_loss(cur, prox, adv, b.mask, clip_low=None, clip_high=hi, norms=Norms(agg))
    for name in ("loss", "per_token", "ratio", "clipfrac"):
        assert_exactly_equal(getattr(one, name), getattr(none, name), what=name)
    van = clipped_policy_loss(cur, prox, adv, b.mask, clip_low=1.0, clip_high=hi, agg=agg)
    assert float(van.clipfrac_lower) == 0.0
    rho = torch.exp(torch.where(b.mask, cur - prox, 0.0).to(F64))
    a = adv.to(F64)
    want = torch.where(b.mask, torch.maximum(-a * rho, -a * rho.clamp(max=1 + hi)), 0.0)
    assert_twin_close(van.per_token, want, b.dtype, "vanilla ℓ at clip_low=1")


@given(ragged_batches(), aggs, st.booleans())
def test_weighted_logprob_loss_matches_naive_and_its_gradient_is_minus_w_a(
    b: Ragged, agg: LossAgg, global_norm: bool
) -> None:
    cur, _, beh, adv = _inputs(b)
    w = is_weights(cur, beh, b.mask, high=2.0).weight  # verl bypass: π_θ/π^beh truncated, detached
    norms = _norms(b, agg, global_norm)
    x = cur.clone().requires_grad_(True)
    loss, per_token = weighted_logprob_loss(x, w, adv, b.mask, norms=norms)
    want_loss, want_per_token = weighted_logprob_loss_naive(cur, w, adv, b.mask, norms=norms)
    assert_twin_close(loss, torch.tensor(want_loss, dtype=F64), b.dtype, "loss")
    assert_twin_close(per_token, torch.tensor(want_per_token, dtype=F64), b.dtype, "per_token")
    loss.backward()
    n = norms
    aw = torch.tensor(
        agg_weights_naive(b.mask, agg, token_count=n.token_count, seq_count=n.seq_count, horizon=n.horizon),
        dtype=F64,
    )
    assert_grad_close(
        x.grad, torch.where(b.mask, -w.to(F64) * adv.to(F64) * aw, 0.0), b.mask, b.dtype, "∂/∂l"
    )


@given(ragged_batches(), aggs, rejecteds, st.sampled_from(["nan", "inf", "-inf", "huge", "mixed"]))
def test_corrected_and_cispo_padding_invariant(
    b: Ragged, agg: LossAgg, rejected: Rejected, junk: str
) -> None:
    beh = b.valid(-5.0, -0.1)
    prox = beh + b.valid(-0.6, 0.6)
    cur, adv = prox + b.valid(-0.8, 0.8), b.valid(-2.0, 2.0)
    outs, grads = [], []
    for kind in (None, junk):
        x = b.with_junk(cur, kind).requires_grad_(True)
        p, a = b.with_junk(prox, kind), b.with_junk(adv, kind)
        w = is_weights(p, b.with_junk(beh, kind), b.mask, mode="mask", low=0.8, high=1.25)
        res = corrected_policy_loss(
            x, p, a, b.mask, w.weight, keep=w.keep, rejected=rejected, norms=Norms(agg)
        )
        cis = cispo_policy_loss(x, p, a, b.mask, weight=w.weight, norms=Norms(agg))
        (res.loss + cis.loss).backward()
        assert x.grad is not None
        outs.append((res.loss, res.per_token, res.clipfrac, cis.loss, cis.per_token))
        grads.append(x.grad)
    for first, second in zip(outs[0], outs[1], strict=True):
        assert_exactly_equal(first, second, what="output")
    assert_exactly_equal(grads[0], grads[1], what="grad")
    assert bool((grads[0][~b.mask] == 0).all()), "no gradient reaches padded log-probs"
