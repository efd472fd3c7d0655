"""``refppo.core.by_rows`` (issue #9, memory): the update stage's losses evaluated by blocks of rows
equal the core's whole-batch functions called directly, bit for bit — every ``loss_agg`` mode with
and without global normalisers, dual clip, the log-ratio clamp, GSPO's sequence ratio, both value
clip forms and the unclipped value loss, every KL estimator — with junk (huge values, inf, NaN) on
the padding; and ``update_quantities`` takes the blocks exactly when no autograd graph is built."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle_helpers import make_inputs, setup_for

from refppo.agg_conventions import MASK_AGGS
from refppo.conventions import KLEstimator
from refppo.core.by_rows import (
    entropy_bonus_by_rows,
    kl_loss_by_rows,
    policy_loss_by_rows,
    policy_token_loss_by_rows,
    value_loss_by_rows,
)
from refppo.core.gspo import gspo_policy_loss
from refppo.core.objective import entropy_bonus, kl_loss
from refppo.core.policy import clipped_policy_loss
from refppo.core.value import value_loss
from refppo.pipeline import blocks as m_blocks
from refppo.pipeline import update as m_update
from refppo.pipeline.blocks import Normalisers
from refppo.pipeline.step import UpdateQuantities, rollout_quantities, update_quantities

pytestmark = pytest.mark.property

AGGS = [a.value for a in MASK_AGGS]
NORMS: list[dict[str, float]] = [{}, {"token_count": 37.0, "seq_count": 5.0, "horizon": 11.0}]


def _batch(seed: int, B: int, T: int, dtype: torch.dtype, n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A mask with holes and padding (no empty row) and ``n`` float tensors with junk on padding."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[torch.arange(B), torch.randint(T, (B,), generator=g)] = True
    junk = torch.tensor([1e30, -1e30, float("inf"), float("nan"), 7.0], dtype=torch.float64)
    out = []
    for _ in range(n):
        x = 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64) - 1.0
        pick = junk[torch.randint(len(junk), (B, T), generator=g)]
        out.append(torch.where(mask, x, pick).to(dtype))
    return mask, out


def _same(got: Any, want: Any, fields: tuple[str, ...]) -> None:
    for f in fields:
        a, b = getattr(got, f), getattr(want, f)
        assert a.dtype == b.dtype, f
        assert a.shape == b.shape, f
        assert torch.equal(a.detach(), b.detach()), (f, a, b)


POLICY_FIELDS = ("loss", "per_token", "ratio", "clipfrac", "clipfrac_lower", "approx_kl", "approx_kl_k2")


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    B=st.integers(1, 7),
    T=st.integers(1, 11),
    rows=st.integers(1, 8),
    agg=st.sampled_from(AGGS),
    norm=st.sampled_from(NORMS),
    dual=st.sampled_from([None, 3.0, 1.5]),
    clamp=st.sampled_from([None, 0.3, 20.0]),
    clip_high=st.sampled_from([None, 0.28]),
    gspo=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_policy_loss_by_rows_equals_the_whole_batch_core(
    seed: int, B: int, T: int, rows: int, agg: str, norm: dict[str, float], dual: float | None,
    clamp: float | None, clip_high: float | None, gspo: bool, dtype: torch.dtype,
) -> None:  # fmt: skip
    mask, (lp, old, adv) = _batch(seed, B, T, dtype, 3)
    adv = adv + 1.0  # both signs of A
    if gspo:
        want = gspo_policy_loss(
            lp, old, adv, mask, clip_low=0.2, clip_high=clip_high, agg=agg, log_ratio_max=clamp, **norm
        )
        dual = None
    else:
        want = clipped_policy_loss(
            lp, old, adv, mask, clip_low=0.2, clip_high=clip_high, dual_clip=dual, agg=agg,
            log_ratio_clamp=clamp, **norm,
        )  # fmt: skip
    got = policy_loss_by_rows(
        rows, lp, old, adv, mask, gspo=gspo, clip_low=0.2, clip_high=clip_high, dual_clip=dual, agg=agg,
        log_ratio_clamp=clamp, **norm,
    )  # fmt: skip
    _same(got, want, POLICY_FIELDS)


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    B=st.integers(1, 7),
    T=st.integers(1, 11),
    rows=st.integers(1, 8),
    agg=st.sampled_from(AGGS),
    norm=st.sampled_from(NORMS),
    kind=st.sampled_from(["clipped", "unclipped"]),
    form=st.sampled_from(["around_old", "delta"]),
    clip=st.sampled_from([0.2, 0.0, 5.0]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_value_loss_by_rows_equals_the_whole_batch_core(
    seed: int, B: int, T: int, rows: int, agg: str, norm: dict[str, float], kind: str, form: str,
    clip: float, dtype: torch.dtype,
) -> None:  # fmt: skip
    mask, (v, vo, ret) = _batch(seed, B, T, dtype, 3)
    want = value_loss(v, vo, ret, mask, clip=clip, kind=kind, agg=agg, clip_form=form, **norm)
    got = value_loss_by_rows(rows, v, vo, ret, mask, clip=clip, kind=kind, agg=agg, clip_form=form, **norm)
    _same(got, want, ("loss", "per_token", "clipfrac"))


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    B=st.integers(1, 7),
    T=st.integers(1, 11),
    rows=st.integers(1, 8),
    agg=st.sampled_from(AGGS),
    norm=st.sampled_from(NORMS),
    est=st.sampled_from([e.value for e in KLEstimator]),
    clamps=st.sampled_from([(None, None), ((-0.5, 0.5), 1.0), ((None, 3.0), None)]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_entropy_and_kl_loss_by_rows_equal_the_whole_batch_core(
    seed: int, B: int, T: int, rows: int, agg: str, norm: dict[str, float], est: str,
    clamps: tuple[Any, Any], dtype: torch.dtype,
) -> None:  # fmt: skip
    mask, (lp, ref, ent) = _batch(seed, B, T, dtype, 3)
    want_e = entropy_bonus(ent, mask, agg, **norm)
    got_e = entropy_bonus_by_rows(rows, ent, mask, agg, **norm)
    assert got_e.dtype == want_e.dtype and torch.equal(got_e, want_e)
    lrc, vc = clamps
    want_k = kl_loss(lp, ref, mask, est, agg, log_ratio_clamp=lrc, value_clamp=vc, **norm)
    got_k = kl_loss_by_rows(rows, lp, ref, mask, est, agg, log_ratio_clamp=lrc, value_clamp=vc, **norm)
    assert got_k.dtype == want_k.dtype and torch.equal(got_k, want_k)


def test_by_rows_refuses_inputs_that_need_a_gradient() -> None:
    mask, (lp, old, adv) = _batch(0, 3, 4, torch.float64, 3)
    with pytest.raises(ValueError, match="logp: requires a gradient"):
        policy_loss_by_rows(1, lp.clone().requires_grad_(), old, adv, mask)


UPDATE_FIELDS = (
    "loss", "pg_loss", "vf_loss", "entropy_loss", "kl_loss", "ratio", "pg_clipfrac",
    "pg_clipfrac_lower", "approx_kl", "vf_clipfrac",
)  # fmt: skip


@pytest.mark.parametrize(
    "preset, updates",
    [
        ("verl", {}),
        ("trl", {}),
        ("openrlhf", {"kl_in": "loss", "loss_agg": "seq-mean-token-mean"}),
        ("verl", {"policy_loss": "gspo", "dual_clip": "none", "loss_agg": "seq-mean-token-sum-norm"}),
        ("verl", {"dual_clip": 3.0, "value_clip_form": "delta", "loss_agg": "token-sum"}),
    ],
)
def test_update_quantities_by_rows_equals_the_whole_batch_graph_path(
    preset: str, updates: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a graph (plain tensors) a batch over ``ROW_BLOCK_ELEMENTS`` goes by blocks (the
    by-rows functions are called) and gives what the whole-batch path gives with a graph."""
    inp = make_inputs(B=6, T=12)
    s = setup_for(preset, updates)
    m = inp["response_mask"].bool()
    rq = rollout_quantities(
        scores=inp["scores"], old_logprobs=inp["old_logprobs"], ref_logprobs=inp["ref_logprobs"],
        old_values=inp["old_values"], mask=m, hp=s.hp, conv=s.conv,
    )  # fmt: skip
    ent = torch.rand(6, 12, dtype=inp["logprobs"].dtype)

    def run(lp: torch.Tensor, v: torch.Tensor) -> UpdateQuantities:
        return update_quantities(
            logprobs=lp, values=v, old_logprobs=inp["old_logprobs"], old_values=inp["old_values"],
            advantages=rq.advantages, returns=rq.returns, mask=m, value_mask_=rq.value_mask,
            ref_logprobs=inp["ref_logprobs"], entropy=ent, hp=s.hp, conv=s.conv,
            norm=Normalisers(token_count=50.0, seq_count=8.0),
        )  # fmt: skip

    want = run(inp["logprobs"].clone().requires_grad_(), inp["values"].clone().requires_grad_())
    calls: list[int] = []
    real = policy_token_loss_by_rows

    def counting(*a: Any, **k: Any) -> Any:
        calls.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(m_update, "policy_token_loss_by_rows", counting)
    monkeypatch.setattr(m_blocks, "ROW_BLOCK_ELEMENTS", 24)  # two rows per block
    got = run(inp["logprobs"], inp["values"])
    assert calls == [2]
    _same(got, want, UPDATE_FIELDS)
    with torch.no_grad():  # grad mode off: blocks too, even for tensors that require a gradient
        run(inp["logprobs"].clone().requires_grad_(), inp["values"])
    assert calls == [2, 2]
    # with a graph the whole batch: no block call
    run(inp["logprobs"].clone().requires_grad_(), inp["values"])
    assert calls == [2, 2]


