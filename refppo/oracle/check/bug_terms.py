"""The update-stage terms of the known bugs that :func:`refppo.oracle.check.recompute.recompute` re-enacts
(:data:`refppo.oracle.check.recompute.BUGS`), and the whitening's share of the "advantages not detached"
gradients of :mod:`refppo.oracle.check.grad_diagnose`.

``value_clip_around_new`` — the clipped value taken around the NEW values::

    V^clip_t = V_t + clip(V_t − V^old_t, −ε_v, ε_v)              (the bug)
    V^clip_t = V^old_t + clip(V_t − V^old_t, −ε_v, ε_v)          (every peer; = clip(V_t, V^old_t ± ε_v))
    ℓ^v_t    = ½·max((V_t − R_t)², (V^clip_t − R_t)²)
    vf_loss  = agg(ℓ^v)   (the value loss's aggregation and normalisers, as the pipeline)
    vf_clipfrac = Σ_vm [(V^clip − R)² > (V − R)²] / Σ vm

Inside the range the buggy ``V^clip = 2V − V^old`` carries the gradient twice; at ``V = V^old``
both branches of the max tie and torch shares the gradient ½/½ (``∂ℓ/∂V = 1.5·(V − R)``).

``whitening_vjp`` — advantages built from the live critic output, ``A = w(R − V)``, through the
pipeline's own whitening ``w`` (:func:`refppo.oracle.check.recompute.whiten`), at ``V`` where
``R − V`` equals the raw advantages (the first update after the rollout: ``V = V^old``)::

    ∂pg/∂V_s = Σ_t g_t·∂A_t/∂V_s,     g_t = ∂pg/∂A_t

with the whitening's statistics ``μ, σ`` taken on the live tensor (``live=True``: autograd through
``w``) or as numbers (``live=False``: ``∂A_t/∂V_t = −s``, ``s`` the whitening's slope
``Σ(A − Ā)(x − x̄)/Σ(x − x̄)²`` over the valid tokens: ``1/σ`` of ``masked``, any ``eps_at``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from refppo.conventions import LossAgg, ValueLoss, Whitening
from refppo.core.aggregate import aggregate_masked
from refppo.oracle.check.grad import UpdateInputs
from refppo.oracle.check.settings import Setup
from refppo.pipeline.update import Normalisers, policy_term

Grads = dict[str, Tensor]
Hypothesis = tuple[str, str, Callable[[], Grads]]
"""``(id, description, candidate gradient)``, as :data:`refppo.oracle.check.grad_diagnose.Hypothesis`."""


UPDATE_BUGS = frozenset({"ratio_against_ref", "value_clip_around_new"})
"""The bugs of :data:`refppo.oracle.check.recompute.BUGS` that act in the update stage (steps 5–9) only:
``ratio_against_ref`` swaps ``ref_logprobs`` in for ``old_logprobs`` wherever the policy loss reads
them (the ratio, its clip fraction, ``approx_kl``, and the gradient's ratio)."""


def check_update_bug(tensors: Mapping[str, Tensor], bug: str | None) -> None:
    """Refuse (``ValueError``) an update-stage bug whose inputs the dump does not hold."""
    if bug == "ratio_against_ref" and "logprobs" not in tensors:
        raise ValueError("the bug ratio_against_ref needs logprobs")
    if bug == "value_clip_around_new" and not ("values" in tensors and "old_values" in tensors):
        raise ValueError("the bug value_clip_around_new needs values and old_values")


def value_loss_around_new(
    values: Tensor, old_values: Tensor, returns: Tensor, vmask: Tensor, setup: Setup
) -> tuple[Tensor, Tensor]:
    """``(vf_loss, vf_clipfrac)`` of the bug (module docstring); differentiable in ``values``.

    ``vmask``: the value mask the reference compares the value loss on (bool ``[B, T]``)."""
    hp, conv = setup.hp, setup.conv
    if conv.value_loss is not ValueLoss.CLIPPED:
        raise ValueError("the bug value_clip_around_new needs a clipped value loss (value_loss=clipped)")
    zero = torch.zeros((), dtype=values.dtype)
    v = torch.where(vmask, values, zero)
    v_old = torch.where(vmask, old_values, zero).detach()
    ret = torch.where(vmask, returns, zero).detach()
    eps_v = hp.cliprange_value
    v_clip = v + torch.clamp(v - v_old, min=-eps_v, max=eps_v)
    e1, e2 = (v - ret) ** 2, (v_clip - ret) ** 2
    per_token = torch.where(vmask, 0.5 * torch.maximum(e1, e2), zero)
    agg = conv.loss_agg if conv.value_loss_agg is None else conv.value_loss_agg
    loss = aggregate_masked(per_token, vmask, LossAgg(agg), **Normalisers().kwargs(hp.horizon, value=True))
    with torch.no_grad():
        frac = ((e2 > e1) & vmask).sum().to(values.dtype) / vmask.sum().to(values.dtype)
    return loss, frac


def value_grad_around_new(
    values: Tensor, old_values: Tensor, returns: Tensor, vmask: Tensor, setup: Setup
) -> Tensor:
    """``grad_values`` of the bug: ``vf_coef·∂vf_loss/∂V`` (the only term of ``J`` reading ``V``),
    0 outside ``vmask``."""
    v = values.detach().clone().requires_grad_(True)
    loss, _ = value_loss_around_new(v, old_values, returns, vmask, setup)
    (g,) = torch.autograd.grad(setup.hp.vf_coef * loss, v)
    return torch.where(vmask, g, torch.zeros((), dtype=g.dtype))


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
    from refppo.oracle.check.recompute import whiten  # recompute imports this module

    zero = torch.zeros((), dtype=raw.dtype)
    if not live:
        assert adv is not None
        return torch.where(mask, -whitening_slope(raw, adv, mask) * g_adv, zero)
    v = torch.zeros_like(raw, requires_grad=True)
    a = whiten(raw - v, mask, setup)
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
    neg0 = neg if setup.conv.dual_clip is None else ell(-1.0, setup.with_convention({"dual_clip": None}))[1]
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
    kind = setup.conv.whiten_advantages
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


__all__ = [
    "UPDATE_BUGS",
    "check_update_bug",
    "dpg_dadv",
    "value_grad_around_new",
    "value_loss_around_new",
    "whitened_not_detached",
    "whitening_slope",
    "whitening_vjp",
]
