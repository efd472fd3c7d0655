"""Known bugs of PPO trainers as variants of the stage table: a bug replaces a stage's function or
the quantities a phase reads, nothing beside it (the oracle's diagnosis re-enacts each:
:func:`refppo.oracle.check.diagnose.explain`; spec/conventions.md, bug catalogue).

=========================== ============== =====================================================
bug                         replaces       how
=========================== ============== =====================================================
kl_from_current_logprobs    rollout input  ``old_logprobs`` := ``logprobs`` (the KL stage reads the
                                           current log-probs)
gae_bootstrap_from_padding  advantages     GAE with ``r_{L−1} += γ·V[L]`` (the first padded value)
gae_through_padding         advantages     GAE over every position, the values as given
whiten_over_padding         whitening      the moments over all B·T positions
kl_reward_sign_flipped      rewards,       the reward's KL negated: ``r_t = +β·KL_t`` (and the
                            advantages     critic-free estimators' return-to-go of it)
ratio_against_ref           update input   ``old_logprobs`` := ``ref_logprobs`` (the ratio, its
                                           clip fraction, ``approx_kl`` and their gradient)
value_clip_around_new       value          ``V^clip = V + clip(V − V^old, ±ε_v)``
=========================== ============== =====================================================

:func:`variant` gives the stages with a bug's replacements; :func:`affected` the quantities a bug
can change (its replaced stages and what they feed); :meth:`Bug.check` refuses a bug the inputs or
the convention cannot run (``ValueError``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from refppo.conventions import GaeHoles, ValueLoss, VfMask
from refppo.pipeline import rollout as ro
from refppo.pipeline.blocks import Evaluation, gae_by_rows
from refppo.pipeline.bugs_base import Bug
from refppo.pipeline.bugs_rollout import ROLLOUT_BUGS
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.stage_graph import downstream
from refppo.pipeline.stages import STAGES, Stage, StageFn

Q = Mapping[str, Any]


def variant(stages: Sequence[Stage], bug: Bug | None) -> tuple[Stage, ...]:
    """``stages`` with ``bug``'s replaced functions (the naive twin is not replaced)."""
    if bug is None:
        return tuple(stages)
    return tuple(replace(s, fn=bug.stages[s.name]) if s.name in bug.stages else s for s in stages)


def affected(bug: Bug) -> frozenset[str]:
    """Every quantity ``bug`` can change: what its replaced stages, and the stages of its phase that
    read a swapped input, make, and everything downstream of that."""
    first = set(bug.stages)
    first |= {s.name for s in STAGES if s.phase == bug.phase and set(bug.inputs) & set(s.reads)}
    return downstream(first)


