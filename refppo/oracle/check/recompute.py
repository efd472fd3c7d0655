"""Recompute every quantity of one PPO step from a dump's inputs, through ``refppo.pipeline``.

The rollout half goes through :func:`refppo.pipeline.step.rollout_quantities` and the update half
through :func:`refppo.pipeline.step.update_quantities` — the trainer's own path, the score map,
the ``vf_mask`` choice and the ``approx_kl`` metric included (all of them stages of
:mod:`refppo.pipeline.stages`). The oracle adds the tolerances of rounding ties and, for diagnosis,
a few *known bugs* re-enacted on purpose (:data:`BUGS`).
All arithmetic is float64.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor

from refppo.conventions import LossAgg, ValueLoss, VfMask
from refppo.dump.load import Dump, validate
from refppo.dump.required import check_inputs_for
from refppo.dump.residency import trim_heap
from refppo.dump.tolerances import TOLERANCES
from refppo.oracle.check.grad import GRAD_QUANTITIES, UpdateInputs, reference_grads
from refppo.oracle.check.settings import Setup
from refppo.oracle.check.ties import pg_tie_mask, pg_tie_share, vf_tie_mask, vf_tie_widen
from refppo.pipeline.bugs import BUGS as BUG_TABLE
from refppo.pipeline.bugs import Bug, bug_phases, variant
from refppo.pipeline.stages import BY_NAME, ROLLOUT_STAGES, UPDATE_STAGES, walk
from refppo.pipeline.step import update_quantities

BUGS: dict[str, str] = {name: b.text for name, b in BUG_TABLE.items()}
"""Known bug classes the diagnosis re-enacts, name → what it does (the variants of the stage table
in :data:`refppo.pipeline.bugs.BUGS`; spec/conventions.md, bug catalogue)."""


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


_ROLLOUT_KEEP = ("kl", "token_rewards", "advantages_raw", "advantages", "returns", "value_mask", "mask")
"""What the rollout walk keeps: ``mask`` is the response mask after the rejection gate
(``rollout_rs_effect=drop_mask``: the kept tokens; the dump's mask otherwise), which the quantities
are compared on (a value off the step's mask is not part of the step)."""


def recompute(
    dump: Dump,
    setup: Setup,
    *,
    bug: str | None = None,
    rollout_only: bool = False,
    rollout: Reference | None = None,
) -> Reference:
    """Every quantity the dump's inputs allow, under ``setup`` (and optionally one of :data:`BUGS`).

    ``rollout_only`` stops after the rollout stages (the diagnosis uses it to test a
    candidate explanation of a rollout-stage divergence without paying for the update stage).
    ``rollout``: such a ``rollout_only`` result for the same ``setup`` and ``bug``, continued with
    the update stage instead of recomputing steps 1–4 (the same values: the same calls made them).
    """
    # what earlier stages freed, and the dumped keys they read, are not resident under this one's
    # peak (the keys are paged in again from the file as they are read: Dump.release_mapped)
    dump.release_mapped()
    trim_heap()
    b = None if bug is None else BUG_TABLE[bug]
    check_bug_reads(dump, bug)
    ro = _rollout_reference(dump, setup, b) if rollout is None else rollout
    if rollout_only:
        return ro
    dump.release_mapped()
    trim_heap()
    return _with_update(dump, setup, ro, b)


def check_bug_reads(dump: Dump, bug: str | None) -> None:
    """``ValueError`` (the diagnosis skips the bug) when ``bug`` replaces a stage that reads the KL
    and the dump has no ``ref_logprobs`` (the KL is then None: nothing to re-enact it on)."""
    if bug is None or dump.has("ref_logprobs"):
        return
    if any("kl" in BY_NAME[s].reads for s in BUG_TABLE[bug].stages):
        raise ValueError(f"the bug {bug} reads the KL; the dump has no ref_logprobs")


def _rollout_reference(dump: Dump, setup: Setup, bug: Bug | None) -> Reference:
    """The rollout stages (steps 0–4) walked under ``setup`` and ``bug`` (its variant of the table):
    ``kl`` (the estimate, also with the KL in the loss), ``token_rewards``, ``advantages``, ``returns``."""
    t, m = dump.tensors, dump.mask
    conv, hp = setup.conv, setup.hp
    check_inputs_for(dump, conv.adv.estimator.value, conv, hp)
    q = {
        "scores": t["scores"],
        "old_logprobs": t["old_logprobs"],
        "ref_logprobs": t.get("ref_logprobs"),
        "old_values": t.get("old_values"),
        "mask": m,
        "group_index": t.get("group_index"),
        "bootstrap_values": t.get("bootstrap_values"),
        "truncated": t.get("truncated"),
        "rollout_logprobs": t.get("rollout_logprobs"),  # read by the gate under rollout_rs_effect=drop_mask
    }
    if bug is not None:
        bug.check(t, conv, hp)
        q = bug.swap({**q, "logprobs": t.get("logprobs")}, "rollout")
    out = walk(variant(ROLLOUT_STAGES, bug), q, conv, hp, keep=_ROLLOUT_KEEP)
    # kl None: no ref_logprobs and nothing reads the KL (pipeline.needs.kl_needs): not compared
    keys = ("kl", "token_rewards", "advantages", "returns")
    vals: dict[str, Tensor] = {k: out[k] for k in keys if out[k] is not None}
    return Reference(vals, out["mask"], out["value_mask"], out["advantages_raw"])


def _with_update(dump: Dump, setup: Setup, ro: Reference, bug: Bug | None = None) -> Reference:
    """``ro`` (steps 0–4) plus the update stages' quantities (steps 5–9) the dump allows, walked under
    ``bug``'s variant of the table where it acts there."""
    t, m = dump.tensors, dump.mask
    conv, hp = setup.conv, setup.hp
    if bug is not None and "update" in bug_phases(bug):
        bug.check(t, conv, hp)
    vals = dict(ro.values)
    if not ("logprobs" in t or "values" in t):
        return Reference(vals, ro.mask, ro.value_mask, ro.advantages_raw)
    adv, returns = ro.values["advantages"], ro.values["returns"]
    rtol = TOLERANCES[dump.dtype].rtol
    logprobs = t.get("logprobs", t["old_logprobs"])
    values = t.get("values", t.get("old_values"))
    vf_mask = m if conv.value.mask is VfMask.RESPONSE else ro.value_mask
    own = {"logprobs": logprobs, "old_logprobs": t["old_logprobs"], "ref_logprobs": t.get("ref_logprobs"),
           "rollout_logprobs": t.get("rollout_logprobs")}  # fmt: skip
    old_lp: Tensor = (own if bug is None else bug.swap(own, "update"))["old_logprobs"]  # type: ignore[assignment]  # old_logprobs is always a tensor (own: Tensor | None values)
    stages = variant(UPDATE_STAGES, bug)
    value_replaced = bug is not None and "value" in bug.stages
    uq = update_quantities(
        logprobs=logprobs, values=values, old_logprobs=old_lp, old_values=t.get("old_values"),
        advantages=adv, returns=returns, mask=m, value_mask_=vf_mask, ref_logprobs=t.get("ref_logprobs"),
        entropy=t.get("entropy"), rollout_logprobs=t.get("rollout_logprobs"), truncated=t.get("truncated"),
        group_index=t.get("group_index"), hp=hp, conv=conv, stages=stages,
    )  # fmt: skip
    widen: dict[str, Callable[[], float]] = {}
    if "logprobs" in t:
        vals.update(pg_loss=uq.pg_loss.detach(), pg_clipfrac=uq.pg_clipfrac, approx_kl=uq.approx_kl)
        if uq.kl_metric is not None:  # None: kl_in=loss at β = 0 without ref_logprobs (not read)
            vals["kl_loss"] = uq.kl_metric.detach()  # the logged KL (kl_metric_agg; default the term)
        widen["pg_clipfrac"] = lambda: float(pg_tie_share(logprobs, old_lp, adv, m, setup, rtol))
    if "values" in t and values is not None:
        vals.update(vf_loss=uq.vf_loss.detach(), vf_clipfrac=uq.vf_clipfrac)
        if conv.value.loss is ValueLoss.CLIPPED and not value_replaced:
            eps_v = hp.cliprange_value
            widen["vf_clipfrac"] = lambda: vf_tie_widen(
                values, t["old_values"], returns, vf_mask, eps_v, rtol, conv.value.clip_form
            )
    if "entropy" in t:
        vals["entropy_loss"] = uq.entropy_loss.detach()
    if "logprobs" in t and ("values" in t or "old_values" not in t):
        # separate_critic: the ``loss`` key is the actor's objective (no value term)
        vf_term = hp.vf_coef * uq.vf_loss if dump.step.separate_critic else 0.0
        vals["loss"] = (uq.loss - vf_term).detach()
    inp, grad_setup = _update_inputs(t, setup, logprobs, values, old_lp, adv, returns, m, vf_mask)
    if any(k in t for k in GRAD_QUANTITIES):
        vf_ties = conv.value.loss is ValueLoss.CLIPPED and "old_values" in t and not value_replaced
        eps_v = hp.cliprange_value
        ties = {
            "grad_logprobs": pg_tie_mask(logprobs, old_lp, adv, m, setup, rtol),
            "grad_values": vf_tie_mask(inp.values, inp.old_values, returns, vf_mask, eps_v, rtol)
            if vf_ties
            else torch.zeros_like(m),
        }
        vals.update(reference_grads(inp, grad_setup, t, ties, stages=stages))
    return Reference(vals, ro.mask, ro.value_mask, ro.advantages_raw, widen, inp)


def _update_inputs(
    t: dict[str, Tensor],
    setup: Setup,
    logprobs: Tensor,
    values: Tensor | None,
    old_lp: Tensor,
    adv: Tensor,
    returns: Tensor,
    m: Tensor,
    vf_mask: Tensor,
) -> tuple[UpdateInputs, Setup]:
    """What the gradient reference walks the update with, and its setting: without a critic zero
    stand-ins for the values (one ``[B, T]`` buffer, made only when one is missing) and no value term."""
    critic = "old_values" in t
    if values is not None and critic:
        v_in, ov_in = values, t["old_values"]
    else:
        zeros = torch.zeros_like(t["old_logprobs"])
        v_in = values if values is not None else zeros
        ov_in = t["old_values"] if critic else zeros
    grad_setup = setup if critic else _without_critic(setup)
    entropy = t.get("entropy")
    inp = UpdateInputs(
        logprobs, v_in, old_lp, ov_in, adv, returns, m, vf_mask, t.get("ref_logprobs"), entropy,
        t.get("rollout_logprobs"), t.get("truncated"), t.get("group_index"),
    )  # fmt: skip
    return inp, grad_setup


def _without_critic(setup: Setup) -> Setup:
    """The setting the gradient reference walks a critic-free dump with: ``vf_coef = 0``, and a value
    aggregation the value stage takes (``prompt-mean`` is the policy's only; the term weighs 0)."""
    conv = setup.conv
    if conv.agg.of("value") is LossAgg.PROMPT_MEAN:
        conv = replace(conv, agg=replace(conv.agg, value=LossAgg.TOKEN_MEAN))
    return Setup(conv, replace(setup.hp, vf_coef=0.0))


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
    if not setup.conv.kl.placement.in_loss:
        out.pop("kl_loss", None)
    return out


__all__ = ["BUGS", "Reference", "recompute", "reference_outputs"]
