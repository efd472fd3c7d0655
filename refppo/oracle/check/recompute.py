"""Recompute every quantity of one PPO step from a dump's inputs, through ``refppo.pipeline``.

The rollout half goes through :func:`refppo.pipeline.rollout.rollout_quantities` and the update half
through :func:`refppo.pipeline.update.update_quantities` — the trainer's own path, the score map
(``score_bias``, ``score_scale``, ``score_clip``) included (the pipeline's step 0,
:func:`refppo.pipeline.rollout.clipped_scores`, imported here for the oracle's fast paths). The oracle adds
only what sits around the pipeline: the ``vf_mask`` choice, TRL's
``approx_kl`` metric and, for diagnosis, a few *known bugs* re-enacted on purpose (:data:`BUGS`).
All arithmetic is float64.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor

from refppo.conventions import (
    AdvantageEstimator,
    GaeHoles,
    KLPlacement,
    PolicyLoss,
    ValueLoss,
    Variance,
    WhitenHoles,
)
from refppo.core.by_rows import row_blocks
from refppo.core.checks import count_true
from refppo.core.gae import envelope
from refppo.core.gspo import gspo_policy_loss
from refppo.core.kl import token_kl
from refppo.core.normalize import normalize
from refppo.core.policy import policy_ratio
from refppo.dump.load import TOLERANCES, Dump, check_inputs_for, trim_heap, validate
from refppo.oracle.check.bug_terms import check_update_bug, value_grad_around_new, value_loss_around_new
from refppo.oracle.check.grad import GRAD_QUANTITIES, UpdateInputs, reference_grads
from refppo.oracle.check.settings import Setup
from refppo.pipeline.blocks import gae_by_rows, update_rows
from refppo.pipeline.rollout import clipped_scores, rollout_quantities
from refppo.pipeline.update import update_quantities

PIPELINE_ORDER: tuple[str, ...] = (
    "kl",
    "token_rewards",
    "advantages",
    "returns",
    "pg_loss",
    "pg_clipfrac",
    "approx_kl",
    "vf_loss",
    "vf_clipfrac",
    "entropy_loss",
    "kl_loss",
    "loss",
    "grad_logprobs",
    "grad_values",
)
"""Pipeline order: the first quantity in this order that differs is the first divergence."""

BUGS: dict[str, str] = {
    "kl_from_current_logprobs": "the reward KL is computed from the current log-probs (`logprobs`) "
    "instead of the rollout log-probs (`old_logprobs`)",
    "gae_bootstrap_from_padding": "the last valid token bootstraps from the value of the first padded "
    "slot, V[L] (junk), instead of 0: the next value is read without the mask",
    "gae_through_padding": "GAE recursion runs through the padding with unmasked values: padded slots "
    "add TD residuals γ·V[t+1] − V[t] that flow back into the valid tokens",
    "whiten_over_padding": "advantage whitening takes its mean/variance over all B·T positions, "
    "padding included (an unmasked mean/variance)",
    "kl_reward_sign_flipped": "the KL penalty is added to the reward with the wrong sign at every token: "
    "r_t = +β·KL_t instead of −β·KL_t (the reward pays for drifting from the reference)",
    "ratio_against_ref": "the policy ratio is taken against the reference log-probs, "
    "exp(log π − log π_ref), instead of the rollout log-probs (old_logprobs)",
    "value_clip_around_new": "the clipped value is taken around the NEW values, V + clip(V − V_old, ±ε_v), "
    "instead of around the rollout values, V_old + clip(V − V_old, ±ε_v)",
}
"""Known bug classes the diagnosis re-enacts (see spec/conventions.md, bug catalogue)."""


@dataclass(frozen=True)
class Reference:
    """The reference values (float64) plus the masks each [B, T] quantity is compared on."""

    values: dict[str, Tensor]
    mask: Tensor
    """Response mask (policy side)."""
    value_mask: Tensor
    """Mask of GAE / returns / token_rewards: the response mask plus the score slot."""
    advantages_raw: Tensor | None
    """GAE's (or the critic-free estimator's) advantages before whitening; None in a :meth:`slim`
    reference."""
    widen: dict[str, Callable[[], float]] = field(default_factory=dict)
    """Extra tolerance of the clip fractions (rounding ties: :func:`pg_tie_share`, :func:`vf_tie_widen`)."""
    update_inputs: UpdateInputs | None = None
    """What ``update_quantities`` was given (the gradient diagnosis re-runs it on variants)."""

    def slim(self, keep: tuple[str, ...] = ()) -> Reference:
        """This rollout-only reference with what the update stage reads (``advantages``,
        ``returns``, the masks) and ``keep``: for ``recompute(rollout=...)`` once the rollout
        quantities have been compared (``compare_all(known=...)``), so that ``kl``,
        ``token_rewards`` and the raw advantages (three ``[B, T]`` tensors) are not held while the
        update stage allocates its own."""
        vals = {k: v for k, v in self.values.items() if k in ("advantages", "returns") or k in keep}
        return replace(self, values=vals, advantages_raw=None)

    def compare_mask(self, name: str) -> Tensor | None:
        """Positions compared for a [B, T] quantity; None for a scalar. Gradients: every position
        (padding compared with 0)."""
        if name in GRAD_QUANTITIES:
            return torch.ones_like(self.mask)
        if name in ("token_rewards", "returns"):
            return self.value_mask
        if name in ("kl", "advantages"):
            return self.mask
        return None


def whiten(adv_raw: Tensor, mask: Tensor, setup: Setup) -> Tensor:
    """The pipeline's normalisation (step 4), for re-enacted bugs and the stage search.

    Over ``mask``, or its envelope (holes included) under ``whiten_holes=include``, as the pipeline.
    """
    conv, hp = setup.conv, setup.hp
    return normalize(
        adv_raw,
        envelope(mask) if conv.whiten_holes is WhitenHoles.INCLUDE else mask,
        conv.whiten_advantages,
        unbiased=conv.whiten_variance is Variance.UNBIASED,
        eps=hp.whiten_eps,
        eps_at=conv.whiten_eps_at,
    )


def reference_kl(dump: Dump, setup: Setup, logp: Tensor | None = None) -> Tensor:
    """``kl`` as the dump format defines it: the estimator on ``old_logprobs`` vs ``ref_logprobs``."""
    t = dump.tensors
    c = setup.conv
    return token_kl(
        t["old_logprobs"] if logp is None else logp,
        t["ref_logprobs"],
        dump.mask,
        c.kl_estimator,
        log_ratio_clamp=c.kl_log_ratio_clamp,
        value_clamp=c.kl_value_clamp,
    )


def approx_kl_k2_all_positions(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """TRL's ``approxkl``: ``½·mean((l − l_old)²)`` over all B·T positions, padding counted as 0.

    ``d = l − l_old`` is made once and masked and squared in place (one float ``[B, T]`` buffer and
    one bool: the inverted mask), then summed as a whole: the same elementwise values and the same
    sum as ``where(m, l − l_old, 0)`` squared out of place (three float ``[B, T]`` temporaries)."""
    d = logprobs - old_logprobs
    d.masked_fill_(mask.logical_not(), 0.0)
    return 0.5 * d.mul_(d).sum() / d.numel()


def pg_tie_share(
    logprobs: Tensor, old: Tensor, adv: Tensor, mask: Tensor, setup: Setup, rtol: float
) -> Tensor:
    """Share of valid tokens of :func:`pg_tie_mask`."""
    near = pg_tie_mask(logprobs, old, adv, mask, setup, rtol)
    return count_true(near).to(logprobs.dtype) / count_true(mask).to(logprobs.dtype)  # no int64 mask copies


def _clip_ratio(logprobs: Tensor, old: Tensor, adv: Tensor, mask: Tensor, setup: Setup) -> Tensor:
    """The ratio the policy loss clips, from the core: the token ratio (after the log-ratio clamp),
    or GSPO's sequence ratio on every token of its row (``policy_loss=gspo``)."""
    c, hp = setup.conv, setup.hp
    if c.policy_loss is PolicyLoss.GSPO:
        out = gspo_policy_loss(
            logprobs, old, adv, mask, clip_low=hp.cliprange, clip_high=hp.cliprange_high,
            log_ratio_max=c.log_ratio_clamp,
        )  # fmt: skip
        return out.ratio.detach()
    return policy_ratio(logprobs, old, mask, log_ratio_clamp=c.log_ratio_clamp)


