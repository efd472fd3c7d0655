"""Unit tests of refppo/core/value.py: hand-worked examples and every validation error path."""

from __future__ import annotations

import re

import pytest
import torch

from refppo.core.value import value_loss
from refppo.errors import ConventionError, HyperparameterError, ShapeError

# ε_v = 0.2; token 2 is padding.
#   token 0: V = 1.0, V_old = 0.5, R = 0: V_clip = 0.7; (V−R)² = 1, (V_clip−R)² = 0.49 -> ½·1 = 0.5
#   token 1: V = 1.2, V_old = 0.5, R = 1: V_clip = 0.7; (V−R)² = 0.04, (V_clip−R)² = 0.09 -> ½·0.09 = 0.045
# token-mean: (0.5 + 0.045)/2 = 0.2725; clipfrac = 1/2 (token 1). Unclipped: (0.5 + 0.02)/2 = 0.26.
V = torch.tensor([[1.0, 1.2, float("nan")]], dtype=torch.float64)
V_OLD = torch.tensor([[0.5, 0.5, float("inf")]], dtype=torch.float64)
RET = torch.tensor([[0.0, 1.0, float("-inf")]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0]])


def test_clipped_value_loss_hand_example() -> None:
    out = value_loss(V, V_OLD, RET, MASK, clip=0.2)
    assert out.per_token[0].tolist() == pytest.approx([0.5, 0.045, 0.0], abs=1e-12)
    assert out.loss.item() == pytest.approx(0.2725, abs=1e-12)
    assert out.clipfrac.item() == 0.5


def test_unclipped_value_loss_hand_example() -> None:
    out = value_loss(V, V_OLD, RET, MASK, kind="unclipped", clip=None)
    assert out.loss.item() == pytest.approx(0.26, abs=1e-12)
    assert out.clipfrac.item() == 0.0


def test_value_loss_gradient_hand_example() -> None:
    # Token 0: unclipped branch active, ∂/∂V ½(V−R)²/2 = (V−R)/2 = 0.5. Token 1: clipped branch
    # (V_clip is constant in V beyond the clip range) -> 0.
    v = V.clone().requires_grad_(True)
    value_loss(v, V_OLD, RET, MASK, clip=0.2).loss.backward()
    assert v.grad is not None
    assert v.grad[0].tolist() == pytest.approx([0.5, 0.0, 0.0], abs=1e-12)


def test_clipped_value_loss_without_clip_range_is_rejected() -> None:
    with pytest.raises(
        HyperparameterError, match=re.escape("clip: a clipped value loss needs a clip range, got None")
    ):
        value_loss(V, V_OLD, RET, MASK, clip=None)


def test_negative_value_clip_is_rejected() -> None:
    with pytest.raises(HyperparameterError, match=re.escape("clip: expected a finite number >= 0, got -0.2")):
        value_loss(V, V_OLD, RET, MASK, clip=-0.2)


def test_unknown_value_loss_kind_lists_valid_names() -> None:
    with pytest.raises(
        ConventionError,
        match=re.escape("value_loss: unknown name 'huber'; valid names are 'clipped', 'unclipped'"),
    ):
        value_loss(V, V_OLD, RET, MASK, kind="huber")


def test_returns_with_wrong_shape_name_the_tensor() -> None:
    with pytest.raises(
        ShapeError, match=r"returns: expected shape \[B, T\] = \[1, 3\] \(batch, resp\), got \[1, 2\]"
    ):
        value_loss(V, V_OLD, RET[:, :2], MASK)


def test_value_clip_inside_the_range_is_never_counted_as_clipped() -> None:
    """Inside ``[V_old − ε, V_old + ε]`` the clipped value must be V itself, bit for bit.

    ``V_old + clip(V − V_old)`` can land one rounding step off V when V and V_old differ in
    magnitude (``0.1 + (0.25 − 0.1)`` need not be ``0.25``), which used to count exact ties as
    clipped; ``clip(V, V_old ± ε)`` cannot.
    """
    gen = torch.Generator().manual_seed(7)
    v_old = torch.randn(64, 32, generator=gen, dtype=torch.float64) * 0.1
    v = torch.randn(64, 32, generator=gen, dtype=torch.float64) * 0.1  # |V − V_old| < 1.0 = ε here
    returns = torch.randn(64, 32, generator=gen, dtype=torch.float64)
    mask = torch.ones(64, 32, dtype=torch.bool)
    # precondition: the old formula really does move some V off itself on this data
    assert bool(((v_old + torch.clamp(v - v_old, -1.0, 1.0)) != v).any())
    out = value_loss(v, v_old, returns, mask, clip=1.0)
    assert float(out.clipfrac) == 0.0
    assert torch.equal(out.per_token, 0.5 * (v - returns) ** 2)