def test_by_rows_losses_equal_the_core_on_transposed_inputs() -> None:
    """Inputs stored column-major (``x.t().contiguous().t()``): the row-block buffers are allocated
    row-major like the whole-batch results, so the one aggregation sums in the same order. With
    ``empty_like`` copying the input's layout, token-sum differed by ~2e-3 (a reviewer's script)."""
    from refppo.core.by_rows import policy_loss_by_rows, value_loss_by_rows
    from refppo.core.policy import clipped_policy_loss
    from refppo.core.value import value_loss

    g = torch.Generator().manual_seed(3)
    B, T = 64, 333
    mask = torch.arange(T).expand(B, T) < torch.randint(1, T + 1, (B, 1), generator=g)

    def col_major(x: torch.Tensor) -> torch.Tensor:
        return x.t().contiguous().t()

    old = col_major(-torch.rand(B, T, generator=g, dtype=torch.float32) * 3)
    lp = col_major(old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float32))
    adv = col_major(torch.randn(B, T, generator=g, dtype=torch.float32))
    assert not lp.is_contiguous()
    for agg in ("token-mean", "seq-mean-token-sum", "token-sum"):
        got = policy_loss_by_rows(7, lp, old, adv, mask, agg=agg)
        want = clipped_policy_loss(lp, old, adv, mask, agg=agg)
        assert torch.equal(got.loss, want.loss) and torch.equal(got.approx_kl, want.approx_kl), agg
        v = value_loss_by_rows(7, adv, old, lp, mask, agg=agg)
        assert torch.equal(v.loss, value_loss(adv, old, lp, mask, agg=agg).loss), agg