def pg_tie_mask(
    logprobs: Tensor, old: Tensor, adv: Tensor, mask: Tensor, setup: Setup, rtol: float
) -> Tensor:
    """Valid tokens (A ≠ 0) whose ratio lies within ``rtol`` of a clip boundary ``1 ± ε`` (or of
    the dual-clip constant ``c``), or whose advantage is within ``rtol·max|A|`` of 0.

    ``pg_clipfrac`` counts tokens where the clipped branch is *strictly* larger; on a boundary that
    decision is a tie that the trainer's rounding (its dtype) breaks either way, so the tolerance of
    ``pg_clipfrac`` is widened by this share.
    """
    zero = torch.zeros((), dtype=logprobs.dtype)
    ratio = _clip_ratio(logprobs, old, adv, mask, setup)
    hi = setup.hp.cliprange_high if setup.hp.cliprange_high is not None else setup.hp.cliprange
    near = ((ratio - (1.0 - setup.hp.cliprange)).abs() <= rtol * ratio) | (
        (ratio - (1.0 + hi)).abs() <= rtol * ratio
    )
    if setup.conv.dual_clip is not None:
        near |= (ratio - setup.conv.dual_clip).abs() <= rtol * ratio
    a = torch.where(mask, adv, zero)
    tiny_adv = (a.abs() <= rtol * a.abs().max()) & (a != 0)  # the sign of A decides which branch is larger
    return (near | tiny_adv) & mask


