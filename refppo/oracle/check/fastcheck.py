"""A cheap first test of a diagnosis candidate: the KL and reward stages alone.

:func:`refppo.oracle.check.diagnose.explain` tries a dozen single-key changes and known bugs; each used to
cost a full rollout recompute (KL, rewards, GAE, whitening) over every token, although most
candidates already fail at the first dumped quantity they change. :func:`rollout_prefix_ok` runs
only steps 1–2 of the pipeline (:func:`refppo.pipeline.rollout.reward_quantities`, which
:func:`~refppo.pipeline.rollout.rollout_quantities` itself calls) and rejects a candidate whose
``kl`` or ``token_rewards`` already differ. A candidate it lets through is then recomputed in full
through the pipeline, which alone decides what explains the divergence.

Most candidates change a key that steps 1–2 do not read (the whitening, GAE or loss conventions):
:class:`PrefixCheck` remembers each verdict under :func:`reward_key`, what those steps read, so
they are computed once per distinct key, not once per candidate.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from refppo.conventions import KLPlacement, Whitening
from refppo.dump.load import TOLERANCES, Dump
from refppo.oracle.check.compare import compare
from refppo.oracle.check.recompute import Reference, recompute
from refppo.oracle.check.settings import Setup
from refppo.pipeline.rollout import clipped_scores, reward_quantities


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

    Computed by :func:`refppo.pipeline.rollout.reward_quantities` on the scores as
    :func:`refppo.oracle.check.recompute.recompute` prepares them (clip, AReaL's bias and scale). Only the
    bugs ``kl_from_current_logprobs`` (both) and ``kl_reward_sign_flipped`` (the rewards) change
    these two steps; the others act later.

    ``kl_ok``: the verdict on ``kl`` when already known (it depends on the KL part of
    :func:`reward_key` only). Returns ``(verdict, verdict on kl or None when not compared)``.
    ``kl_memo``: holds the KL of one KL key (the last one computed), passed back to
    :func:`~refppo.pipeline.rollout.reward_quantities` for a setting with the same key.
    """
    t, m, conv, hp, ex = dump.tensors, dump.mask, setup.conv, setup.hp, setup.extras
    if not (dump.has("kl") or dump.has("token_rewards")):
        return True, None
    if kl_ok is False:
        return False, False
    tol = TOLERANCES[dump.dtype]
    src = "logprobs" if bug == "kl_from_current_logprobs" else "old_logprobs"
    kl_key = reward_key(setup, bug)[:_KL_PART]
    kl, rewards, vmask = reward_quantities(
        scores=clipped_scores(t["scores"], ex.score_clip, ex.score_bias, ex.score_scale),
        old_logprobs=t[src],
        ref_logprobs=t["ref_logprobs"],
        mask=m,
        hp=hp,
        conv=conv,
        kl=None if kl_memo is None else kl_memo.get(kl_key),
    )
    if kl_memo is not None and kl_key not in kl_memo:  # one [B, T] KL held at a time
        kl_memo.clear()
        kl_memo[kl_key] = kl
    if dump.has("kl") and kl_ok is None:
        kl_ok = compare("kl", t["kl"], kl, m, tol).ok
        dump.release("kl")
    if kl_ok is False:
        return False, False
    if first == "kl" or not dump.has("token_rewards"):
        return True, kl_ok
    if bug == "kl_reward_sign_flipped":  # the same KL estimate, added to the reward with + (BUGS)
        _, rewards, vmask = reward_quantities(
            scores=clipped_scores(t["scores"], ex.score_clip, ex.score_bias, ex.score_scale),
            old_logprobs=t[src], ref_logprobs=t["ref_logprobs"], mask=m, hp=hp, conv=conv, kl=-kl,
        )  # fmt: skip
    ok = compare("token_rewards", t["token_rewards"], rewards, vmask, tol).ok
    dump.release("token_rewards")
    return ok, kl_ok


_KL_PART = 4
"""The first entries of :func:`reward_key`: what ``token_kl`` reads (estimator, clamps, log-probs)."""


def reward_key(setup: Setup, bug: str | None = None) -> tuple[Any, ...]:
    """Everything of ``setup``/``bug`` that :func:`rollout_prefix_ok` reads: two settings with the
    same key get the same ``kl``, ``token_rewards`` and value mask from
    :func:`refppo.pipeline.rollout.reward_quantities` (checked key by key in the unit tests).

    The KL estimator and its clamps, the log-probs the KL reads, the score slot, the KL coefficient
    as it enters the reward (0 with the KL in the loss) and its sign, the score map, and the reward whitening
    with (only when it is on) its variance, eps placement and eps.
    """
    c, hp, ex = setup.conv, setup.hp, setup.extras
    beta = hp.kl_coef if c.kl_in is KLPlacement.REWARD else 0.0
    white: tuple[Any, ...] = (c.whiten_rewards,)
    if c.whiten_rewards is not Whitening.NONE:
        white = (c.whiten_rewards, c.whiten_variance, c.whiten_eps_at, hp.whiten_eps)
    kl = (c.kl_estimator, c.kl_log_ratio_clamp, c.kl_value_clamp, bug == "kl_from_current_logprobs")
    assert len(kl) == _KL_PART
    flip = bug == "kl_reward_sign_flipped"
    return (*kl, c.score_at, beta, flip, ex.score_clip, ex.score_bias, ex.score_scale, *white)


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
            kl_key = key[:_KL_PART]
            ok, kl_ok = _prefix(self.dump, setup, self.first, bug, self.kl_verdicts.get(kl_key), self.kl_memo)
            if kl_ok is not None:
                self.kl_verdicts[kl_key] = kl_ok
            self.verdicts[key] = ok
        return self.verdicts[key]


def rollout_key(setup: Setup, bug: str | None = None) -> tuple[Any, ...]:
    """Everything of ``setup``/``bug`` that steps 1–4 (``recompute(rollout_only=True)``) read:
    :func:`reward_key`, the bug, where the KL sits, GAE's, the critic-free estimators' and the
    advantage whitening's keys, ``γ``, ``λ``, ``β`` and the whitening eps (checked key by key in the
    unit tests)."""
    c, hp = setup.conv, setup.hp
    gae_keys = (c.gae_padding, c.gae_holes, hp.gamma, hp.lam)
    critic_free = (c.advantage, c.group_kl, c.group_std, c.group_eps, c.group_singleton, hp.kl_coef)
    std_level = c.group_std_level  # grpo's std over the group or the batch
    white = (c.whiten_advantages, c.whiten_variance, c.whiten_eps_at, c.whiten_holes, hp.whiten_eps)
    return (*reward_key(setup, bug), bug, c.kl_in, *gae_keys, *critic_free, std_level, *white)


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


__all__ = ["PrefixCheck", "RolloutMemo", "reward_key", "rollout_key", "rollout_prefix_ok"]
