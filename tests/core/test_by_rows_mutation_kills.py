"""Tests for survivors of ``tools/mutate.py`` on ``refppo/core/by_rows.py`` (issue #9's row blocks).

The property tests (tests/pipeline/test_update_by_rows.py) compare values; these pin what they do
not reach: the input checks (each must refuse what the whole-batch core refuses, with the core's
own message, checked by calling the core directly), the refusal of inputs that need a gradient
(every input, by name), the block slicing itself, and the numeric defaults (the documented 0.2
clip ranges and the PPO — not GSPO — ratio, spelled out here, not read from the code under test).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from oracle_helpers import setup_for
from torch import Tensor

from refppo.core.by_rows import (
    entropy_bonus_by_rows,
    kl_loss_by_rows,
    policy_loss_by_rows,
    row_blocks,
    value_loss_by_rows,
)
from refppo.core.gspo import gspo_policy_loss
from refppo.core.objective import kl_loss
from refppo.core.policy import clipped_policy_loss
from refppo.core.value import value_loss
from refppo.errors import DtypeError, HyperparameterError
from refppo.pipeline import blocks as m_blocks
from refppo.pipeline.blocks import update_rows
from refppo.pipeline.update import policy_term


def _inputs(n: int, B: int = 3, T: int = 4) -> tuple[Tensor, list[Tensor]]:
    """A mask with padding and ``n`` float64 tensors whose log-ratios leave ``[0.8, 1.2]`` often."""
    g = torch.Generator().manual_seed(7)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, -1] = mask[2, -2:] = False
    return mask, [torch.randn(B, T, generator=g, dtype=torch.float64) for _ in range(n)]


def test_row_blocks_cover_the_rows_and_refuse_an_empty_or_negative_block() -> None:
    """``[i, min(i+rows, B))`` for i = 0, rows, 2·rows, …: for B=5, rows=2 the slices 0:2, 2:4, 4:5
    (by hand). ``rows`` 0 or −1 is a HyperparameterError naming ``rows`` (survivors: the bound
    ``rows < 1`` mutated to ``rows < 0`` / ``rows < -1``, then ``range`` raised its own error or gave
    no block at all)."""
    assert list(row_blocks(5, 2)) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert list(row_blocks(2, 7)) == [slice(0, 2)]
    for bad in (0, -1):
        with pytest.raises(HyperparameterError, match=r"^rows: expected a block of at least one row"):
            list(row_blocks(3, bad))


def _dtype_message(fn: Callable[..., Any], *args: Tensor, **kw: Any) -> str:
    with pytest.raises(DtypeError) as e:
        fn(*args, **kw)
    return str(e.value)


@pytest.mark.parametrize("gspo", [False, True])
@pytest.mark.parametrize("odd", [0, 1, 2])
def test_policy_by_rows_refuses_a_mixed_dtype_like_the_whole_batch_core(gspo: bool, odd: int) -> None:
    """One of ``logp``, ``logp_old``, ``advantages`` in float32, the others float64: the core refuses
    (no silent up-casting); the by-rows function must too, with the core's message. Survivors: each
    argument dropped from one of the ``check_same_dtype`` calls (then torch promoted silently)."""
    mask, xs = _inputs(3)
    xs[odd] = xs[odd].float()
    core = gspo_policy_loss if gspo else clipped_policy_loss
    want = _dtype_message(core, *xs, mask)
    assert _dtype_message(policy_loss_by_rows, 2, *xs, mask, gspo=gspo) == want


@pytest.mark.parametrize("odd", [0, 1, 2])
def test_value_by_rows_refuses_a_mixed_dtype_like_the_whole_batch_core(odd: int) -> None:
    """As above for ``values``, ``values_old``, ``returns`` (survivors: each dropped from the check)."""
    mask, xs = _inputs(3)
    xs[odd] = xs[odd].float()
    want = _dtype_message(value_loss, *xs, mask)
    assert _dtype_message(value_loss_by_rows, 2, *xs, mask) == want


CALLS: list[tuple[str, int, Callable[..., Any]]] = [
    *((name, i, policy_loss_by_rows) for i, name in enumerate(("logp", "logp_old", "advantages"))),
    *((name, i, value_loss_by_rows) for i, name in enumerate(("values", "values_old", "returns"))),
    ("entropy", 0, entropy_bonus_by_rows),
    *((name, i, kl_loss_by_rows) for i, name in enumerate(("logp", "logp_ref"))),
]


@pytest.mark.parametrize("name, i, fn", CALLS, ids=[f"{f.__name__}-{n}" for n, _, f in CALLS])
def test_by_rows_refuses_each_input_that_needs_a_gradient(name: str, i: int, fn: Callable[..., Any]) -> None:
    """The buffers are written in place without a graph, so an input that requires a gradient (grad
    mode on) is refused by name; with grad mode off it is accepted. Survivors: each input dropped
    from the ``_no_grad`` call (its gradient was then silently lost)."""
    n_inputs = {policy_loss_by_rows: 3, value_loss_by_rows: 3, entropy_bonus_by_rows: 1, kl_loss_by_rows: 2}[
        fn
    ]
    mask, xs = _inputs(n_inputs)
    xs[i] = xs[i].clone().requires_grad_()
    with pytest.raises(ValueError, match=rf"^{name}: requires a gradient"):
        fn(2, *xs, mask)
    with torch.no_grad():
        fn(2, *xs, mask)


def _equal(got: Any, want: Any, fields: tuple[str, ...]) -> None:
    for f in fields:
        assert torch.equal(getattr(got, f), getattr(want, f)), f


def test_policy_by_rows_defaults_are_ppo_with_clip_0_2() -> None:
    """Documented defaults: the PPO clipped surrogate (``gspo=False``) with ``clip_low=0.2``,
    ``clip_high`` = ``clip_low``. Compared with the core called with those values spelled out; the
    inputs' ratios leave ``[0.8, 1.2]`` on both sides (checked), so another clip changes the loss
    (and a negative one is refused). Survivors: the default ``gspo=False → True`` and
    ``0.2 → 0 / 1.2 / −0.2``."""
    mask, (lp, old, adv) = _inputs(3)
    r = torch.exp(lp - old)[mask]
    assert bool((r < 0.8).any()) and bool((r > 1.2).any())
    want = clipped_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    got = policy_loss_by_rows(2, lp, old, adv, mask)
    _equal(got, want, ("loss", "per_token", "ratio", "clipfrac"))


def test_value_by_rows_default_clip_is_0_2() -> None:
    """Documented default: the clipped value loss with ``clip=0.2`` (compared with the core called
    with 0.2 spelled out; the value moves exceed 0.2 and 1.2, checked). Survivors:
    ``0.2 → 0 / 1.2 / −0.2``."""
    mask, (v, vo, ret) = _inputs(3)
    v = vo + 3.0 * (v - vo)
    move = (v - vo).abs()[mask]
    assert bool((move > 1.2).any()) and bool(((move > 0.2) & (move < 1.2)).any())
    want = value_loss(v, vo, ret, mask, clip=0.2, kind="clipped")
    got = value_loss_by_rows(2, v, vo, ret, mask)
    _equal(got, want, ("loss", "per_token", "clipfrac"))


def test_value_by_rows_passes_the_horizon() -> None:
    """``seq-mean-token-sum-norm`` divides each row's sum by the given horizon ``H``: with ``H = 2``
    (not ``T = 4``) the by-rows loss equals the core's called with ``horizon=2.0`` and differs from
    the default ``H = T`` (checked). Survivor: ``horizon=`` dropped from the aggregation."""
    mask, (v, vo, ret) = _inputs(3)
    kw: dict[str, Any] = {"agg": "seq-mean-token-sum-norm", "kind": "unclipped"}
    want = value_loss(v, vo, ret, mask, horizon=2.0, **kw)
    assert not torch.equal(want.loss, value_loss(v, vo, ret, mask, **kw).loss)
    assert torch.equal(value_loss_by_rows(2, v, vo, ret, mask, horizon=2.0, **kw).loss, want.loss)


def test_kl_by_rows_applies_the_value_clamp() -> None:
    """A value clamp alone (no log-ratio clamp) of 0.05 on k3 of log-ratios ~N(0, 2²) bites (the
    loss differs from the unclamped one, checked); the by-rows loss equals the core's called with
    the clamp. Survivor: ``value_clamp=`` dropped from the per-block ``token_kl`` call."""
    mask, (lp, ref) = _inputs(2)
    lp = 2.0 * lp
    want = kl_loss(lp, ref, mask, "k3", value_clamp=0.05)
    assert not torch.equal(want, kl_loss(lp, ref, mask, "k3"))
    assert torch.equal(kl_loss_by_rows(2, lp, ref, mask, "k3", value_clamp=0.05), want)


@pytest.mark.parametrize("gspo", [False, True])
def test_policy_term_by_rows_reads_every_setting(gspo: bool) -> None:
    """``pipeline.policy_term(rows=2)`` passes ε_low = 0.1, ε_high = 0.3, the dual clip 1.5, the
    log-ratio clamp 0.7 and ``seq-mean-token-sum`` to the by-rows loss: it equals the core called
    directly with those values spelled out (the graph-free block path; survivors: each setting
    dropped from the ``policy_loss_by_rows`` call, where the defaults 0.2 / None / token-mean took
    over unnoticed because the update tests used the presets' 0.2)."""
    conv: dict[str, Any] = {"loss_agg": "seq-mean-token-sum", "log_ratio_clamp": 0.7}
    conv.update({"policy_loss": "gspo", "dual_clip": "none"} if gspo else {"dual_clip": 1.5})
    s = setup_for("verl", conv, {"cliprange": 0.1, "cliprange_high": 0.3})
    mask, (lp, old, adv) = _inputs(3, B=5, T=6)
    got = policy_term(lp, old, adv, mask, hp=s.hp, conv=s.conv, rows=2)
    kw: dict[str, Any] = {"clip_low": 0.1, "clip_high": 0.3, "agg": "seq-mean-token-sum"}
    if gspo:
        want = gspo_policy_loss(lp, old, adv, mask, log_ratio_max=0.7, **kw)
    else:
        want = clipped_policy_loss(lp, old, adv, mask, dual_clip=1.5, log_ratio_clamp=0.7, **kw)
    _equal(got, want, ("loss", "per_token", "ratio", "clipfrac", "clipfrac_lower", "approx_kl"))


@pytest.mark.parametrize(
    "budget, B, T, want",
    [
        (24, 6, 12, 2),  # 24 // 12 = 2 rows per block
        (24, 3, 12, 2),  # the last block shorter
        (24, 2, 12, None),  # the whole batch fits one block: no blocks
        (4, 6, 12, 1),  # a row over the budget: still one row per block, never 0
        (8, 6, 0, None),  # no column: 8 // max(0, 1) = 8 rows ≥ B, the whole batch
    ],
)
def test_update_rows_by_hand(
    budget: int, B: int, T: int, want: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``update_rows``: ``step = max(1, ⌊budget / max(T, 1)⌋)`` rows, None when ``step ≥ B``, worked
    out by hand above. Survivors: the ``1`` of ``max(1, …)`` (0 gave blocks of no row) and of
    ``max(T, 1)`` (0 divided by zero, 2 halved the step) mutated."""
    monkeypatch.setattr(m_blocks, "ROW_BLOCK_ELEMENTS", budget)
    assert update_rows(torch.ones(B, T, dtype=torch.bool), torch.zeros(B, T)) == want