def vf_tie_widen(
    values: Tensor, old: Tensor, returns: Tensor, mask: Tensor, eps_v: float, rtol: float
) -> float:
    """Share of value-mask tokens of :func:`vf_tie_mask`. The mask is elementwise, so it is counted
    by blocks of about :data:`refppo.pipeline.blocks.ROW_BLOCK_ELEMENTS` rows (exact integer counts: the
    same share bit for bit, without the whole batch's ~12 ``[B, T]`` temporaries)."""
    B = mask.shape[0]
    step = update_rows(mask) or B
    n = 0
    for r in row_blocks(B, step):
        n += int(count_true(vf_tie_mask(values[r], old[r], returns[r], mask[r], eps_v, rtol)))
    near = torch.tensor(n, dtype=torch.int64)
    return float(near.to(values.dtype) / count_true(mask).to(values.dtype))


def vf_tie_mask(
    values: Tensor, old: Tensor, returns: Tensor, mask: Tensor, eps_v: float, rtol: float
) -> Tensor:
    """Extra tolerance of ``vf_clipfrac``: the value-mask tokens whose count is a real tie.

    ``vf_clipfrac`` counts ``(V_clip − R)² > (V − R)²`` strictly. Two kinds of token sit on that
    edge whatever the trainer's clip form: ``|V − V_old|`` within ``rtol`` of ``ε_v`` (on the clip
    boundary), and ``V`` outside the range with ``R`` at the midpoint of ``V`` and ``V_clip`` (equal
    squared errors). Tokens strictly *inside* the range are not widened for: there the two forms of
    the clipped value (``value_clip_form`` = ``around_old`` / ``delta``) may differ by one rounding
    step, and which one the trainer used is a convention, checked exactly, not a tolerance.
    """
    zero = torch.zeros((), dtype=values.dtype)
    v, vo, r = (torch.where(mask, x, zero) for x in (values, old, returns))
    dist = (v - vo).abs()
    boundary = (dist - eps_v).abs() <= rtol * (v.abs() + vo.abs() + eps_v)
    v_clip = torch.maximum(torch.minimum(v, vo + eps_v), vo - eps_v)
    e1, e2 = (v - r) ** 2, (v_clip - r) ** 2
    midpoint = (dist > eps_v) & ((e2 - e1).abs() <= rtol * (e1 + e2))
    return (boundary | midpoint) & mask


