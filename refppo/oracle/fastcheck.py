"""A cheap first test of a diagnosis candidate: the KL and reward stages alone.

:func:`refppo.oracle.diagnose.explain` tries a dozen single-key changes and known bugs; each used to
cost a full rollout recompute (KL, rewards, GAE, whitening) over every token, although most
candidates already fail at the first dumped quantity they change. :func:`rollout_prefix_ok` runs
only steps 1–2 of the pipeline (:func:`refppo.pipeline.reward_quantities`, which
:func:`~refppo.pipeline.rollout_quantities` itself calls) and rejects a candidate whose
``kl`` or ``token_rewards`` already differ. A candidate it lets through is then recomputed in full
through the pipeline, which alone decides what explains the divergence.
"""

from __future__ import annotations

from refppo.oracle.compare import compare
from refppo.oracle.load import TOLERANCES, Dump
from refppo.oracle.recompute import clipped_scores
from refppo.oracle.settings import Setup
from refppo.pipeline import reward_quantities


def rollout_prefix_ok(dump: Dump, setup: Setup, first: str, bug: str | None = None) -> bool:
    """False when ``kl`` or ``token_rewards`` (those the dump holds, up to ``first`` in pipeline
    order) differ under ``setup``/``bug``: the candidate cannot explain a divergence at ``first``.

    Computed by :func:`refppo.pipeline.reward_quantities` on the scores as
    :func:`refppo.oracle.recompute.recompute` prepares them (clip, AReaL's bias and scale). Only the
    bug ``kl_from_current_logprobs`` changes these two steps; the others act later.
    """
    t, m, conv, hp, ex = dump.tensors, dump.mask, setup.conv, setup.hp, setup.extras
    if not (dump.has("kl") or dump.has("token_rewards")):
        return True
    tol = TOLERANCES[dump.dtype]
    src = "logprobs" if bug == "kl_from_current_logprobs" else "old_logprobs"
    kl, rewards, vmask = reward_quantities(
        scores=clipped_scores(t["scores"], ex.score_clip, ex.score_bias, ex.score_scale),
        old_logprobs=t[src],
        ref_logprobs=t["ref_logprobs"],
        mask=m,
        hp=hp,
        conv=conv,
    )
    if dump.has("kl") and not compare("kl", t["kl"], kl, m, tol).ok:
        return False
    if first == "kl" or not dump.has("token_rewards"):
        return True
    return compare("token_rewards", t["token_rewards"], rewards, vmask, tol).ok


__all__ = ["rollout_prefix_ok"]
