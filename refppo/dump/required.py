"""Which inputs a dump must hold for a setting to be checked on it: computed from THE stage table
(:func:`refppo.pipeline.reads.required_inputs`, each stage's :attr:`~refppo.pipeline.stages.Stage.needs`),
never from a list of its own.

The loader requires ``response_mask``, ``old_logprobs`` and ``scores`` of every dump
(:data:`refppo.dump.keys.REQUIRED_INPUTS`); the rest is required only where the setting reads it:
``ref_logprobs`` where a KL term with β > 0 is (the reward's −β·KL under ``kl_in=reward``, the KL
loss under ``kl_in=loss``), ``rollout_logprobs`` with the rollout correction on, ``old_values`` for
GAE, ``group_index`` for a group estimator. A missing one is refused in one line naming the key, the
stage that reads it and the setting under which it does.
"""

from __future__ import annotations

from refppo.dump.load import Dump
from refppo.errors import DumpError
from refppo.pipeline.needs import missing_line
from refppo.pipeline.reads import required_inputs
from refppo.pipeline.settings import Convention, Hyperparams

WHAT: dict[str, str] = {
    "ref_logprobs": "the reference policy's log-probs of the sampled tokens",
    "rollout_logprobs": "the engine's log-probs of the sampled tokens",
    "bootstrap_values": "the critic's value of the state after each row's last token",
}
ADVICE: dict[str, str] = {
    "ref_logprobs": "dump it, or check the step as it ran: kl_coef=0 (no KL term reads it)",
    "rollout_logprobs": "dump it, or check without the correction (rollout_is=none, rollout_rs=none)",
    "bootstrap_values": "dump it (0 on rows that ended), or check with gae_bootstrap=none",
}


def missing_inputs(present: set[str] | frozenset[str], conv: Convention, hp: Hyperparams) -> list[str]:
    """One line per optional input ``conv``/``hp`` reads that ``present`` lacks (pipeline order)."""
    out = []
    for key, need in required_inputs(conv, hp).items():
        if key not in present:
            advice = ADVICE.get(key, "dump it")
            out.append(f"{missing_line(key, need.stage, need.why)} ({WHAT.get(key, key)}); {advice}")
    return out


def check_inputs_for(
    dump: Dump, advantage: str, conv: Convention | None = None, hp: Hyperparams | None = None
) -> None:
    """The inputs the estimator ``advantage`` needs: ``old_values`` for ``gae``, ``group_index`` for a
    group estimator (``grpo``, ``dr-grpo``, ``rloo``, ``reinforce++-baseline``, ``opo``, ``gpg``,
    ``grpo-passk``; ``flash-reinforce``'s baseline is the batch mean); with ``conv`` (and ``hp``,
    default :class:`Hyperparams`), every optional input a stage needs under them
    (:func:`missing_inputs`). One-line DumpError naming the key and the stage."""
    if conv is not None:
        lines = missing_inputs(frozenset(dump.tensors), conv, hp or Hyperparams())
        if lines:
            raise DumpError(f"{dump.path}: {lines[0]}")
    if advantage == "gae" and "old_values" not in dump.tensors:
        raise DumpError(
            f"{dump.path}: missing required key 'old_values' (advantage=gae needs the critic's rollout "
            "values; a critic-free dump names its estimator: --set advantage=grpo, rloo, reinforce++, ...)"
        )
    if advantage not in ("gae", "reinforce++", "flash-reinforce") and "group_index" not in dump.tensors:
        raise DumpError(
            f"{dump.path}: missing key 'group_index' (advantage={advantage} needs [B] integers: "
            "the prompt each row answers)"
        )


__all__ = ["check_inputs_for", "missing_inputs"]