_GAE_BUGS = frozenset({"gae_bootstrap_from_padding", "gae_through_padding"})

ROLLOUT_QUANTITIES = frozenset({"kl", "token_rewards", "advantages", "returns"})
"""The quantities of steps 1–4 (:func:`refppo.pipeline.rollout.rollout_quantities`); the rest need the
update."""


def recompute(
    dump: Dump,
    setup: Setup,
    *,
    bug: str | None = None,
    rollout_only: bool = False,
    rollout: Reference | None = None,
) -> Reference:
    """Every quantity the dump's inputs allow, under ``setup`` (and optionally one of :data:`BUGS`).

    ``rollout_only`` stops after :data:`ROLLOUT_QUANTITIES` (the diagnosis uses it to test a
    candidate explanation of a rollout-stage divergence without paying for the update stage).
    ``rollout``: such a ``rollout_only`` result for the same ``setup`` and ``bug``, continued with
    the update stage instead of recomputing steps 1–4 (the same values: the same calls made them).
    """
    # what earlier stages freed, and the dumped keys they read, are not resident under this one's
    # peak (the keys are paged in again from the file as they are read: Dump.release_mapped)
    dump.release_mapped()
    trim_heap()
    ro = _rollout_reference(dump, setup, bug) if rollout is None else rollout
    if rollout_only:
        return ro
    dump.release_mapped()
    trim_heap()
    return _with_update(dump, setup, ro, bug)


def _rollout_reference(dump: Dump, setup: Setup, bug: str | None) -> Reference:
    """Steps 1–4 under ``setup`` and ``bug``: :data:`ROLLOUT_QUANTITIES` only."""
    t = dump.tensors
    m = dump.mask
    conv, hp, ex = setup.conv, setup.hp, setup.extras
    check_inputs_for(dump, conv.advantage.value)
    if bug in _GAE_BUGS and conv.advantage is not AdvantageEstimator.GAE:
        raise ValueError(f"the bug {bug} needs GAE (advantage=gae)")
    scores = clipped_scores(t["scores"], ex.score_clip, ex.score_bias, ex.score_scale)
    kl_logp = t["old_logprobs"]
    if bug == "kl_from_current_logprobs":
        if "logprobs" not in t:
            raise ValueError("this bug needs logprobs")
        kl_logp = t["logprobs"]
    # With the KL in the loss the pipeline zeroes its KL (no reward term), but the dump's `kl` is
    # still the estimate: computed once here and handed to the pipeline's step 1 (the same call).
    kl_loss_side = reference_kl(dump, setup, kl_logp) if conv.kl_in is KLPlacement.LOSS else None
    kl_in = kl_loss_side
    if bug == "kl_reward_sign_flipped":  # step 1's estimate negated: step 2's −β·(−KL) = +β·KL
        if conv.kl_in is not KLPlacement.REWARD or hp.kl_coef == 0:
            raise ValueError("the bug kl_reward_sign_flipped needs a reward KL (kl_in=reward, kl_coef > 0)")
        kl_loss_side = reference_kl(dump, setup, kl_logp)
        kl_in = -kl_loss_side
    rq = rollout_quantities(
        scores=scores,
        old_logprobs=kl_logp,
        ref_logprobs=t["ref_logprobs"],
        old_values=t.get("old_values"),
        mask=m,
        hp=hp,
        conv=conv,
        group_index=t.get("group_index"),
        kl=kl_in,
    )
    adv_raw, returns, adv = rq.advantages_raw, rq.returns, rq.advantages
    if bug == "gae_through_padding":
        everywhere = torch.ones_like(m)
        adv_raw, returns = gae_by_rows(
            rq.token_rewards, t["old_values"], everywhere, gamma=hp.gamma, lam=hp.lam, holes=GaeHoles.SKIP
        )
        adv = whiten(adv_raw, m, setup)
    elif bug == "gae_bootstrap_from_padding":
        vm = rq.value_mask
        B, T = vm.shape
        last = torch.where(vm, torch.arange(T).expand(B, T), torch.full((B, T), -1)).amax(dim=1)
        nxt = torch.clamp(last + 1, max=T - 1)
        boot = torch.where(last + 1 < T, t["old_values"].gather(1, nxt.unsqueeze(1)).squeeze(1), 0.0)
        onehot = torch.nn.functional.one_hot(last, num_classes=T).to(torch.bool)
        r_bug = rq.token_rewards + torch.where(onehot, hp.gamma * boot.unsqueeze(1), 0.0)
        adv_raw, returns = gae_by_rows(
            r_bug, t["old_values"], vm, gamma=hp.gamma, lam=hp.lam, holes=conv.gae_holes
        )
        adv = whiten(adv_raw, m, setup)
    elif bug == "whiten_over_padding":
        adv = torch.where(m, whiten(adv_raw, torch.ones_like(m), setup), torch.zeros((), dtype=adv_raw.dtype))
    vals: dict[str, Tensor] = {
        # with the KL in the reward, rq.kl is this very estimate (same call): reuse it
        "kl": rq.kl if kl_loss_side is None else kl_loss_side,
        "token_rewards": rq.token_rewards,
        "advantages": adv,
        "returns": returns,
    }
    return Reference(vals, m, rq.value_mask, adv_raw)


