"""The value clip solver's sorted-knot model (:mod:`refppo.oracle.detect.solve_value`) against the
direct form ``½·Σ w·max((V−R)², (clamp(V, V_old ± ε) − R)²)`` evaluated token by token."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refppo.oracle.detect.solve_value import ValueKnots, ValueTerms, solve_value_clip


def _direct(v: list[float], vo: list[float], r: list[float], w: list[float], eps: float) -> float:
    total = 0.0
    for vi, oi, ri, wi in zip(v, vo, r, w, strict=True):
        vc = min(max(vi, oi - eps), oi + eps)
        total += wi * max((vi - ri) ** 2, (vc - ri) ** 2)
    return 0.5 * total


_x = st.floats(-3.0, 3.0, allow_nan=False).map(lambda x: round(x, 2))  # ties and zero d are common


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.tuples(_x, _x, _x, st.floats(0.0, 2.0)), min_size=1, max_size=12),
    eps=st.lists(st.floats(0.0, 7.0), min_size=1, max_size=5),
)
def test_knot_model_equals_the_direct_form(
    rows: list[tuple[float, float, float, float]], eps: list[float]
) -> None:
    v, vo, r, w = (list(c) for c in zip(*rows, strict=True))
    knots = ValueKnots(*(torch.tensor(c, dtype=torch.float64) for c in (v, vo, r)))
    terms = knots.weighted(torch.tensor(w, dtype=torch.float64))
    # every knot, either side of it, and the drawn ε
    probes = [*eps, 0.0, *(k + dk for k in knots.knots.tolist() for dk in (-1e-9, 0.0, 1e-9) if k + dk >= 0)]
    for e in probes:
        want = _direct(v, vo, r, w, e)
        assert abs(terms.loss(e) - want) <= 1e-9 * max(1.0, abs(want)), (e, terms.loss(e), want)


def test_shared_knots_serve_every_weighting() -> None:
    g = torch.Generator().manual_seed(3)
    v, vo, r = (torch.randn(4, 9, generator=g, dtype=torch.float64) for _ in range(3))
    m = torch.rand(4, 9, generator=g) < 0.7
    knots = ValueKnots.of(v, vo, r, m)
    for seed in range(3):
        w = torch.rand(4, 9, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        own = ValueTerms.of(v, vo, r, m, w)
        shared = knots.weighted(w[m])
        for e in (0.0, 0.05, 0.4, 2.0):
            assert shared.loss(e) == own.loss(e)
            direct = _direct(v[m].tolist(), vo[m].tolist(), r[m].tolist(), w[m].tolist(), e)
            assert abs(own.loss(e) - direct) <= 1e-12 * max(1.0, direct)
        target = _direct(v[m].tolist(), vo[m].tolist(), r[m].tolist(), w[m].tolist(), 0.25)
        assert 0.25 in solve_value_clip(shared, target, tol=1e-9) or not bool(
            ((v - vo).abs()[m] > 0.25).any()
        )
