"""What a check compared and what it did not, and where each setting came from.

A CI gate must never pass on what it did not compare. Every trainer output of
:data:`refppo.oracle.check.recompute.OUTPUTS` is, after a check, either *compared* or *not
compared* for one of these reasons:

=================================== ==========================================================
reason                              when
=================================== ==========================================================
``not in the dump``                 the dump's inputs allow it (the reference computes it), the
                                    dump does not hold it
``not computable ... (no X)``       an input it is computed from is absent (``pg_loss`` without
                                    ``logprobs``, ``vf_loss`` of a critic-free dump)
``kl_in=reward: no KL loss``        ``kl_loss`` of a step whose KL sits in the reward
``the checked convention cannot     the estimator needs an input the dump lacks (``--detect``
run on the dump's inputs``          only: otherwise that is bad input)
=================================== ==========================================================

The outputs a gate requires by default (:func:`required_outputs` with ``"all"``) are every output
the dump's inputs allow, except the logged metrics :data:`METRICS` (clip fractions and
``approx_kl``: means over tokens that enter no gradient, which ``StepRecorder`` cannot sum over
micro-batches); naming them in ``require`` requires them too.

Each setting's source (:func:`sources`) is one of ``set`` (``--set`` or keyword arguments),
``sidecar``, ``preset`` (the preset's conventions, or its default hyperparameters) and
``default`` (refppo's defaults), in the precedence of :func:`refppo.oracle.check.settings.build_setup`.
"""

from __future__ import annotations

from typing import Any

from refppo.dump.keys import KNOWN_KEYS, NEEDS_CRITIC, NEEDS_UPDATE, suggest
from refppo.dump.load import Dump
from refppo.errors import RefPPOError
from refppo.oracle.check.diagnose import CheckResult
from refppo.oracle.check.settings import Setup
from refppo.pipeline.stages import OUTPUTS

METRICS: tuple[str, ...] = ("pg_clipfrac", "approx_kl", "vf_clipfrac")
"""Logged metrics: compared when dumped, required only when named (module docstring)."""
NOT_IN_DUMP = "not in the dump"
READS: dict[str, tuple[str, ...]] = {
    "logprobs": ("pg_loss", "pg_clipfrac", "approx_kl", "kl_loss", "loss", "grad_logprobs"),
    "values": ("vf_loss", "vf_clipfrac", "loss", "grad_values"),
    "entropy": ("entropy_loss",),
}
"""The outputs computed from each update-step input (a dump holding the input but none of them
compared none of what it was dumped for)."""


def not_compared(dump: Dump, result: CheckResult) -> dict[str, str]:
    """``{output: why}`` for every output of the pipeline order the check did not compare."""
    if not result.quantities:
        return {n: "the checked convention cannot run on the dump's inputs" for n in OUTPUTS}
    critic = dump.has("old_values")
    out: dict[str, str] = {}
    for n in OUTPUTS:
        if n in result.quantities:
            continue
        if n == "kl_loss" and not result.setup.conv.kl.placement.in_loss:
            out[n] = f"kl_in={result.setup.conv.kl.placement.value}: no KL loss"
            continue
        if n in ("kl", "kl_loss") and not dump.has("ref_logprobs"):
            out[n] = "no ref_logprobs; β = 0: not read"  # else the check refuses (pipeline.needs)
            continue
        needs = list(NEEDS_UPDATE.get(n, ()))
        if n == "loss" and not critic:
            needs = ["logprobs"]  # a critic-free step's loss has no value term
        if n in NEEDS_CRITIC or n == "grad_values":
            needs.append("old_values")
        absent = [k for k in needs if not dump.has(k)]
        out[n] = (
            NOT_IN_DUMP if not absent else f"not computable from the dump's inputs (no {', '.join(absent)})"
        )
    return out


def required_outputs(
    dump: Dump, result: CheckResult, require: str | tuple[str, ...] | list[str] | None
) -> list[str]:
    """The outputs ``require`` asks for: ``"all"`` every output the dump's inputs allow but the
    :data:`METRICS`, a sequence exactly those names (each must be an output key), None nothing."""
    if require is None:
        return []
    if isinstance(require, str):
        if require != "all":
            raise RefPPOError(f"require: expected 'all' or a sequence of output keys, got {require!r}")
        missing = not_compared(dump, result)
        allowed = [n for n in OUTPUTS if n in result.quantities or missing.get(n) == NOT_IN_DUMP]
        return [n for n in allowed if n not in METRICS]
    names = list(require)
    for n in names:
        if n not in OUTPUTS:
            hint = suggest(n, frozenset(OUTPUTS))
            did = f" (did you mean {hint}?)" if hint in OUTPUTS else ""
            raise RefPPOError(f"require: {n!r} is not a trainer output{did}; outputs: {', '.join(OUTPUTS)}")
    return [n for n in OUTPUTS if n in names]


def intent_warnings(dump: Dump, result: CheckResult) -> list[str]:
    """What the dump evidently meant to compare and did not: an update-step input none of whose
    outputs was compared, and an ignored key that resembles an output left uncompared."""
    if not result.quantities:
        return []
    out: list[str] = []
    for key, outputs in READS.items():
        if dump.has(key) and not any(n in result.quantities for n in outputs):
            out.append(
                f"the dump holds {key} but none of the outputs computed from it "
                f"({', '.join(outputs)}): nothing that reads {key} was compared"
            )
    for k in dump.ignored:
        hint = suggest(k, KNOWN_KEYS)
        if hint in OUTPUTS and hint not in result.quantities:
            out.append(f"the ignored key {k!r} resembles {hint}, which was not compared")
    return out


def no_sidecar_text(d: Dump) -> str:
    """The lead of every report (and missing-hyperparameter error) of a dump without a sidecar."""
    if d.path.name == "<tensors>":
        return "no sidecar: no hyperparameters were given with the tensors"
    return f"no sidecar: no {d.path.name}.json beside the dump and no --hparams FILE"


def sources(
    setup: Setup,
    sidecar: dict[str, Any],
    preset_conv: dict[str, Any] | None,
    preset_hp: dict[str, Any] | None,
    overrides: dict[str, Any],
) -> dict[str, str]:
    """``{key: set | sidecar | preset | default}`` for every hyperparameter and convention key."""

    def norm(v: Any) -> Any:
        v = getattr(v, "value", v)
        return tuple(v) if isinstance(v, list) else v

    out: dict[str, str] = {}
    for k in setup.hp.to_dict():  # kl_loss_coef only when set
        if k in overrides:
            out[k] = "set"
        elif k in sidecar:
            out[k] = "sidecar"
        else:
            out[k] = "preset" if preset_hp and k in preset_hp else "default"
    for k in setup.convention_dict():
        if k in overrides:
            out[k] = "set"
        elif preset_conv is not None and k in preset_conv:
            same = k in sidecar and norm(sidecar[k]) == norm(preset_conv[k])
            out[k] = "sidecar" if same else "preset"
        else:
            out[k] = "sidecar" if k in sidecar else "default"
    return out


__all__ = [
    "METRICS",
    "NOT_IN_DUMP",
    "READS",
    "intent_warnings",
    "no_sidecar_text",
    "not_compared",
    "required_outputs",
    "sources",
]
