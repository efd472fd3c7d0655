"""The subgradient rules of torch autograd at ties, as plain-float helpers for the gradient twins.

torch 2.13 (pinned by tests/core/test_core_grad.py::test_torch_tie_rules_are_the_ones_the_twin_states):
``torch.maximum``/``torch.minimum`` give each argument half of the gradient on a tie; ``torch.clamp``
passes the gradient on its closed interval. Used by :mod:`refppo.core.grad` and :mod:`refppo.core.gspo`.
"""

from __future__ import annotations


def shares(x: float, y: float) -> tuple[float, float]:
    """Gradient shares of ``(x, y)`` in ``max(x, y)`` (swap the arguments for ``min``)."""
    if x > y:
        return 1.0, 0.0
    if y > x:
        return 0.0, 1.0
    return 0.5, 0.5


def inside(x: float, lo: float | None, hi: float | None) -> bool:
    """Whether ``clamp(x, lo, hi)`` passes the gradient: ``lo ≤ x ≤ hi`` (None: no bound)."""
    return (lo is None or x >= lo) and (hi is None or x <= hi)


def clamp(x: float, lo: float | None, hi: float | None) -> float:
    """``clamp(x, lo, hi)`` on floats (None: no bound)."""
    if lo is not None and x < lo:
        x = lo
    if hi is not None and x > hi:
        x = hi
    return x
