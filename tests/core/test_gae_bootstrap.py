"""GAE with truncated rows bootstrapped from the value after their last token (issue #23 item 5):
``gae(..., last_values=b)`` (refppo/core/gae.py), its naive twin, the ``gae_bootstrap`` stage option
and the ``bootstrap_values`` / ``truncated`` dump keys.

The closed form checked here from its definition: ``V_{t_L} = b`` enters the last TD residual only,
so along a row's valid positions ``Â(b)_{t_i} − Â(0)_{t_i} = (γλ)^{L−1−i}·γ·b`` and the returns
shift by the same amount.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import Ragged, assert_twin_close, ragged_batches

from refppo.core.gae import gae, gae_naive
from refppo.errors import DumpError, ShapeError
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.stages import BY_NAME

pytestmark = pytest.mark.property

unit = st.one_of(st.sampled_from([0.0, 0.5, 0.9, 1.0]), st.floats(0.0, 1.0))
holes_kinds = st.sampled_from(["skip", "zero", "through"])


def _with_holes(b: Ragged) -> torch.Tensor:
    """``b.mask`` with some interior positions dropped (each row keeps its first and last token)."""
    m = b.mask.clone()
    drop = torch.rand(m.shape, generator=b.gen) < 0.3
    last = m.long().sum(dim=1, keepdim=True) - 1
    pos = torch.arange(b.T).unsqueeze(0)
    return m & ~(drop & (pos > 0) & (pos < last))


@given(ragged_batches(), unit, unit, holes_kinds, st.booleans())
def test_bootstrapped_gae_matches_its_naive_twin(
    b: Ragged, gamma: float, lam: float, holes: str, holed: bool
) -> None:
    m = _with_holes(b) if holed else b.mask
    r, v = b.floats(-1.0, 1.0), b.floats(-2.0, 2.0)
    boot = b.scores(-3.0, 3.0).to(b.dtype)
    adv, ret = gae(r, v, m, gamma=gamma, lam=lam, holes=holes, last_values=boot)
    adv_n, ret_n = gae_naive(r, v, m, gamma=gamma, lam=lam, holes=holes, last_values=boot)
    assert_twin_close(adv, adv_n, b.dtype, "advantages")
    assert_twin_close(ret, ret_n, b.dtype, "returns")


@given(ragged_batches(), unit, unit)
def test_the_bootstrap_enters_as_a_discounted_tail(b: Ragged, gamma: float, lam: float) -> None:
    """``Â(b) − Â(0) = (γλ)^{L−1−i}·γ·b`` at valid position i of a row of length L; 0 on padding."""
    r, v = b.floats(-1.0, 1.0), b.floats(-2.0, 2.0)
    boot = b.scores(-3.0, 3.0).to(b.dtype)
    a0, r0 = gae(r, v, b.mask, gamma=gamma, lam=lam)
    a1, r1 = gae(r, v, b.mask, gamma=gamma, lam=lam, last_values=boot)
    want = torch.zeros(b.B, b.T, dtype=torch.float64)
    for i, L in enumerate(b.lengths):
        for t in range(L):
            want[i, t] = (gamma * lam) ** (L - 1 - t) * gamma * float(boot[i])
    tol = 1e-9 if b.dtype == torch.float64 else 2e-4
    torch.testing.assert_close((a1 - a0).double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close((r1 - r0).double(), want, atol=tol, rtol=tol)
    assert bool((a1[~b.mask] == 0).all())


def test_hand_worked_vector() -> None:
    """γ = λ = ½, r = [1, 0], V = [0, 1], b = 4: δ₁ = 0 + ½·4 − 1 = 1, δ₀ = 1 + ½·1 − 0 = 1.5,
    Â = [1.5 + ¼·1, 1] = [1.75, 1], R = Â + V = [1.75, 2]; a padded third slot stays 0."""
    r = torch.tensor([[1.0, 0.0, 9.0]], dtype=torch.float64)
    v = torch.tensor([[0.0, 1.0, 9.0]], dtype=torch.float64)
    m = torch.tensor([[True, True, False]])
    boot = torch.tensor([4.0], dtype=torch.float64)
    for fn in (gae, gae_naive):
        adv, ret = fn(r, v, m, gamma=0.5, lam=0.5, last_values=boot)
        assert adv.tolist() == [[1.75, 1.0, 0.0]]
        assert ret.tolist() == [[1.75, 2.0, 0.0]]


def test_last_values_shape_and_dtype_are_checked() -> None:
    r = torch.zeros(2, 3, dtype=torch.float64)
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ShapeError, match="last_values"):
        gae(r, r, m, gamma=1.0, lam=1.0, last_values=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(Exception, match="last_values"):
        gae_naive(r, r, m, gamma=1.0, lam=1.0, last_values=torch.zeros(2, dtype=torch.float32))


def _q(boot: torch.Tensor | None, truncated: torch.Tensor | None) -> dict[str, object]:
    m = torch.tensor([[True, True, True], [True, True, False], [True, False, False]])
    g = torch.Generator().manual_seed(3)
    return {
        "token_rewards": torch.rand(3, 3, generator=g, dtype=torch.float64),
        "old_values": torch.rand(3, 3, generator=g, dtype=torch.float64),
        "value_mask": m, "mask": m, "mapped_scores": torch.zeros(3, dtype=torch.float64), "kl": None,
        "group_index": None, "bootstrap_values": boot, "truncated": truncated,
    }  # fmt: skip


HP = Hyperparams(gamma=0.9, lam=0.8)
ON = Convention.of(gae_bootstrap="truncated")


@pytest.mark.parametrize("naive", [False, True])
def test_stage_bootstraps_only_the_truncated_rows(naive: bool) -> None:
    """Without ``truncated`` the rows whose last position is valid (row 0) read their bootstrap
    value; the others never read theirs (NaN there stays out); with ``truncated`` the flag decides.
    Each against the core called directly with the per-row ``last_values``."""
    st_ = BY_NAME["advantages"]
    nan = float("nan")
    boot = torch.tensor([2.0, nan, 5.0], dtype=torch.float64)
    q = _q(boot, None)
    out = st_.run(q, ON, HP, naive=naive)
    want, _ = gae(q["token_rewards"], q["old_values"], q["mask"], gamma=0.9, lam=0.8,  # type: ignore[arg-type]
                  last_values=torch.tensor([2.0, 0.0, 0.0], dtype=torch.float64))  # fmt: skip
    torch.testing.assert_close(out["advantages_raw"], want)
    flagged = _q(torch.tensor([2.0, 1.0, 5.0], dtype=torch.float64), torch.tensor([0, 0, 1]))
    out = st_.run(flagged, ON, HP, naive=naive)
    want, _ = gae(flagged["token_rewards"], flagged["old_values"], flagged["mask"], gamma=0.9, lam=0.8,  # type: ignore[arg-type]
                  last_values=torch.tensor([0.0, 0.0, 5.0], dtype=torch.float64))  # fmt: skip
    torch.testing.assert_close(out["advantages_raw"], want)
    off = st_.run(flagged, Convention(), HP, naive=naive)
    assert not torch.allclose(off["advantages_raw"], out["advantages_raw"])


def test_stage_without_bootstrap_values_is_one_line() -> None:
    line = "missing required key 'bootstrap_values' \\[B\\]: read by the advantages stage"
    with pytest.raises(DumpError, match=line):
        BY_NAME["advantages"].run(_q(None, None), ON, HP)
