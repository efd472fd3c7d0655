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


def test_value_clip_forms_differ_by_one_rounding_step_in_float32() -> None:
    # ε_v = 0.2. Token 0: V_old = 0.1, V = −0.05, R = −0.04: |V − V_old| = 0.15 < ε_v, so in exact
    # arithmetic V_clip = V and the two squared errors tie (not clipped). In float32 the delta form
    # V_old + clamp(V − V_old, ±ε_v) (OpenRLHF, SkyRL, AReaL) rounds V − V_old = −0.15 and lands one
    # step below V (worked out with numpy below, independently of refppo), farther from R, so
    # (V_clip − R)² > (V − R)² and the token counts as clipped; clamp(V, V_old ± ε_v) (verl, TRL)
    # returns V itself. Token 1: V = V_old, nothing clipped in either form.
    np = pytest.importorskip("numpy")
    f32 = np.float32
    v0, vo0, r0, eps = f32(-0.05), f32(0.1), f32(-0.04), f32(0.2)
    delta_v = vo0 + np.clip(v0 - vo0, -eps, eps)
    assert delta_v == np.nextafter(v0, f32(-1.0)), "delta form: one rounding step below V"
    assert (delta_v - r0) ** 2 > (v0 - r0) ** 2  # ... which float32 resolves as 'clipped'
    v = torch.tensor([[-0.05, 0.5]], dtype=torch.float32)
    v_old = torch.tensor([[0.1, 0.5]], dtype=torch.float32)
    ret = torch.tensor([[-0.04, 0.0]], dtype=torch.float32)
    mask = torch.ones(1, 2, dtype=torch.bool)
    around = value_loss(v, v_old, ret, mask, clip=0.2)
    delta = value_loss(v, v_old, ret, mask, clip=0.2, clip_form="delta")
    assert around.clipfrac.item() == 0.0
    assert delta.clipfrac.item() == 0.5
    # the loss itself moves by rounding only
    assert abs(delta.loss.item() - around.loss.item()) <= 1e-9


def test_value_clip_forms_agree_outside_rounding() -> None:
    # The hand example above (float64, V outside the range at token 1): both forms clip token 1.
    for form in ("around_old", "delta"):
        out = value_loss(V, V_OLD, RET, MASK, clip=0.2, clip_form=form)
        assert out.loss.item() == pytest.approx(0.2725, abs=1e-12)
        assert out.clipfrac.item() == 0.5


def test_unknown_value_clip_form_lists_valid_names() -> None:
    with pytest.raises(
        ConventionError,
        match=re.escape("value_clip_form: unknown name 'clamp'; valid names are 'around_old', 'delta'"),
    ):
        value_loss(V, V_OLD, RET, MASK, clip=0.2, clip_form="clamp")