def _with_update(dump: Dump, setup: Setup, ro: Reference, bug: str | None = None) -> Reference:
    """``ro`` (steps 1–4) plus the update stage's quantities (steps 5–9) the dump allows, under
    ``bug`` where it acts here (:data:`refppo.oracle.check.bug_terms.UPDATE_BUGS`)."""
    t = dump.tensors
    m = dump.mask
    conv, hp, ex = setup.conv, setup.hp, setup.extras
    adv, returns = ro.values["advantages"], ro.values["returns"]
    widen: dict[str, Callable[[], float]] = {}
    rtol = TOLERANCES[dump.dtype].rtol
    vals = dict(ro.values)
    check_update_bug(dump.tensors, bug)
    # the log-probs the policy ratio divides by: the reference's under ratio_against_ref
    old_lp = t["ref_logprobs"] if bug == "ratio_against_ref" else t["old_logprobs"]
    if "logprobs" in t or "values" in t:
        logprobs = t.get("logprobs", t["old_logprobs"])
        values = t.get("values", t.get("old_values"))
        vf_mask = ro.value_mask if ex.vf_mask == "value" else m
        uq = update_quantities(
            logprobs=logprobs,
            values=values,
            old_logprobs=old_lp,
            old_values=t.get("old_values"),
            advantages=adv,
            returns=returns,
            mask=m,
            value_mask_=vf_mask,
            ref_logprobs=t["ref_logprobs"],
            entropy=t.get("entropy"),
            hp=hp,
            conv=conv,
        )
        if "logprobs" in t:
            vals["pg_loss"] = uq.pg_loss.detach()
            vals["pg_clipfrac"] = uq.pg_clipfrac
            widen["pg_clipfrac"] = lambda: float(pg_tie_share(logprobs, old_lp, adv, m, setup, rtol))
            if ex.approx_kl == "k2_all_positions":
                vals["approx_kl"] = approx_kl_k2_all_positions(logprobs, old_lp, m)
            elif ex.approx_kl == "neg_k1":
                vals["approx_kl"] = -uq.approx_kl
            else:
                vals["approx_kl"] = uq.approx_kl
            vals["kl_loss"] = uq.kl_loss.detach()
        vf_loss = uq.vf_loss.detach()
        if "values" in t and values is not None and bug == "value_clip_around_new":
            vf_loss, vals["vf_clipfrac"] = value_loss_around_new(
                values, t["old_values"], returns, vf_mask, setup
            )
            vals["vf_loss"] = vf_loss = vf_loss.detach()
        elif "values" in t and values is not None:
            vals["vf_loss"] = vf_loss
            vals["vf_clipfrac"] = uq.vf_clipfrac
            if conv.value_loss is ValueLoss.CLIPPED:
                widen["vf_clipfrac"] = lambda: vf_tie_widen(
                    values, t["old_values"], returns, vf_mask, hp.cliprange_value, rtol
                )
        if "entropy" in t:
            vals["entropy_loss"] = uq.entropy_loss.detach()
        if "logprobs" in t and ("values" in t or "old_values" not in t):
            # separate_critic: the ``loss`` key is the actor's objective (no value term)
            loss = uq.loss
            if dump.step.separate_critic:
                loss = loss - hp.vf_coef * uq.vf_loss
            elif bug == "value_clip_around_new":  # the bug's value term in place of the pipeline's
                loss = loss + hp.vf_coef * (vf_loss - uq.vf_loss)
            vals["loss"] = loss.detach()
        grad_setup, critic = setup, "old_values" in t
        if values is not None and critic:
            v_in, ov_in = values, t["old_values"]
        else:  # zero stand-ins, one [B, T] buffer for both, made only when one is missing
            zeros = torch.zeros_like(t["old_logprobs"])
            v_in = values if values is not None else zeros
            ov_in = t["old_values"] if critic else zeros
        if not critic:  # no critic: zero stand-ins and no value term (grad_values needs values: refused)
            grad_setup = Setup(conv, ex, replace(hp, vf_coef=0.0))
        inp = UpdateInputs(
            logprobs,
            v_in,
            old_lp,
            ov_in,
            adv,
            returns,
            m,
            vf_mask,
            t["ref_logprobs"],
            t.get("entropy"),
        )
        if any(k in t for k in GRAD_QUANTITIES):
            ties = {
                "grad_logprobs": pg_tie_mask(logprobs, old_lp, adv, m, setup, rtol),
                "grad_values": vf_tie_mask(v_in, ov_in, returns, vf_mask, hp.cliprange_value, rtol)
                if conv.value_loss is ValueLoss.CLIPPED and critic and bug != "value_clip_around_new"
                else torch.zeros_like(m),
            }
            vals.update(reference_grads(inp, grad_setup, t, ties))
            if bug == "value_clip_around_new" and "grad_values" in t:
                vals["grad_values"] = value_grad_around_new(v_in, ov_in, returns, vf_mask, setup)
        return Reference(vals, m, ro.value_mask, ro.advantages_raw, widen, inp)
    return Reference(vals, m, ro.value_mask, ro.advantages_raw, widen)


def reference_outputs(
    inputs: dict[str, Tensor], setup: Setup, *, bug: str | None = None, dtype: torch.dtype = torch.float64
) -> dict[str, Tensor]:
    """The trainer outputs refppo itself would dump for ``inputs`` (used by tests and examples).

    ``inputs`` holds the dump's input keys (``response_mask``, ``old_logprobs``, ...). Returns every
    output key, cast to ``dtype``; the KL-loss scalar is included only with ``kl_in=loss``.
    """
    d = validate(Path("<memory>"), dict(inputs))
    ref = recompute(d, setup, bug=bug)
    out = {k: v.to(dtype) for k, v in ref.values.items()}
    if setup.conv.kl_in is not KLPlacement.LOSS:
        out.pop("kl_loss", None)
    return out


__all__ = ["BUGS", "PIPELINE_ORDER", "ROLLOUT_QUANTITIES", "Reference", "recompute", "reference_outputs"]
