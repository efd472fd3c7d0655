"""A cheap first test of a diagnosis candidate: the KL and reward stages alone.

:func:`refppo.oracle.diagnose.explain` tries a dozen single-key changes and known bugs; each used to
cost a full rollout recompute (KL, rewards, GAE, whitening) over every token, although most
candidates already fail at the first dumped quantity they change. :func:`rollout_prefix_ok` runs
only steps 1–2 of :func:`refppo.pipeline.rollout_quantities` — the same core calls with the same
arguments, so the values are bit-identical to the pipeline's — and rejects a candidate whose
``kl`` or ``token_rewards`` already differ. A candidate it lets through is then recomputed in full
through the pipeline, which alone decides what explains the divergence.
"""

from __future__ import annotations

from typing import Any

from refppo.conventions import KLPlacement
from refppo.core.kl import token_kl
from refppo.core.rewards import token_rewards
from refppo.oracle.compare import compare
from refppo.oracle.load import TOLERANCES, Dump
from refppo.oracle.recompute import clipped_scores
from refppo.oracle.settings import Setup
from refppo.pipeline import value_mask


def rollout_prefix_ok(
    dump: Dump, setup: Setup, first: str, bug: str | None = None, cache: dict[Any, Any] | None = None
) -> bool:
    """False when ``kl`` or ``token_rewards`` (those the dump holds, up to ``first`` in pipeline
    order) differ under ``setup``/``bug``: the candidate cannot explain a divergence at ``first``.

    Only the bug ``kl_from_current_logprobs`` changes these two steps; the others act later.
    ``cache`` (one dict per diagnosis) keeps the KL and its verdict per estimator/clamps/source, so
    the candidates that change only the reward step (score position, clip, KL placement) pay for
    the reward step alone.
    """
    t, m, conv, hp = dump.tensors, dump.mask, setup.conv, setup.hp
    if not (dump.has("kl") or dump.has("token_rewards")):
        return True
    tol = TOLERANCES[dump.dtype]
    src = "logprobs" if bug == "kl_from_current_logprobs" else "old_logprobs"
    key = (src, conv.kl_estimator, conv.kl_log_ratio_clamp, conv.kl_value_clamp)
    memo = cache if cache is not None else {}
    if key not in memo:
        kl = token_kl(
            t[src],
            t["ref_logprobs"],
            m,
            conv.kl_estimator,
            log_ratio_clamp=conv.kl_log_ratio_clamp,
            value_clamp=conv.kl_value_clamp,
        )
        memo.clear()  # one KL at a time: never more than one extra [B, T] buffer
        memo[key] = (kl, not dump.has("kl") or compare("kl", t["kl"], kl, m, tol).ok)
    kl, kl_ok = memo[key]
    if not kl_ok:
        return False
    if first == "kl" or not dump.has("token_rewards"):
        return True
    beta = hp.kl_coef if conv.kl_in is KLPlacement.REWARD else 0.0
    scores = clipped_scores(t["scores"], setup.extras.score_clip)
    r = token_rewards(scores, kl if beta > 0 else None, m, beta, score_at=conv.score_at)
    return compare("token_rewards", t["token_rewards"], r, value_mask(m, conv.score_at), tol).ok


__all__ = ["rollout_prefix_ok"]
