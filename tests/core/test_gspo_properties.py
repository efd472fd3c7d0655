"""Properties of GSPO's sequence-ratio surrogate (refppo/core/gspo.py).

- the vectorized loss equals its naive twin (values, per-token losses, ratios, statistics);
- its autograd gradient equals the closed form ``gspo_policy_grad_naive``, with exact ties forced
  (a row whose ``d`` are all 0 gives ``s_b = 1`` on an ``ε = 0`` side; a row whose ``d`` all equal the
  dyadic κ gives ``S_b = κ`` on the clamp's bound);
- every token of a row carries the same ratio ``s_b = exp(mean d)``;
- with an advantage constant along each row and ``seq-mean-token-mean``, the loss and its gradient
  equal the *sequence-level* GSPO objective ``mean_b max(−A_b s_b, −A_b clip(s_b))`` differentiated
  without any stop-gradient (the paper's GSPO = GSPO-token claim);
- junk on the padding changes nothing, values or gradients; the pipeline with ``policy_loss=gspo``
  gives the twin's objective gradient.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import Ragged, assert_exactly_equal, assert_grad_close, assert_twin_close, ragged_batches

from refppo.agg_conventions import MASK_AGGS
from refppo.conventions import LossAgg
from refppo.core.gspo import gspo_policy_grad_naive, gspo_policy_loss, gspo_policy_loss_naive
from refppo.pipeline.blocks import Normalisers
from refppo.pipeline.grad_naive import objective_grads_naive
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import update_quantities

pytestmark = pytest.mark.property

aggs = st.sampled_from(list(MASK_AGGS))
clip_ranges = st.sampled_from([(0.2, None), (0.2, 0.28), (0.0, None), (0.2, 0.0), (0.0, 0.3)])
kappas = st.sampled_from([None, 0.25, 10.0])


def _inputs(b: Ragged, kappa: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(lp, lp_old, adv, tie_rows)``: per-row offsets spread S_b over every clip region; some rows
    have all ``d = 0`` (s_b = 1) or all ``d = κ`` (S_b = κ), exactly."""
    lp_old = (torch.floor(b.valid(-5.0, 0.0).to(torch.float64) * 16) / 16).to(b.dtype)
    offset = b.normal(b.B, 1, scale=0.3)
    d = offset + b.valid(-0.1, 0.1)
    rows = torch.rand(b.B, generator=b.gen)
    at_one, at_kappa = rows < 0.2, (rows >= 0.2) & (rows < 0.35) & (kappa is not None)
    d = torch.where(at_one.unsqueeze(1), 0.0, d)
    if kappa is not None:
        d = torch.where(at_kappa.unsqueeze(1), kappa, d)
    d = d.to(b.dtype)
    adv = b.valid(-2.0, 2.0)
    tie_rows = (at_one | at_kappa).unsqueeze(1) & b.mask
    return b.with_junk(lp_old + d), b.with_junk(lp_old), b.with_junk(adv), tie_rows


@given(ragged_batches(), clip_ranges, aggs, kappas)
def test_gspo_loss_matches_naive(
    b: Ragged, clip: tuple[float, float | None], agg: LossAgg, kappa: float | None
) -> None:
    lp, lp_old, adv, _ = _inputs(b, kappa)
    kw = {"clip_low": clip[0], "clip_high": clip[1], "agg": agg, "log_ratio_max": kappa}
    got = gspo_policy_loss(lp, lp_old, adv, b.mask, **kw)  # type: ignore[arg-type]  # kwargs dict
    want = gspo_policy_loss_naive(lp, lp_old, adv, b.mask, **kw)  # type: ignore[arg-type]  # same
    f64 = torch.zeros((), dtype=torch.float64)
    assert_twin_close(got.loss, f64 + want.loss, b.dtype, "loss")
    assert_twin_close(got.per_token, torch.tensor(want.per_token, dtype=torch.float64), b.dtype, "per_token")
    assert_twin_close(got.ratio, torch.tensor(want.ratio, dtype=torch.float64), b.dtype, "ratio")
    assert_twin_close(got.approx_kl, f64 + want.approx_kl, b.dtype, "approx_kl")
    assert float(got.clipfrac_lower) == 0.0
    # one ratio per row: every valid token of row b holds the same s_b (bitwise)
    for row in range(b.B):
        r = got.ratio[row][b.mask[row]]
        assert bool((r == r[0]).all()), f"row {row}: token ratios differ {r.tolist()}"


