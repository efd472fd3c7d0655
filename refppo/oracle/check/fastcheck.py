"""A cheap first test of a diagnosis candidate: the KL and reward stages alone.

:func:`refppo.oracle.check.diagnose.explain` tries a dozen single-key changes and known bugs; each used to
cost a full rollout recompute (KL, rewards, GAE, whitening) over every token, although most
candidates already fail at the first dumped quantity they change. :func:`rollout_prefix_ok` runs
only steps 0–2 of the pipeline (:func:`refppo.pipeline.step.reward_quantities`, the first stages
of :func:`~refppo.pipeline.step.rollout_quantities`' walk) and rejects a candidate whose
``kl`` or ``token_rewards`` already differ. A candidate it lets through is then recomputed in full
through the pipeline, which alone decides what explains the divergence.

Most candidates change a key that steps 1–2 do not read (the whitening, GAE or loss conventions):
:class:`PrefixCheck` remembers each verdict under :func:`reward_key`, what those steps read, so
they are computed once per distinct key, not once per candidate.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from refppo.dump.load import Dump
from refppo.dump.tolerances import TOLERANCES
from refppo.oracle.check.compare import compare
from refppo.oracle.check.recompute import Reference, check_bug_reads, recompute
from refppo.oracle.check.settings import Setup
from refppo.pipeline.bugs import BUGS as BUG_TABLE
from refppo.pipeline.bugs import touches, variant
from refppo.pipeline.stages import BY_NAME, ROLLOUT_STAGES, Stage, walk
from refppo.pipeline.step import REWARD_STAGES

_PREFIX_READS = ("scores", "old_logprobs", "ref_logprobs", "logprobs")
"""The dumped inputs :func:`_prefix` reads (besides the mask)."""


def rollout_prefix_ok(dump: Dump, setup: Setup, first: str, bug: str | None = None) -> bool:
    """False when ``kl`` or ``token_rewards`` differ (see :func:`_prefix`)."""
    return _prefix(dump, setup, first, bug, None)[0]


def _prefix(
    dump: Dump,
    setup: Setup,
    first: str,
    bug: str | None,
    kl_ok: bool | None,
    kl_memo: dict[tuple[Any, ...], Tensor] | None = None,
) -> tuple[bool, bool | None]:
    """False when ``kl`` or ``token_rewards`` (those the dump holds, up to ``first`` in pipeline
    order) differ under ``setup``/``bug``: the candidate cannot explain a divergence at ``first``.

    Computed by the stages score_map … rewards (:data:`refppo.pipeline.step.REWARD_STAGES`, the
    first stages of :func:`refppo.oracle.check.recompute.recompute`), under ``bug``'s variant of them
    (``kl_from_current_logprobs`` swaps the KL's log-probs, ``kl_reward_sign_flipped`` the rewards'
    KL sign; the other bugs act later).

    ``kl_ok``: the verdict on ``kl`` when already known (it depends on :func:`kl_key` only). Returns
    ``(verdict, verdict on kl or None when not compared)``. ``kl_memo``: holds the KL of one KL key
    (the last one computed), passed back to the walk for a setting with the same key.
    """
    t, m, conv, hp = dump.tensors, dump.mask, setup.conv, setup.hp
    if not (dump.has("kl") or dump.has("token_rewards")):
        return True, None
    if kl_ok is False:
        return False, False
    tol = TOLERANCES[dump.dtype]
    check_bug_reads(dump, bug)
    dump.release_except((*_PREFIX_READS, "kl", "token_rewards"))  # not the rest of the step's keys
    kl_k, b = kl_key(setup, bug), None if bug is None else BUG_TABLE[bug]
    q: dict[str, Any] = {"scores": t["scores"], "old_logprobs": t["old_logprobs"], "mask": m}
    q.update(ref_logprobs=t.get("ref_logprobs"), logprobs=t.get("logprobs"))
    q = q if b is None else b.swap(q, "rollout")
    if kl_memo is not None and kl_k in kl_memo:
        q["kl"] = kl_memo[kl_k]  # the KL stage is not run again: the same call made it
    out = walk(variant(REWARD_STAGES, b), q, conv, hp)
    kl, rewards, vmask = out["kl"], out["token_rewards"], out["value_mask"]
    if kl_memo is not None and kl_k not in kl_memo:  # one [B, T] KL held at a time
        kl_memo.clear()
        kl_memo[kl_k] = kl
    if dump.has("kl") and kl_ok is None and kl is not None:
        kl_ok = compare("kl", t["kl"], kl, m, tol).ok
        dump.release("kl")
    if kl_ok is False:
        return False, False
    if first == "kl" or not dump.has("token_rewards"):
        return True, kl_ok
    ok = compare("token_rewards", t["token_rewards"], rewards, vmask, tol).ok
    dump.release("token_rewards")
    return ok, kl_ok


def _stage_key(stage: Stage, setup: Setup, bug: str | None) -> tuple[Any, ...]:
    """What ``stage`` reads under ``setup`` (:meth:`Stage.key`) and whether ``bug`` touches it
    (:func:`refppo.pipeline.bugs.touches`: its function replaced or an input swapped)."""
    b = None if bug is None else BUG_TABLE[bug]
    return (stage.key(setup.conv, setup.hp), bug if touches(b, stage) else None)


def kl_key(setup: Setup, bug: str | None = None) -> tuple[Any, ...]:
    """What the KL stage reads under ``setup``/``bug``: the first part of :func:`reward_key`."""
    return _stage_key(BY_NAME["kl"], setup, bug)


def reward_key(setup: Setup, bug: str | None = None) -> tuple[Any, ...]:
    """Everything of ``setup``/``bug`` that :func:`rollout_prefix_ok` reads: two settings with the
    same key get the same ``kl``, ``token_rewards`` and value mask from the stages of
    :data:`refppo.pipeline.step.REWARD_STAGES`. Derived from the stage table: each stage's
    :meth:`~refppo.pipeline.stages.Stage.key` under ``setup`` (its ``active`` keys: the reward
    whitening's moments only when it is on) and whether the bug touches it, :func:`kl_key` first."""
    rest = tuple(_stage_key(s, setup, bug) for s in REWARD_STAGES if s.name != "kl")
    return (*kl_key(setup, bug), *rest)


class PrefixCheck:
    """:func:`rollout_prefix_ok` for one dump and first divergence, each :func:`reward_key` once,
    and ``kl`` compared once per KL part of the key (a differing KL rejects without computing)."""

    def __init__(self, dump: Dump, first: str) -> None:
        self.dump, self.first = dump, first
        self.verdicts: dict[tuple[Any, ...], bool] = {}
        self.kl_verdicts: dict[tuple[Any, ...], bool] = {}
        self.kl_memo: dict[tuple[Any, ...], Tensor] = {}

    def __call__(self, setup: Setup, bug: str | None = None) -> bool:
        key = reward_key(setup, bug)
        if key not in self.verdicts:
            kl_k = kl_key(setup, bug)
            ok, kl_ok = _prefix(self.dump, setup, self.first, bug, self.kl_verdicts.get(kl_k), self.kl_memo)
            if kl_ok is not None:
                self.kl_verdicts[kl_k] = kl_ok
            self.verdicts[key] = ok
        return self.verdicts[key]


def rollout_key(setup: Setup, bug: str | None = None) -> tuple[Any, ...]:
    """Everything of ``setup``/``bug`` that steps 0–4 (``recompute(rollout_only=True)``) read:
    :func:`reward_key` and the same key of the remaining rollout stages (the estimator's own
    options, the advantage whitening's), derived from the stage table."""
    rest = tuple(_stage_key(s, setup, bug) for s in ROLLOUT_STAGES if s not in REWARD_STAGES)
    return (*reward_key(setup, bug), *rest)


class RolloutMemo:
    """The rollout-only :class:`~refppo.oracle.check.recompute.Reference` of the last :func:`rollout_key`
    asked for, so that settings differing only in the update stage (``--detect``'s re-checks of
    its nearest conventions) recompute steps 1–4 once: ``recompute(rollout=memo.get(setup))``.
    One rollout (four or five ``[B, T]`` tensors) is held at a time."""

    def __init__(self, dump: Dump) -> None:
        self.dump = dump
        self.key: tuple[Any, ...] | None = None
        self.ref: Reference | None = None

    def get(self, setup: Setup, bug: str | None = None) -> Reference:
        key = rollout_key(setup, bug)
        if self.ref is None or key != self.key:
            self.ref = None  # release the previous rollout before computing the next
            self.ref = recompute(self.dump, setup, bug=bug, rollout_only=True)
            self.key = key
        return self.ref


__all__ = ["PrefixCheck", "RolloutMemo", "kl_key", "reward_key", "rollout_key", "rollout_prefix_ok"]
