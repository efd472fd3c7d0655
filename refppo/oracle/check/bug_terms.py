"""The "advantages not detached" gradients of :mod:`refppo.oracle.check.grad_diagnose` (the known
bugs' own re-enactments are variants of the stage table: :mod:`refppo.pipeline.bugs`).

``whitening_vjp`` — advantages built from the live critic output, ``A = w(R − V)``, through the
pipeline's own whitening ``w`` (:func:`refppo.pipeline.rollout.whiten_advantages`), at ``V`` where
``R − V`` equals the raw advantages (the first update after the rollout: ``V = V^old``)::

    ∂pg/∂V_s = Σ_t g_t·∂A_t/∂V_s,     g_t = ∂pg/∂A_t

with the whitening's statistics ``μ, σ`` taken on the live tensor (``live=True``: autograd through
``w``) or as numbers (``live=False``: ``∂A_t/∂V_t = −s``, ``s`` the whitening's slope
``Σ(A − Ā)(x − x̄)/Σ(x − x̄)²`` over the valid tokens: ``1/σ`` of ``masked``, any ``eps_at``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from refppo.conventions import Whitening
from refppo.oracle.check.grad import UpdateInputs
from refppo.oracle.check.settings import Setup
from refppo.pipeline.rollout import whiten_advantages
from refppo.pipeline.update import policy_term

Grads = dict[str, Tensor]
Hypothesis = tuple[str, str, Callable[[], Grads]]
"""``(id, description, candidate gradient)``, as :data:`refppo.oracle.check.grad_diagnose.Hypothesis`."""


def whitening_slope(x: Tensor, adv: Tensor, mask: Tensor) -> float:
    """The slope ``s`` of the affine map ``x ↦ A`` on the valid tokens (least squares; exact up to
    rounding for every whitening kind with its statistics held fixed)."""
    xv, av = x[mask], adv[mask]
    xc = xv - xv.mean()
    den = float((xc * xc).sum())
    return float((xc * (av - av.mean())).sum()) / den if den > 0 else 0.0


def whitening_vjp(
    raw: Tensor, g_adv: Tensor, mask: Tensor, setup: Setup, *, live: bool, adv: Tensor | None = None
) -> Tensor:
    """``Σ_t g_t·∂A_t/∂V_s`` of ``A = w(R − V)`` at ``R − V = raw`` (module docstring), 0 outside
    ``mask``. ``live=False`` needs ``adv`` = ``w(raw)`` (the reference's whitened advantages)."""
    zero = torch.zeros((), dtype=raw.dtype)
    if not live:
        assert adv is not None
        return torch.where(mask, -whitening_slope(raw, adv, mask) * g_adv, zero)
    v = torch.zeros_like(raw, requires_grad=True)
    a = whiten_advantages(raw - v, mask, setup.conv, setup.hp)
    (g,) = torch.autograd.grad(a, v, grad_outputs=torch.where(mask, g_adv, zero))
    return torch.where(mask, g, zero)


def dpg_dadv(inp: UpdateInputs, setup: Setup) -> Tensor:
    """``∂pg_loss/∂A`` ``[B, T]`` (0 outside the mask), by the homogeneity of
    :func:`refppo.oracle.check.grad_diagnose._not_detached` (its docstring has the derivation)."""
    lp = inp.logprobs.detach().clone().requires_grad_(True)

    def ell(sign: float, s: Setup = setup) -> tuple[Tensor, Tensor]:
        a = torch.full_like(inp.advantages, sign)
        out = policy_term(lp, inp.old_logprobs, a, inp.mask, hp=s.hp, conv=s.conv)
        return out.loss, out.per_token

    pos_loss, pos = ell(1.0)
    (w,) = torch.autograd.grad(pos_loss, pos)
    neg = ell(-1.0)[1].detach()
    # at A = 0 the cap −c·A is not applied (the core caps where A < 0 only): ℓ(−1) without it
    neg0 = (
        neg
        if setup.conv.policy.dual_clip is None
        else ell(-1.0, setup.with_convention({"dual_clip": None}))[1]
    )
    pos = pos.detach()
    adv = inp.advantages
    d_ell = torch.where(adv > 0, pos, torch.where(adv < 0, -neg, 0.5 * (pos - neg0.detach())))
    zero = torch.zeros((), dtype=d_ell.dtype)
    return torch.where(inp.mask, w * d_ell, zero)


def whitened_not_detached(
    setup: Setup, inp: UpdateInputs, ref: Grads
) -> list[tuple[str, str, Callable[[], Grads]]]:
    """Advantages from the live critic output AND whitened (``A = w(R − V)``, step 4 on): the
    whitening's statistics held fixed (``−s·∂pg/∂A``, ``s = 1/σ``) or taken on the live values
    (:func:`refppo.oracle.check.bug_terms.whitening_vjp`). None when step 4 is off (the plain
    hypothesis) or for ``center`` with fixed statistics (slope 1: the plain hypothesis)."""
    kind = setup.conv.whiten.advantages
    if kind is Whitening.NONE:
        return []
    raw = inp.returns - inp.old_values  # GAE's raw advantages (returns = A_raw + V_old)
    memo: dict[str, Tensor] = {}

    def make(live: bool) -> Callable[[], Grads]:
        def cand() -> Grads:
            g = memo["g"] = memo["g"] if "g" in memo else dpg_dadv(inp, setup)
            extra = whitening_vjp(raw, g, inp.mask, setup, live=live, adv=inp.advantages)
            return {**ref, "grad_values": ref["grad_values"] + extra}

        return cand

    out: list[Hypothesis] = []
    if kind is not Whitening.CENTER:
        s = whitening_slope(raw, inp.advantages, inp.mask)
        out.append(("advantages_not_detached_whitened", _NOT_DETACHED_WHITENED.format(s=s), make(False)))
    out.append(("advantages_not_detached_whitened_live", _NOT_DETACHED_LIVE, make(True)))
    return out


_NOT_DETACHED_WHITENED = (
    "the advantages are not detached and are whitened: A = (R − V − μ)/σ with V the live critic "
    "output and μ, σ the batch's numbers, so grad_values also carries −∂pg_loss/∂A·(1/σ = {s:.4g})"
)
_NOT_DETACHED_LIVE = (
    "the advantages are not detached and are whitened on the live values: A = (R − V − μ(V))/σ(V), "
    "the mean and std taken on V in the graph, so grad_values also carries −Σ_t ∂pg_loss/∂A_t·∂A_t/∂V"
)


def nonfinite_alike(d: Tensor, r: Tensor, alike: bool = True) -> tuple[Tensor, Tensor]:
    """``(d, r)`` with 0 at the positions where both hold NaN, or the same infinity (``alike``; else
    unchanged): a bug's re-enactment that leaks a NaN reproduces the dump's (NaN never equals NaN)."""
    both = (torch.isnan(d) & torch.isnan(r)) | (torch.isinf(d) & (d == r))
    if not (alike and bool(both.any())):
        return d, r
    return torch.where(both, 0.0, d), torch.where(both, 0.0, r)


__all__ = [
    "dpg_dadv",
    "nonfinite_alike",
    "whitened_not_detached",
    "whitening_slope",
    "whitening_vjp",
]