@given(ragged_batches(), clip_ranges, aggs, kappas, st.booleans())
def test_gspo_grad_matches_autograd(
    b: Ragged, clip: tuple[float, float | None], agg: LossAgg, kappa: float | None, global_norm: bool
) -> None:
    lp, lp_old, adv, ties = _inputs(b, kappa)
    kw = {"clip_low": clip[0], "clip_high": clip[1], "agg": agg, "log_ratio_max": kappa}
    if global_norm:
        kw |= {"token_count": b.n_valid + 5, "seq_count": b.B + 1, "horizon": b.T + 3}
    x = lp.clone().requires_grad_(True)
    gspo_policy_loss(x, lp_old, adv, b.mask, **kw).loss.backward()  # type: ignore[arg-type]  # kwargs dict
    twin = gspo_policy_grad_naive(lp, lp_old, adv, b.mask, **kw)  # type: ignore[arg-type]  # same
    assert_grad_close(x.grad, twin, b.mask, b.dtype, f"∂gspo/∂logp ({agg}, {clip}, κ {kappa})", ties)


@given(ragged_batches(dtypes=(torch.float64,)), clip_ranges)
def test_gspo_token_form_equals_sequence_level_gspo_for_row_constant_advantages(
    b: Ragged, clip: tuple[float, float | None]
) -> None:
    lp, lp_old, _, _ = _inputs(b, None)
    adv_row = b.normal(b.B, 1)
    adv = b.with_junk(adv_row.expand(b.B, b.T).contiguous())
    x = lp.clone().requires_grad_(True)
    gspo_policy_loss(
        x, lp_old, adv, b.mask, clip_low=clip[0], clip_high=clip[1], agg="seq-mean-token-mean"
    ).loss.backward()
    # Sequence-level GSPO written directly: s_b = exp(mean_t d), no stop-gradient anywhere.
    y = lp.clone().requires_grad_(True)
    d = torch.where(b.mask, y - lp_old, 0.0)
    s = torch.exp(d.sum(1) / b.mask.sum(1))
    eps_hi = clip[1] if clip[1] is not None else clip[0]
    a = adv_row.squeeze(1)
    seq_loss = torch.maximum(-a * s, -a * torch.clamp(s, 1 - clip[0], 1 + eps_hi)).mean()
    seq_loss.backward()
    assert x.grad is not None and y.grad is not None
    want = gspo_policy_loss(
        lp, lp_old, adv, b.mask, clip_low=clip[0], clip_high=clip[1], agg="seq-mean-token-mean"
    )
    torch.testing.assert_close(want.loss, seq_loss.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-12)


@given(ragged_batches(), aggs, st.sampled_from(["nan", "inf", "-inf", "huge", "mixed"]))
def test_gspo_padding_invariant(b: Ragged, agg: LossAgg, other_junk: str) -> None:
    lp, lp_old, adv, _ = _inputs(b, 10.0)
    outs, grads = [], []
    for junk in (None, other_junk):
        x = b.with_junk(lp, junk).requires_grad_(True)
        res = gspo_policy_loss(x, b.with_junk(lp_old, junk), b.with_junk(adv, junk), b.mask, agg=agg)
        res.loss.backward()
        assert x.grad is not None
        outs.append(res)
        grads.append(x.grad)
    for name in ("loss", "per_token", "ratio", "clipfrac", "approx_kl", "approx_kl_k2"):
        assert_exactly_equal(getattr(outs[0], name), getattr(outs[1], name), what=name)
    assert_exactly_equal(grads[0], grads[1], what="grad")
    assert bool((grads[0][~b.mask] == 0).all()), "no gradient reaches padded log-probs"


@given(ragged_batches(), aggs, st.sampled_from([None, 10.0]), st.booleans())
def test_pipeline_with_gspo_gives_the_twins_objective_gradient(
    b: Ragged, agg: LossAgg, kappa: float | None, global_norm: bool
) -> None:
    lp, lp_old, adv, _ = _inputs(b, kappa)
    conv = Convention.of(
        policy_loss="gspo", loss_agg=agg, log_ratio_clamp=kappa, kl_in="loss", kl_estimator="k3"
    )  # type: ignore[arg-type]  # str parsed
    hp = Hyperparams(cliprange=0.2, cliprange_high=0.28, kl_coef=0.1, vf_coef=0.5)
    norm = Normalisers(b.n_valid + 3, b.B + 1, b.n_valid + 3) if global_norm else None
    ts = {
        "old_logprobs": lp_old,
        "advantages": adv,
        "ref_logprobs": b.with_junk(lp_old.nan_to_num() + b.valid(-0.5, 0.5)),
        "old_values": b.floats(),
        "returns": b.floats(),
    }
    x, v = lp.clone().requires_grad_(True), b.floats().requires_grad_(True)
    update_quantities(logprobs=x, values=v, mask=b.mask, hp=hp, conv=conv, norm=norm, **ts).loss.backward()
    g_lp, g_v = objective_grads_naive(
        logprobs=lp, values=v.detach(), mask=b.mask, hp=hp, conv=conv, norm=norm, **ts
    )
    assert_grad_close(x.grad, g_lp, b.mask, b.dtype, "∂J/∂logprobs (gspo)")
    assert_grad_close(v.grad, g_v, b.mask, b.dtype, "∂J/∂values (gspo)")