def _negated_kl(fn: StageFn) -> StageFn:
    def run(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> Mapping[str, Any]:
        return fn({**q, "kl": -q["kl"]}, conv, hp, ev)

    return run


def _gae_through_padding(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """GAE over every position with the values as given (holes skipped as there are none)."""
    everywhere = torch.ones_like(q["mask"])
    adv_raw, returns = gae_by_rows(
        q["token_rewards"], q["old_values"], everywhere, gamma=hp.gamma, lam=hp.lam, holes=GaeHoles.SKIP
    )
    return {"advantages_raw": adv_raw, "returns": returns}


def _gae_bootstrap_from_padding(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """GAE over the value mask whose last valid slot ``L−1`` bootstraps from ``V[L]`` (junk)."""
    vm, values = q["value_mask"], q["old_values"]
    B, T = vm.shape
    last = torch.where(vm, torch.arange(T).expand(B, T), torch.full((B, T), -1)).amax(dim=1)
    nxt = torch.clamp(last + 1, max=T - 1)
    boot = torch.where(last + 1 < T, values.gather(1, nxt.unsqueeze(1)).squeeze(1), 0.0)
    onehot = torch.nn.functional.one_hot(last, num_classes=T).to(torch.bool)
    r_bug = q["token_rewards"] + torch.where(onehot, hp.gamma * boot.unsqueeze(1), 0.0)
    adv_raw, returns = gae_by_rows(r_bug, values, vm, gamma=hp.gamma, lam=hp.lam, holes=conv.adv.gae_holes)
    return {"advantages_raw": adv_raw, "returns": returns}


def _whiten_over_padding(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """The advantage whitening's moments over every position, padding included; 0 on padding."""
    m = q["mask"]
    adv = ro.whiten_advantages(q["advantages_raw"], torch.ones_like(m), conv, hp)
    return {"advantages": torch.where(m, adv, torch.zeros((), dtype=adv.dtype))}


def _value_clip_around_new(q: Q, conv: Convention, hp: Hyperparams, ev: Evaluation) -> dict[str, Tensor]:
    """The value stage with ``V^clip = V + clip(V − V^old, ±ε_v)``: ``ℓ^v = ½·max((V − R)², (V^clip −
    R)²)`` and ``vf_clipfrac`` over the value stage's mask (differentiable in ``values``)."""
    vm: Tensor = q["mask"] if conv.value.mask is VfMask.RESPONSE else q["value_mask"]
    zero = torch.zeros((), dtype=q["values"].dtype)
    v = torch.where(vm, q["values"], zero)
    v_old = torch.where(vm, q["old_values"], zero).detach()
    ret = torch.where(vm, q["returns"], zero).detach()
    eps_v = hp.cliprange_value
    v_clip = v + torch.clamp(v - v_old, min=-eps_v, max=eps_v)
    e1, e2 = (v - ret) ** 2, (v_clip - ret) ** 2
    per_token = torch.where(vm, 0.5 * torch.maximum(e1, e2), zero)
    with torch.no_grad():
        frac = ((e2 > e1) & vm).sum().to(v.dtype) / vm.sum().to(v.dtype)
    return {"vf_per_token": per_token, "vf_clipfrac": frac, "vf_loss_mask": vm}


def _reward_kl(conv: Convention, hp: Hyperparams) -> str | None:
    ok = conv.kl.placement.in_reward and hp.kl_coef != 0
    return None if ok else "a reward KL (kl_in=reward, kl_coef > 0)"


def _clipped_value(conv: Convention, hp: Hyperparams) -> str | None:
    ok = conv.value.loss is ValueLoss.CLIPPED
    return None if ok else "a clipped value loss (value_loss=clipped)"


BUGS: dict[str, Bug] = {
    b.name: b
    for b in (
        Bug(
            "kl_from_current_logprobs",
            "the reward KL is computed from the current log-probs (`logprobs`) instead of the rollout "
            "log-probs (`old_logprobs`)",
            inputs={"old_logprobs": "logprobs"},
            needs=("logprobs",),
        ),
        Bug(
            "gae_bootstrap_from_padding",
            "the last valid token bootstraps from the value of the first padded slot, V[L] (junk), "
            "instead of 0: the next value is read without the mask",
            stages={"advantages": _gae_bootstrap_from_padding},
            gae=True,
        ),
        Bug(
            "gae_through_padding",
            "GAE recursion runs through the padding with unmasked values: padded slots add TD residuals "
            "γ·V[t+1] − V[t] that flow back into the valid tokens",
            stages={"advantages": _gae_through_padding},
            gae=True,
        ),
        Bug(
            "whiten_over_padding",
            "advantage whitening takes its mean/variance over all B·T positions, padding included (an "
            "unmasked mean/variance)",
            stages={"whitening": _whiten_over_padding},
        ),
        Bug(
            "kl_reward_sign_flipped",
            "the KL penalty is added to the reward with the wrong sign at every token: r_t = +β·KL_t "
            "instead of −β·KL_t (the reward pays for drifting from the reference)",
            stages={"rewards": _negated_kl(ro.rewards_stage), "advantages": _negated_kl(ro.advantages_stage)},
            requires=_reward_kl,
        ),
        Bug(
            "ratio_against_ref",
            "the policy ratio is taken against the reference log-probs, exp(log π − log π_ref), instead of "
            "the rollout log-probs (old_logprobs)",
            inputs={"old_logprobs": "ref_logprobs"},
            phase="update",
            needs=("logprobs",),
        ),
        Bug(
            "value_clip_around_new",
            "the clipped value is taken around the NEW values, V + clip(V − V_old, ±ε_v), instead of around "
            "the rollout values, V_old + clip(V − V_old, ±ε_v)",
            stages={"value": _value_clip_around_new},
            phase="update",
            needs=("values", "old_values"),
            requires=_clipped_value,
        ),
        *ROLLOUT_BUGS,
    )
}
"""The known bugs, in the order the diagnosis tries them (the rollout correction's last:
:mod:`refppo.pipeline.bugs_rollout`)."""


def touches(bug: Bug | None, stage: Stage) -> bool:
    """Whether ``bug`` replaces ``stage``'s function or swaps an input it reads."""
    if bug is None:
        return False
    return stage.name in bug.stages or (stage.phase == bug.phase and bool(set(bug.inputs) & set(stage.reads)))


def bug_phases(bug: Bug) -> frozenset[str]:
    """The phases ``bug`` acts in (``rollout``, ``update``)."""
    by_name = {s.name: s for s in STAGES}
    return frozenset({by_name[n].phase for n in bug.stages} | ({bug.phase} if bug.inputs else set()))


__all__ = ["BUGS", "Bug", "affected", "bug_phases", "touches", "variant"]
