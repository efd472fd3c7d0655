"""What a step reads under a setting, walked over THE stage table (:data:`refppo.pipeline.stages.STAGES`):
each stage's :attr:`~refppo.pipeline.stages.Stage.needs` (:mod:`refppo.pipeline.needs`), split into
the optional inputs a dump must hold (:func:`required_inputs`) and the hyperparameters a sidecar
must give (:func:`required_hparams`). The dump's loader and the oracle's settings call these; no
other list of required keys exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from refppo.pipeline.needs import critic_needs, missing_line
from refppo.pipeline.settings import HPARAM_KEYS, Convention, Hyperparams
from refppo.pipeline.stages import STAGES, Stage


@dataclass(frozen=True)
class Need:
    """One thing a stage cannot run without: ``name`` (an input or a hyperparameter), the stage,
    and the setting under which it reads it."""

    name: str
    stage: str
    why: str

    def line(self) -> str:
        """``'ref_logprobs': read by the kl stage under kl_coef=0.05 (kl_in=reward)``."""
        return f"{self.name!r}: read by the {self.stage} stage under {self.why}"


def needs_of(conv: Convention, hp: Hyperparams, stages: Sequence[Stage] = STAGES) -> list[Need]:
    """Every need of ``stages`` under ``conv``/``hp``, in pipeline order (a name may appear under
    several stages: ``kl_coef`` under the rewards or the total stage)."""
    out: list[Need] = []
    for s in stages:
        if s.needs is not None:
            out.extend(Need(k, s.name, why) for k, why in s.needs(conv, hp).items())
    return out


def required_inputs(conv: Convention, hp: Hyperparams, stages: Sequence[Stage] = STAGES) -> dict[str, Need]:
    """``{optional input: its first need}`` under ``conv``/``hp``: what a dump must hold beyond
    ``response_mask``, ``old_logprobs`` and ``scores`` for the setting to be checked on it
    (``ref_logprobs`` only where a KL term with β > 0 reads it, ``rollout_logprobs`` only with the
    rollout correction on)."""
    out: dict[str, Need] = {}
    for n in needs_of(conv, hp, stages):
        if n.name not in HPARAM_KEYS:
            out.setdefault(n.name, n)
    return out


def required_hparams(conv: Convention, *, critic: bool = False) -> dict[str, Need]:
    """``{hyperparameter: its first need}`` under ``conv``: what a sidecar, preset or ``--set`` must
    give. The hyperparameter needs read the convention only (evaluated at the default
    :class:`Hyperparams`). ``critic``: the dump carries a critic's ``values`` and ``old_values``
    under a critic-free estimator, whose value loss then reads ε_v and c1 too
    (:func:`refppo.pipeline.needs.critic_needs`)."""
    out: dict[str, Need] = {}
    for n in needs_of(conv, Hyperparams()):
        if n.name in HPARAM_KEYS:
            out.setdefault(n.name, n)
    if critic:
        for k, why in critic_needs(conv).items():
            stage = "value" if k == "cliprange_value" else "total"
            out.setdefault(k, Need(k, stage, why))
    return out


def missing_hparams(
    conv: Convention, given: set[str] | frozenset[str], *, critic: bool = False, order: Sequence[str] = ()
) -> list[Need]:
    """The hyperparameters ``conv`` reads (:func:`required_hparams`) that ``given`` lacks, in
    ``order`` (then pipeline order): a critic-free setting without a critic's values reads neither
    ``lam``, ``cliprange_value`` nor ``vf_coef``, so a sidecar of such a step need not carry them."""
    need = required_hparams(conv, critic=critic)
    names = [k for k in order if k in need] + [k for k in need if k not in order]
    return [need[k] for k in names if k not in given]


def missing_hparams_line(missing: Sequence[Need]) -> str:
    """One line for :func:`missing_hparams`' answer: the names, and the stage and setting reading
    each (:func:`refppo.pipeline.needs.missing_line`'s words)."""
    names = [n.name for n in missing]
    why = "; ".join(missing_line(n.name, n.stage, n.why, kind="hyperparameter") for n in missing)
    return (
        f"missing hyperparameters {names} ({why}): "
        "give them in the sidecar JSON, --hparams FILE or --set KEY=VALUE"
    )


def reads_reference(conv: Convention, hp: Hyperparams) -> bool:
    """Whether any stage needs ``ref_logprobs`` under ``conv``/``hp``."""
    return "ref_logprobs" in required_inputs(conv, hp)


__all__ = [
    "Need",
    "missing_hparams",
    "missing_hparams_line",
    "needs_of",
    "reads_reference",
    "required_hparams",
    "required_inputs",
]
