"""One oracle check as a function: the flow of ``refppo diff`` (the CLI is a thin shell around it).

    outcome = check_step("dumps/step_000010.safetensors", preset="verl", overrides={"kl_estimator": "k3"})
    outcome.match, outcome.text(), outcome.json()

Setting precedence as the CLI: refppo defaults < sidecar < ``preset`` < ``overrides``; bad input raises
a :class:`refppo.errors.RefPPOError` whose message is one line (the CLI's exit 2).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from refppo.dump.load import (
    SIDECAR_SCORING_KEYS,
    Dump,
    DumpError,
    check_inputs_for,
    load_dump,
    validate,
)
from refppo.oracle.check.diagnose import CheckResult, check
from refppo.oracle.check.recompute import PIPELINE_ORDER
from refppo.oracle.check.settings import build_setup, parse_value
from refppo.oracle.detect.detection import Detection, detect, setup_from_json
from refppo.oracle.presets.registry import resolve_preset
from refppo.oracle.report import json_report, text_report


@dataclass
class Outcome:
    """The result of one check, with its two renderings (the CLI prints one of them)."""

    dump: Dump
    result: CheckResult
    preset: str | None
    detection: Detection | None = None
    nearest: CheckResult | None = None

    @property
    def match(self) -> bool:
        """The checked convention's verdict (``refppo diff`` exit 0), with or without detection."""
        return self.result.match

    def text(self) -> str:
        return text_report(self.dump, self.result, self.preset, self.detection, self.nearest)

    def json(self) -> dict[str, Any]:
        return json_report(self.dump, self.result, self.preset, self.detection, self.nearest)


def as_dump(
    dump: str | Path | Dump | Mapping[str, Tensor],
    hparams: Mapping[str, Any] | None = None,
    hparams_file: str | Path | None = None,
) -> Dump:
    """A path (sidecar found beside it, or ``hparams_file``; ``hparams`` given too are laid over
    that sidecar's keys), a loaded :class:`Dump`, or a dict of tensors with its sidecar as
    ``hparams`` (validated exactly like a file)."""
    if isinstance(dump, Dump):
        if hparams:
            raise DumpError(f"{dump.path}: hparams cannot be applied to an already loaded dump")
        return dump
    if isinstance(dump, (str, Path)):
        return load_dump(Path(dump), hparams_file, overlay=hparams)
    return validate(Path("<tensors>"), dict(dump), hparams=dict(hparams or {}))


def check_step(
    dump: str | Path | Dump | Mapping[str, Tensor],
    *,
    preset: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    hparams: Mapping[str, Any] | None = None,
    hparams_file: str | Path | None = None,
    detect_conventions: bool = False,
) -> Outcome:
    """Check one dumped step (see the module docstring); ``overrides`` as ``--set`` (strings or values)."""
    parsed = {k: parse_value(k, v) for k, v in (overrides or {}).items()}
    d = as_dump(dump, hparams, hparams_file)
    sidecar = {k: parse_value(k, v) for k, v in d.hparams.items() if k not in SIDECAR_SCORING_KEYS}
    preset_conv = preset_hp = None
    notes: list[str] = []
    if preset:
        from refppo.oracle.cli import preset_overrides_note

        # The KL estimator is a run setting in every peer (TRL kl_estimator, verl kl_penalty,
        # OpenRLHF kl_estimator): the run's own (--set, else the sidecar) wins over the preset's.
        estimator = parsed.get("kl_estimator", sidecar.get("kl_estimator"))
        # So is the advantage estimator (verl adv_estimator, OpenRLHF advantage.estimator): the
        # preset then applies the peer's critic-free variant (refppo/oracle/presets/critic_free.py).
        advantage = parsed.get("advantage", sidecar.get("advantage"))
        preset_conv, preset_hp = resolve_preset(
            preset,
            None if estimator is None else str(estimator),
            None if advantage is None else str(advantage),
        )
        notes = preset_overrides_note(preset, preset_conv, sidecar, parsed)
    setup = build_setup(preset_conv=preset_conv, preset_hp=preset_hp, sidecar=sidecar, overrides=parsed)
    try:
        check_inputs_for(d, setup.conv.advantage.value)
    except DumpError as exc:
        if not detect_conventions or not any(d.has(k) for k in PIPELINE_ORDER):
            raise
        # The named estimator cannot run on this dump (a critic-free dump checked under GAE, say):
        # that is the checked convention's verdict (a mismatch, exit 1); --detect still searches.
        result = CheckResult(setup, {}, INAPPLICABLE, [f"the checked convention does not apply: {exc}"])
    else:
        result = check(d, setup)
        if not result.quantities:
            raise DumpError(
                f"{d.path}: the dump holds inputs only, none of the trainer outputs "
                f"({', '.join(PIPELINE_ORDER)}): nothing to compare"
            )
    result.diagnosis[:0] = notes
    out = Outcome(d, result, preset)
    if detect_conventions:
        out.detection = detect(d, setup)
        nearest = out.detection.nearest
        if nearest is not None and check_applies(d, str(nearest.get("advantage", "gae"))):
            out.nearest = check(d, setup_from_json(setup, nearest), explain_divergence=False)
    return out


INAPPLICABLE = "inputs"
"""``first_divergence`` when the checked convention cannot run on the dump's inputs (only with
``--detect``; without it that is bad input, exit 2): e.g. ``advantage=gae`` without ``old_values``."""


def check_applies(d: Dump, advantage: str) -> bool:
    """Whether the dump holds the inputs the estimator ``advantage`` needs."""
    try:
        check_inputs_for(d, advantage)
    except DumpError:
        return False
    return True


__all__ = ["INAPPLICABLE", "Outcome", "as_dump", "check_step"]
