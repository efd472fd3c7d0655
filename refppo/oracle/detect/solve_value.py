"""The value clip solver of ``--detect``: ``ε_v`` read off ``vf_loss`` (:func:`solve_value_clip`).

The solver's model of the clipped value loss over the valid tokens ``i`` (float64), with
``d_i = V_i − V^old_i``, ``s_i = sign(d_i)``, ``a_i = V^old_i − R_i`` and ``u_i = (V_i − R_i)²``::

    vf(ε) = ½·Σ_i w_i·max(u_i, (clamp(V_i, V^old_i ± ε) − R_i)²)

For ``ε ≥ |d_i|`` token ``i`` is not clipped: its term is ``u_i``. For ``ε < |d_i|`` the clipped
value is ``V^old_i + s_i·ε``, so its term is ``max(u_i, q_i(ε))`` with ``q_i(ε) = (a_i + s_i·ε)²``,
a parabola equal to ``u_i`` at ``ε = |d_i|`` and at ``e_i = −2·a_i·s_i − |d_i|`` and above ``u_i``
outside the two. On ``[0, |d_i|)`` the term is therefore ``q_i(ε)`` below one knot

    k_i = |d_i|          if e_i ≥ |d_i|   (the whole stretch lies left of both roots)
    k_i = max(e_i, 0)    otherwise        (between the roots, ``q_i < u_i``: the term is ``u_i``)

and ``u_i`` from ``k_i`` on: one knot per token. Sorted by knot, ``vf(ε)`` is read off prefix sums
of ``w·u``, ``w·a²``, ``w·a·s`` and ``w`` at the number of knots ``≤ ε`` (one binary search): each
evaluation costs ``O(log n)`` after one sort, where the direct form costs a pass over every token
(it did: 8256 passes, 75 of 94 s of a B=256, T=2048 ``--detect`` that no convention reproduces).
The sort depends on ``V``, ``V^old``, ``R`` and the mask only, so the aggregation modes share it
(:meth:`ValueKnots.weighted`). Proposals only: the value stage evaluates each one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from refppo.oracle.detect.solve import nice


class ValueKnots:
    """The tokens of the value loss sorted by their knot ``k_i`` (module docstring), for any weights."""

    def __init__(self, v: Tensor, v_old: Tensor, ret: Tensor) -> None:
        """``v``, ``v_old``, ``ret``: the valid tokens, flattened, float64."""
        d = v - v_old
        self.d_abs = d.abs()
        """``|V − V^old|`` in token order (the solver's bracketing grid is its quantiles)."""
        s = torch.sign(d)
        a = v_old - ret
        e = -2.0 * a * s - self.d_abs
        k = torch.where(e >= self.d_abs, self.d_abs, e.clamp(min=0.0))
        self.knots, self.order = torch.sort(k)
        self.u = ((v - ret) ** 2)[self.order]
        self.a = a[self.order]
        self.s = s[self.order]
        self._quantiles: dict[int, list[float]] = {}

    @classmethod
    def of(cls, v: Tensor, v_old: Tensor, ret: Tensor, mask: Tensor) -> ValueKnots:
        return cls(v[mask].double(), v_old[mask].double(), ret[mask].double())

    def quantiles(self, grid: int) -> list[float]:
        """``grid`` quantiles of ``|V − V^old|`` from 0 to 1 (memoised: shared by the weights)."""
        if grid not in self._quantiles:
            qs = torch.linspace(0.0, 1.0, grid, dtype=torch.float64)
            self._quantiles[grid] = torch.quantile(self.d_abs, qs).tolist()
        return self._quantiles[grid]

    def weighted(self, w: Tensor) -> ValueTerms:
        """The model under the aggregation weights ``w`` (valid tokens, in token order)."""
        return ValueTerms(self, w[self.order].double())


class ValueTerms:
    """``vf(ε)`` of :class:`ValueKnots` under one aggregation's weights, by prefix sums."""

    def __init__(self, knots: ValueKnots, w: Tensor) -> None:
        self.knots = knots
        zero = torch.zeros(1, dtype=torch.float64)

        def prefix(x: Tensor) -> Tensor:
            return torch.cat([zero, torch.cumsum(x, 0)])

        self.cu = prefix(w * knots.u)
        self.ca2 = prefix(w * knots.a * knots.a)
        self.cas = prefix(w * knots.a * knots.s)
        self.cw = prefix(w)

    @classmethod
    def of(cls, v: Tensor, v_old: Tensor, ret: Tensor, mask: Tensor, w: Tensor) -> ValueTerms:
        """``w``: the aggregation's weights ``[B, T]`` (:func:`refppo.oracle.detect.solve.loss_weights`)."""
        return ValueKnots.of(v, v_old, ret, mask).weighted(w[mask])

    def loss(self, eps: float) -> float:
        """``½·Σ w·max((V−R)², (clamp(V, V_old ± ε) − R)²)`` (the clip forms are equal in exact
        arithmetic): it brackets ε_v, the value stage then evaluates each proposal."""
        j = int(torch.searchsorted(self.knots.knots, torch.tensor([eps], dtype=torch.float64), right=True))
        n = self.cw.numel() - 1
        plain = float(self.cu[j])
        a2, asum, wsum = (float(c[n] - c[j]) for c in (self.ca2, self.cas, self.cw))
        return 0.5 * (plain + a2 + 2.0 * eps * asum + eps * eps * wsum)


def solve_value_clip(terms: ValueTerms, target: float, tol: float, grid: int = 256) -> list[float]:
    """Value clip ranges ``ε_v`` under which the clipped value loss equals ``target``.

    ``vf_loss(ε)`` is continuous and piecewise quadratic in ε (one knot per token, module
    docstring); beyond the largest ``|V − V_old|`` it is the unclipped loss. The roots are bracketed
    on a grid of the quantiles of ``|V − V_old|`` (so every piece with many tokens is sampled) and
    refined by bisection; each is proposed rounded to the shortest round number
    (:func:`refppo.oracle.detect.solve.nice`) whose loss is still within ``tol`` of the target, else
    to 6 significant digits. Proposals only: the pipeline re-checks them.
    """
    d = terms.knots.d_abs
    if d.numel() == 0 or float(d.max()) == 0.0:
        return []
    xs = sorted(set([0.0, *terms.knots.quantiles(grid)]))
    fs = [terms.loss(x) - target for x in xs]
    roots: list[float] = []
    for (a, fa), (b, fb) in zip(zip(xs, fs, strict=True), zip(xs[1:], fs[1:], strict=True), strict=False):
        if fa == 0.0:
            roots.append(a)
        elif fa * fb < 0.0:
            for _ in range(80):
                mid = 0.5 * (a + b)
                fm = terms.loss(mid) - target
                if fm == 0.0:
                    break
                a, fa, b = (mid, fm, b) if fa * fm > 0.0 else (a, fa, mid)
            roots.append(0.5 * (a + b))
    out: list[float] = []
    for r in roots[:8]:
        picks = [c for c in nice(r, rel=1e-2) if abs(terms.loss(c) - target) <= tol]
        out.append(picks[0] if picks else float(f"{r:.6g}"))
    return out


__all__ = ["ValueKnots", "ValueTerms", "solve_value_clip"]
