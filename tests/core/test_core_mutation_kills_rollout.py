"""Tests for the survivors of ``tools/mutate.py`` on the rollout-correction modules (issue #20):
``refppo/core/cispo.py``, ``rollout_losses.py`` and ``rollout_correction.py``.

Each test pins one documented behaviour that a surviving mutant changed; the expected values are
worked out by hand in the comments, never taken from the code under test.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from refppo.core.cispo import cispo_policy_loss, weighted_logprob_loss
from refppo.core.rollout_correction import is_weights, is_weights_naive, rejection_mask, rejection_mask_naive
from refppo.core.rollout_losses import BehaviourWeight, Norms, corrected_policy_loss, decoupled_policy_loss
from refppo.errors import DtypeError

F32, F64 = torch.float32, torch.float64
M = torch.tensor([[True, True, False]])


def _t(*xs: float, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.tensor([list(xs)], dtype=dtype)


def _cispo(lp: torch.Tensor, lo: torch.Tensor, adv: torch.Tensor, w: torch.Tensor | None = None) -> Any:
    return cispo_policy_loss(lp, lo, adv, M, weight=w)


def _weighted(lp: torch.Tensor, lo: torch.Tensor, adv: torch.Tensor, w: torch.Tensor | None = None) -> Any:
    return weighted_logprob_loss(lp, lo if w is None else w, adv, M)


# (function, which argument is float32 (the others float64), the names the refusal lists, in order)
_MIXED = [
    (_cispo, "lp", "logp=torch.float32, advantages=torch.float64"),
    (_cispo, "adv", "logp=torch.float64, advantages=torch.float32"),
    (_cispo, "lo", "logp=torch.float64, logp_old=torch.float32"),
    (_cispo, "w", "logp=torch.float64, weight=torch.float32"),
    (_weighted, "lp", "logp=torch.float32, advantages=torch.float64"),
    (_weighted, "adv", "logp=torch.float64, advantages=torch.float32"),
    (_weighted, "w", "logp=torch.float64, weight=torch.float32"),
]


@pytest.mark.parametrize(("fn", "odd", "listing"), _MIXED)
def test_cispo_losses_refuse_mixed_float_dtypes(fn: Callable[..., Any], odd: str, listing: str) -> None:
    """Every float input of CISPO and the weighted REINFORCE shares ``logp``'s dtype (no silent
    up-casting: ``check_same_dtype``); one float32 among float64 inputs is refused, the refusal naming
    both. Survivors: either name dropped from each ``check_same_dtype`` call (then the product is
    promoted silently and nothing is raised)."""
    args = {"lp": _t(-1.0, -2.0, 0.0), "lo": _t(-1.1, -1.9, 0.0), "adv": _t(1.0, -1.0, 0.0)}
    args["w"] = _t(1.0, 0.5, 0.0)
    args[odd] = args[odd].to(F32)
    with pytest.raises(DtypeError, match=listing.replace(".", r"\.")):
        fn(args["lp"], args["lo"], args["adv"], args["w"])
    if fn is _weighted and odd == "lp":  # the weight check alone: logp float64, weight float32
        with pytest.raises(DtypeError, match=r"logp=torch\.float64, weight=torch\.float32"):
            weighted_logprob_loss(_t(-1.0, -2.0, 0.0), _t(1.0, 0.5, 0.0, dtype=F32), _t(1.0, -1.0, 0.0), M)


def test_weighted_logprob_loss_treats_the_advantages_as_constants() -> None:
    """``ℓ_t = −w_t·A_t·l_t`` with ``A`` detached: token-mean over 2 valid tokens, ``∂loss/∂l_t =
    −w_t·A_t/2`` and no gradient reaches ``A`` even when it requires one.

    By hand: w = [1, 0.5], A = [2, −4] → ∂/∂l = [−1, 1], 0 on padding. Survivor: the
    ``advantages.detach()`` dropped (then ``A.grad = −w·l/2 = [0.5, 0.5]``)."""
    lp = _t(-1.0, -2.0, 7.0).requires_grad_(True)
    adv = _t(2.0, -4.0, 0.0).requires_grad_(True)
    loss, _ = weighted_logprob_loss(lp, _t(1.0, 0.5, 0.0), adv, M)
    loss.backward()
    assert adv.grad is None
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, _t(-1.0, 1.0, 0.0), rtol=0.0, atol=1e-15)


@pytest.mark.parametrize(("clip_low", "clip_high"), [(0.2, 0.0), (0.0, 0.2), (0.0, 0.0)])
def test_cispo_clipfrac_counts_a_ratio_at_a_bound_as_not_clipped(clip_low: float, clip_high: float) -> None:
    """``clipfrac = mean_valid[ρ < 1−ε_low or ρ > 1+ε_high]`` with strict inequalities (verl
    ``ratio != clipped``: at a bound the clamp is the identity). ``l = l^old`` gives ``ρ = exp(0) = 1``
    exactly; with ``ε_high = 0`` (or ``ε_low = 0``) that is the bound itself: clipfrac 0.

    Survivors: ``ratio > upper`` → ``>=`` and ``ratio < lower`` → ``<=`` (clipfrac 1)."""
    lp = _t(-1.0, -2.0, 0.0)
    out = cispo_policy_loss(lp, lp.clone(), _t(1.0, -1.0, 0.0), M, clip_low=clip_low, clip_high=clip_high)
    assert float(out.clipfrac) == 0.0
    # one token past each bound: ρ = e^{±0.5} is outside [1−ε_low, 1+ε_high] for every case: clipfrac 1
    out2 = cispo_policy_loss(lp, lp - _t(0.5, -0.5, 0.0), _t(1.0, -1.0, 0.0), M, clip_low=0.2, clip_high=0.2)
    assert float(out2.clipfrac) == 1.0


def test_cispo_defaults_clip_the_weight_to_0_8_and_1_2() -> None:
    """CISPO's defaults ``ε_low = ε_high = 0.2`` (verl ``clip_ratio_low/high``): the detached weight is
    ``clip(ρ, 0.8, 1.2)``. ``l − l^old = [0.25, −0.3]`` → ``ρ = [e^0.25 ≈ 1.284, e^−0.3 ≈ 0.741]`` →
    ``c = [1.2, 0.8]``; ``A = 1``, ``l = [−1, −2]``: ``ℓ = −c·A·l = [1.2, 1.6]``, token-mean 1.4, both
    clipped; ``∂loss/∂l = −c·A/2 = [−0.6, −0.4]`` and none to ``A``.

    Survivors: either default changed (``clip_low`` 0 → ``c_1 = 1``; ``clip_high`` 0 or 1.2 →
    ``c_0 = 1`` or ``1.284``) and ``adv.detach()`` dropped."""
    lp = _t(-1.0, -2.0, 5.0).requires_grad_(True)
    adv = _t(1.0, 1.0, 0.0).requires_grad_(True)
    out = cispo_policy_loss(lp, lp.detach() - _t(0.25, -0.3, 0.0), adv, M)
    torch.testing.assert_close(out.per_token, _t(1.2, 1.6, 0.0), rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(out.loss, torch.tensor(1.4, dtype=F64), rtol=1e-15, atol=1e-15)
    assert float(out.clipfrac) == 1.0
    out.loss.backward()
    assert adv.grad is None
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, _t(-0.6, -0.4, 0.0), rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize(
    ("agg", "want"),
    [("seq-mean-token-sum-norm", -2.0 / 3.0), ("token-mean", -2.0), ("token-sum", -2.0)],
)
def test_drop_aggregates_one_kept_token_and_none(agg: str, want: float) -> None:
    """``Rejected.drop`` aggregates over the kept tokens only, and to 0 when none is kept.

    One kept token of T = 3, ``l = l^old`` (ρ = 1, no clip), ``A = 1``, ``w' = 2``: ``ℓ = 2·(−1·1) = −2``
    there. Over the kept tokens: one sequence, one token: seq-mean-token-sum-norm ``−2/H = −2/3``,
    token-mean ``−2/1``, token-sum ``−2``. Nothing kept: 0 (not 0/0).

    Survivor: the nothing-kept test ``== 0`` → ``== 1`` (one kept token then skips the horizon
    division: ``−2``; none kept divides 0 by a count of 0: NaN)."""
    mask = torch.tensor([[True, True, True], [True, True, False]])
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, 9.0]], dtype=F64)
    adv, w = torch.ones_like(lp), torch.full_like(lp, 2.0)
    one = torch.zeros_like(mask)
    one[0, 1] = True
    kw: dict[str, Any] = {"rejected": "drop", "norms": Norms(agg=agg)}
    got = corrected_policy_loss(lp, lp.clone(), adv, mask, w, keep=one, **kw).loss
    assert float(got) == pytest.approx(want, rel=1e-15)
    none = corrected_policy_loss(lp, lp.clone(), adv, mask, w, keep=torch.zeros_like(mask), **kw).loss
    assert float(none) == 0.0


def test_a_ratio_bound_of_zero_is_accepted() -> None:
    """A ratio bound is a number ``≥ 0`` (``_bound(positive=True)``): ``low = 0`` is a valid (vacuous)
    lower bound, not refused. Mask mode with ``[0, ∞)`` keeps every valid token: ``w' = w = e^d``,
    ``d = [0.5, −1]``; a ratio gate ``[0, 2]`` on the same ``d`` keeps ``e^0.5 ≈ 1.65`` and ``e^−1``.

    Survivor: ``value < 0`` → ``value <= 0`` (0 refused)."""
    beh = _t(-1.0, -1.0, 0.0)
    num = beh + _t(0.5, -1.0, 0.0)
    w = is_weights(num, beh, M, mode="mask", low=0.0)
    want = _t(math.exp(0.5), math.exp(-1.0), 0.0)
    torch.testing.assert_close(w.weight, want, rtol=1e-15, atol=0.0)
    assert w.keep.tolist() == [[True, True, False]]
    assert rejection_mask(num, beh, M, low=0.0, high=2.0).tolist() == [[True, True, False]]


@pytest.mark.parametrize(
    ("norms", "want"),
    [
        (Norms(agg="token-mean", token_count=10.0), -0.5),
        (Norms(agg="seq-mean-token-sum", seq_count=4.0), -1.25),
        (Norms(agg="seq-mean-token-sum-norm", horizon=10.0), -0.25),
    ],
)
def test_corrected_loss_reads_the_global_normalisers(norms: Norms, want: float) -> None:
    """``Rejected.zero`` aggregates over ``m`` with the given global normalisers (a split step).

    ``l = l^old``, ``A = 1``, ``w' = 1``: ``ℓ = −1`` on each of the 3 + 2 valid tokens. token-mean over
    ``token_count = 10``: −5/10; seq-mean-token-sum over ``seq_count = 4``: −5/4; seq-mean-token-sum-norm,
    ``H = 10``: (−3/10 − 2/10)/2 = −0.25. Survivors: each normaliser dropped from the call."""
    mask = torch.tensor([[True, True, True], [True, True, False]])
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, 9.0]], dtype=F64)
    out = corrected_policy_loss(lp, lp.clone(), torch.ones_like(lp), mask, torch.ones_like(lp), norms=norms)
    assert float(out.loss) == pytest.approx(want, rel=1e-15)


def test_decoupled_behaviour_weight_reads_its_log_clamp() -> None:
    """The behaviour weight's log clamp κ (:class:`BehaviourWeight` ``log_clamp``) reaches
    :func:`is_weights`: ``l^prox − l^beh = [0.5, −0.1]``, raw truncate weight, κ = 0.3 →
    ``w' = [e^0.3, e^−0.1]``; with ``l = l^prox`` (ρ = 1) and ``A = 1`` the loss is
    ``−(e^0.3 + e^−0.1)/2``. Survivor: ``log_ratio_clamp=bw.log_clamp`` dropped (``w'_0 = e^0.5``)."""
    beh = _t(-1.0, -1.0, 0.0)
    prox = beh + _t(0.5, -0.1, 0.0)
    bw = BehaviourWeight(mode="truncate", high=None, log_clamp=0.3)
    out = decoupled_policy_loss(prox, prox.clone(), beh, _t(1.0, 1.0, 0.0), M, behaviour=bw)
    want_w = _t(math.exp(0.3), math.exp(-0.1), 0.0)
    torch.testing.assert_close(out.weights.weight, want_w, rtol=1e-15, atol=0.0)
    want = -(math.exp(0.3) + math.exp(-0.1)) / 2
    assert float(out.policy.loss) == pytest.approx(want, rel=1e-15)


def test_decoupled_rejected_token_adds_exactly_zero() -> None:
    """``ℓ_t = keep_t·w'_t·ℓ^PPO_t``: a token the behaviour mask rejects adds 0 whatever its surrogate,
    even an infinite one. Token 0: ``l^prox − l^beh = 3`` → ``w = e^3 > 5`` rejected; ``l − l^prox =
    800`` → ``ρ = inf``, ``A = −1`` → ``ℓ^PPO = max(inf, 1.2) = inf``. Token 1 kept: ``w = 1``, ρ = 1,
    ``ℓ = 1``. Token-mean over both valid tokens: (0 + 1)/2 = 0.5.

    Survivor: ``keep=w.keep`` dropped (the rejected token then adds ``0·inf = NaN``)."""
    beh = _t(-4.0, -1.0, 0.0)
    prox = beh + _t(3.0, 0.0, 0.0)
    logp = prox + _t(800.0, 0.0, 0.0)
    out = decoupled_policy_loss(logp, prox, beh, _t(-1.0, -1.0, 0.0), M)
    assert out.weights.keep.tolist() == [[False, True, False]]
    assert float(out.policy.loss) == 0.5
    assert out.policy.per_token.tolist() == [[0.0, 1.0, 0.0]]


def test_is_weights_detaches_the_raw_weight_too() -> None:
    """``detach=True`` (the default, every peer): both ``w'`` and the raw ``w`` are constants, so a
    differentiable ``l^num`` gives neither a graph. Survivor: ``raw.detach()`` dropped."""
    beh = _t(-1.0, -1.0, 0.0)
    num = (beh + _t(0.5, -1.0, 0.0)).requires_grad_(True)
    w = is_weights(num, beh, M, high=1.5)
    assert not w.weight.requires_grad
    assert not w.raw.requires_grad
    torch.testing.assert_close(w.raw, _t(math.exp(0.5), math.exp(-1.0), 0.0), rtol=1e-15, atol=0.0)


def test_sequence_gate_mean_reduces_over_each_rows_valid_tokens() -> None:
    """Sequence level, ``reduce = mean``: ``S_b = (1/L_b)·Σ_t s_t`` over row b's valid tokens (k1:
    ``s = d``). Row 0: ``d = [0.4, 0.2, ·]`` → ``S = 0.3``; row 1: ``d = [0.6, 0.6, 0.6]`` → ``S = 0.6``
    (sum 1.8). Gate ``[−∞, 0.5]``: row 0 kept, row 1 rejected; by the naive twin too.

    Survivors: the count's dim 1 → 0 / 2 and the division → a product (row 0 then ``0.6·2 = 1.2``)."""
    mask = torch.tensor([[True, True, False], [True, True, True]])
    beh = torch.full((2, 3), -1.0, dtype=F64)
    prox = beh + torch.tensor([[0.4, 0.2, 9.0], [0.6, 0.6, 0.6]], dtype=F64)
    kw: dict[str, Any] = {"stat": "k1", "level": "sequence", "reduce": "mean", "high": 0.5}
    want = [[True, True, False], [False, False, False]]
    assert rejection_mask(prox, beh, mask, **kw).tolist() == want
    assert rejection_mask_naive(prox, beh, mask, **kw) == want


def test_naive_twins_keep_a_weight_exactly_at_a_bound() -> None:
    """Bounds are closed in every peer: a weight equal to ``C_low`` or ``C_high`` is kept. ``d = 0`` →
    ``w = e^0 = 1`` exactly; mask mode ``[1, 1]`` keeps it (weight 1), a ratio gate ``[1, 1]`` too.

    Survivor: the naive helper ``_inside``'s ``x >= lo`` → ``x > lo``."""
    beh = _t(-1.0, -2.0, 0.0)
    weights, _, keeps = is_weights_naive(beh.clone(), beh, M, mode="mask", low=1.0, high=1.0)
    assert keeps == [[True, True, False]] and weights == [[1.0, 1.0, 0.0]]
    assert rejection_mask_naive(beh.clone(), beh, M, low=1.0, high=1.0) == [[True, True, False]]
    assert is_weights(beh.clone(), beh, M, mode="mask", low=1.0, high=1.0).keep.tolist() == keeps


def test_naive_weight_overflows_to_inf_as_torch_does() -> None:
    """The naive twins' ``e^x`` is torch's in float64: finite up to ``x = 709.782712893384`` (≈ ln of
    the largest double: ``≈ 1.797e308``), ``inf`` past it (Python's ``math.exp`` would raise).

    Survivors: the threshold moved up by 1 (``math.exp(710.5)`` raises OverflowError) and ``>`` →
    ``>=`` (the threshold itself gives inf, torch a finite number)."""
    beh = _t(0.0, 0.0, 0.0)
    num = _t(709.782712893384, 710.5, 0.0)
    _, raw, _ = is_weights_naive(num, beh, M)
    assert math.isfinite(raw[0][0]) and raw[0][0] > 1.79e308 and raw[0][1] == math.inf
    assert raw[0][:2] == is_weights(num, beh, M).raw[0, :2].tolist()
