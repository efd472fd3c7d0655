"""The full objective PPO minimises, with its signs.

The PPO paper (Schulman et al. 2017, eq. 9) *maximises* ``L_CLIP − c1·L_VF + c2·H``. Trainers
minimise its negation, so with ``pg_loss = −L_CLIP`` (already a loss, see
:mod:`refppo.core.policy`)::

    loss = pg_loss + vf_coef·vf_loss − ent_coef·entropy + kl_coef·kl_loss + ptx_coef·ptx_loss

``entropy`` is the aggregated entropy of the current policy (a *bonus*: more entropy lowers the
loss); ``kl_loss`` is the aggregated per-token KL(π_θ‖π_ref) when KL is placed in the loss
(:class:`~refppo.conventions.KLPlacement` ``loss``), computed on the *current* log-probs;
``ptx_loss`` is InstructGPT's language-modelling loss (mean token NLL on pretraining/SFT text),
which is a cross-entropy on other data, not an entropy term.
"""

from __future__ import annotations

from torch import Tensor

from refppo.conventions import KLEstimator, LossAgg
from refppo.core.aggregate import aggregate_loss, aggregate_loss_naive
from refppo.core.checks import check_nonneg
from refppo.core.kl import LogRatioClamp, token_kl, token_kl_naive
from refppo.types import ResponseMask, Scalar, TokenFloat


def entropy_bonus(
    entropy: TokenFloat, mask: ResponseMask, agg: LossAgg | str = LossAgg.TOKEN_MEAN, **norm: float
) -> Scalar:
    """``agg(H_t)`` over valid tokens — the entropy term, to be *subtracted* (× ent_coef)."""
    return aggregate_loss(entropy, mask, agg, **norm)


def entropy_bonus_naive(
    entropy: TokenFloat, mask: ResponseMask, agg: LossAgg | str = LossAgg.TOKEN_MEAN, **norm: float
) -> Scalar:
    """Naive twin of :func:`entropy_bonus`."""
    return aggregate_loss_naive(entropy, mask, agg, **norm)


def kl_loss(
    logp: TokenFloat,
    logp_ref: TokenFloat,
    mask: ResponseMask,
    estimator: KLEstimator | str = KLEstimator.K3,
    agg: LossAgg | str = LossAgg.TOKEN_MEAN,
    *,
    log_ratio_clamp: LogRatioClamp | None = None,
    value_clamp: float | None = None,
    logp_old: TokenFloat | None = None,
    grad_is_clip: float | None = None,
    **norm: float,
) -> Scalar:
    """``agg(KL_t(π_θ‖π_ref))`` on the *current* log-probs (KL in the loss; verl ``use_kl_loss``);
    ``grad_is_clip``: its gradient importance-weighted on ``logp_old`` (:mod:`refppo.core.kl`)."""
    kl = token_kl(
        logp, logp_ref, mask, estimator, log_ratio_clamp=log_ratio_clamp, value_clamp=value_clamp,
        logp_old=logp_old, grad_is_clip=grad_is_clip,
    )  # fmt: skip
    return aggregate_loss(kl, mask, agg, **norm)


def kl_loss_naive(
    logp: TokenFloat,
    logp_ref: TokenFloat,
    mask: ResponseMask,
    estimator: KLEstimator | str = KLEstimator.K3,
    agg: LossAgg | str = LossAgg.TOKEN_MEAN,
    *,
    log_ratio_clamp: LogRatioClamp | None = None,
    value_clamp: float | None = None,
    logp_old: TokenFloat | None = None,
    grad_is_clip: float | None = None,
    **norm: float,
) -> Scalar:
    """Naive twin of :func:`kl_loss` (the importance weight changes no value)."""
    kl = token_kl_naive(
        logp, logp_ref, mask, estimator, log_ratio_clamp=log_ratio_clamp, value_clamp=value_clamp,
        logp_old=logp_old, grad_is_clip=grad_is_clip,
    )  # fmt: skip
    return aggregate_loss_naive(kl, mask, agg, **norm)


def _check_coefs(vf_coef: float, ent_coef: float, kl_coef: float, ptx_coef: float) -> None:
    """The coefficients of :func:`total_loss` (and its naive twin): finite and ``>= 0``."""
    for name, c in (
        ("vf_coef", vf_coef),
        ("ent_coef", ent_coef),
        ("kl_coef", kl_coef),
        ("ptx_coef", ptx_coef),
    ):
        check_nonneg(name, c)


def total_loss(
    pg_loss: Scalar,
    vf_loss: Scalar | None = None,
    entropy: Scalar | None = None,
    kl_loss_value: Scalar | None = None,
    ptx_loss: Scalar | None = None,
    *,
    vf_coef: float = 0.0,
    ent_coef: float = 0.0,
    kl_coef: float = 0.0,
    ptx_coef: float = 0.0,
) -> Scalar:
    """``pg + vf_coef·vf − ent_coef·H + kl_coef·kl + ptx_coef·ptx`` (terms given as None count 0)."""
    _check_coefs(vf_coef, ent_coef, kl_coef, ptx_coef)
    loss: Tensor = pg_loss
    if vf_loss is not None:
        loss = loss + vf_coef * vf_loss
    if entropy is not None:
        loss = loss - ent_coef * entropy
    if kl_loss_value is not None:
        loss = loss + kl_coef * kl_loss_value
    if ptx_loss is not None:
        loss = loss + ptx_coef * ptx_loss
    return loss


def total_loss_naive(
    pg_loss: float,
    vf_loss: float | None = None,
    entropy: float | None = None,
    kl_loss_value: float | None = None,
    ptx_loss: float | None = None,
    *,
    vf_coef: float = 0.0,
    ent_coef: float = 0.0,
    kl_coef: float = 0.0,
    ptx_coef: float = 0.0,
) -> float:
    """Naive twin of :func:`total_loss` on Python floats."""
    _check_coefs(vf_coef, ent_coef, kl_coef, ptx_coef)
    total = pg_loss
    total += vf_coef * (vf_loss or 0.0)
    total -= ent_coef * (entropy or 0.0)
    total += kl_coef * (kl_loss_value or 0.0)
    total += ptx_coef * (ptx_loss or 0.0)
    return total
