"""The typed states of the ``--detect`` walk: what each step of :data:`refppo.oracle.detect.steps.STEPS`
hands to the next, and the digest its groups are merged by.

Every tensor of a state is an output of a pipeline stage (:mod:`refppo.pipeline.stages`), evaluated by
:meth:`refppo.oracle.detect.search.Search.run`; a state holds what a later step reads and nothing
else, so what a step no longer needs is not held (the KL and the token rewards are gone once the
returns are made, the raw advantages once the policy step starts)::

    KLState       kl step            kl (old vs ref), the KL keys of the option
    RewardState   token_rewards      + kl_in, value mask, mapped scores, token rewards
    ReturnsState  returns            Carried (KL identity, kl_in, value mask, returns) + raw advantages
    AdvState      advantages         + advantages
                  correction         + the rollout correction's weight (None: off)
    PolicyState   policy             + aggregation, pg_loss, pg_clipfrac, approx_kl, entropy, KL loss
    ValueState    value              + vf_loss, vf_clipfrac
    LossState     loss               + loss, kl_loss
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from torch import Tensor

from refppo.conventions import KLPlacement, LossAgg


def digest(*parts: Any) -> bytes:
    """A content key of tensors and plain values: equal digests mean bit-identical parts."""
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        if isinstance(p, Tensor):
            # the array's own buffer (no bytes copy); numpy's stubs do not declare the buffer protocol
            h.update(cast(Any, p.detach().contiguous().numpy()))
        else:
            h.update(repr(p).encode())
        h.update(b"|")
    return h.digest()


Setting = Mapping[str, Any]
"""Flat convention keys (and the clip hyperparameters) of an option: :meth:`Search.setting`'s input."""


@dataclass(frozen=True)
class KLState:
    """After the kl step: the per-token KL of the old log-probs (the kl stage)."""

    setting: Setting
    """``kl_estimator``, ``kl_log_ratio_clamp``, ``kl_value_clamp`` of the option (the kl_loss stage
    reads them again)."""
    kl: Tensor | None
    """None without ``ref_logprobs`` (β = 0: no stage reads the KL)."""
    key: bytes
    """Digest of the KL on the old and on the current log-probs: equal keys, equal KL everywhere."""


@dataclass(frozen=True)
class RewardState:
    """After the token_rewards step (the score_map, value_mask and rewards stages)."""

    kl: KLState
    kl_in: KLPlacement
    vm: Tensor
    """The value mask (the value_mask stage at ``score_at``), one tensor per slot for the search."""
    scores: Tensor
    """The mapped scores ``[B]`` (the critic-free estimators group them)."""
    rewards: Tensor
    fixed_whiten: tuple[str, str] | None
    """``(whiten_variance, whiten_eps_at)`` when the rewards are whitened: the advantage whitening
    shares the two keys."""


@dataclass(frozen=True)
class Carried:
    """What the update steps read of the rollout."""

    kl_key: bytes
    kl_setting: Setting
    kl_in: KLPlacement
    vm: Tensor
    returns: Tensor
    ret_key: bytes
    """Digest of the returns (as the advantages stage made them) and the value mask."""


@dataclass(frozen=True)
class ReturnsState:
    """After the returns step (the advantages stage)."""

    carried: Carried
    adv_raw: Tensor
    fixed_whiten: tuple[str, str] | None


@dataclass(frozen=True)
class AdvState:
    """After the advantages step (the whitening stage)."""

    carried: Carried
    adv_raw: Tensor | None
    """Read once more by the fitted note when no whitening reproduces the dump; None from then on
    (:func:`refppo.oracle.detect.steps.run_search` drops it before the policy step)."""
    adv: Tensor
    adv_key: bytes
    """Digest of ``adv``: the policy step's memos key on it (a replayed state's tensors are new
    objects, so never on ``id``)."""
    is_weights: Tensor | None = None
    """The rollout_correction stage's ``w'`` of the option (None: the correction off), set by the
    correction step (:mod:`refppo.oracle.detect.correction`); the policy stage multiplies ``ℓ`` by it."""
    is_key: bytes = b""
    """Digest of the correction's weights (empty: off): the policy step's memos key on it too."""


@dataclass(frozen=True)
class PolicyState:
    """After the policy step (the policy, policy_agg, approx_kl, entropy and kl_loss stages)."""

    carried: Carried
    adv: Tensor
    adv_key: bytes
    setting: Setting
    """The policy stage's effective keys (``dual_clip``, ``log_ratio_clamp``, the clip ranges)."""
    agg: LossAgg
    pg_loss: Tensor
    pg_clipfrac: Tensor
    approx_kl: Tensor
    entropy_loss: Tensor | None
    """None without an ``entropy`` input (nothing to compare)."""
    kl_loss: Tensor | None
    """None unless ``kl_in=loss`` with current log-probs."""
    is_weights: Tensor | None = None
    """The advantages state's correction weights (None: off); the gradient check multiplies the
    policy term's gradient by them (:meth:`refppo.oracle.detect.grad_fit.GradFit.corrected`)."""
    is_key: bytes = b""
    """The advantages state's :attr:`AdvState.is_key` (the gradient check's memo keys on it)."""
    members: Any = field(default=((), ()), compare=False)
    """The logged-only keys' members with this state's values (:mod:`refppo.oracle.detect.policy_members`)."""


@dataclass(frozen=True)
class ValueState:
    """After the value step (the value and value_agg stages)."""

    policy: PolicyState
    vf_loss: Tensor
    vf_clipfrac: Tensor
    vf_mask: Tensor | None
    """The value loss's mask; None without a critic."""
    clipped: bool
    vclip: float
    setting: Setting = field(default_factory=dict)
    """The value keys of the option (``value_loss``, ``value_clip_form``, ``vf_mask``,
    ``value_loss_agg``, ``cliprange_value``): what the gradient check sets (empty: none)."""


@dataclass(frozen=True)
class LossState:
    """After the loss step (the kl_loss and total stages)."""

    value: ValueState
    loss: Tensor
    kl_loss: Tensor | None


__all__ = [
    "AdvState",
    "Carried",
    "KLState",
    "LossState",
    "PolicyState",
    "ReturnsState",
    "RewardState",
    "Setting",
    "ValueState",
    "digest",
]
