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

from refppo.dump.keys import SIDECAR_SAMPLING_KEYS, SIDECAR_SCORING_KEYS
from refppo.dump.load import Dump, load_dump, validate
from refppo.dump.required import check_inputs_for
from refppo.errors import DumpError, HyperparameterError, RefPPOError
from refppo.oracle.check.diagnose import DETECT_HINT, CheckResult, check
from refppo.oracle.check.settings import ALL_KEYS, Setup, build_setup, parse_value
from refppo.oracle.coverage import no_sidecar_text, required_outputs, sources
from refppo.oracle.detect.detection import Detection, detect, setup_from_json
from refppo.oracle.presets.registry import resolve_preset
from refppo.oracle.report import Context, json_report, text_report
from refppo.pipeline.settings import Convention
from refppo.pipeline.stages import OUTPUTS


@dataclass
class Outcome:
    """The result of one check, with its two renderings (the CLI prints one of them)."""

    dump: Dump
    result: CheckResult
    preset: str | None
    detection: Detection | None = None
    nearest: CheckResult | None = None
    context: Context | None = None
    """Where each setting came from, the preset's conventions, the required outputs (the report's
    provenance and coverage lines); None: the bare report."""

    @property
    def match(self) -> bool:
        """The checked convention's verdict on what was compared (``refppo diff`` exit 0 unless a
        required output is missing: :attr:`passed`), with or without detection."""
        return self.result.match

    @property
    def missing_required(self) -> list[str]:
        """Required outputs (``require``) the check did not compare."""
        ctx = self.context
        return [] if ctx is None else [n for n in ctx.required if n not in self.result.quantities]

    @property
    def passed(self) -> bool:
        """The gate's verdict: a match, and every required output compared."""
        return self.match and not self.missing_required

    def text(self, *, verbose: bool = False) -> str:
        """The text report; ``verbose``: every convention key, not only those that differ."""
        return text_report(
            self.dump, self.result, self.preset, self.detection, self.nearest, self.context, verbose
        )

    def json(self) -> dict[str, Any]:
        return json_report(self.dump, self.result, self.preset, self.detection, self.nearest, self.context)


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
    require: str | tuple[str, ...] | list[str] | None = None,
) -> Outcome:
    """Check one dumped step (see the module docstring); ``overrides`` as ``--set`` (strings or values).

    ``require``: outputs that must be compared (:func:`refppo.oracle.coverage.required_outputs`:
    ``"all"``, a sequence of output keys, None for none); a missing one fails :attr:`Outcome.passed`.
    """
    parsed = {canonical_key(k): parse_value(canonical_key(k), v) for k, v in (overrides or {}).items()}
    d = as_dump(dump, hparams, hparams_file)
    sidecar = _sidecar(d)
    setup, ctx, notes = _resolve(d, preset, sidecar, parsed)
    try:
        check_inputs_for(d, setup.conv.adv.estimator.value, setup.conv, setup.hp)
    except DumpError as exc:
        if not detect_conventions or not any(d.has(k) for k in OUTPUTS):
            raise
        # The named estimator cannot run on this dump (a critic-free dump checked under GAE, say):
        # that is the checked convention's verdict (a mismatch, exit 1); --detect still searches.
        result = CheckResult(setup, {}, INAPPLICABLE, [f"the checked convention does not apply: {exc}"])
    else:
        result = check(d, setup)
        if not result.quantities:
            raise DumpError(
                f"{d.path}: the dump holds inputs only, none of the trainer outputs "
                f"({', '.join(OUTPUTS)}): nothing to compare"
            )
    result.diagnosis[:0] = notes
    ctx.required = required_outputs(d, result, require)
    out = Outcome(d, result, preset, context=ctx)
    if detect_conventions:
        result.diagnosis[:] = [_searched(line) for line in result.diagnosis]
        out.detection = detect(d, setup)
        nearest = out.detection.nearest
        named = any(e.get("all_match") for e in result.explained_by)
        # a named explanation of every quantity outranks the search's nearest fit (often one
        # constant fitted to one number): the nearest is then not re-checked nor offered
        if nearest is not None and not named and check_applies(d, str(nearest.get("advantage", "gae"))):
            try:
                out.nearest = check(d, setup_from_json(setup, nearest), explain_divergence=False)
            except RefPPOError as exc:  # the nearest refuses this dump: said, not the run's error
                result.diagnosis.append(f"the nearest convention is not re-checked: {exc}")
    return out


def canonical_key(key: str) -> str:
    """``key`` without ``refppo train``'s section (``ppo.cliprange`` is ``cliprange``): every key of
    its ``[ppo]`` section is the oracle key of that name."""
    key = key.strip()
    rest = key.removeprefix("ppo.")
    return rest if rest != key and rest in ALL_KEYS else key


def _sidecar(d: Dump) -> dict[str, Any]:
    """The sidecar's PPO settings, typed; a bad key or value names the sidecar file."""
    where = str(d.hparams_path) if d.hparams_path is not None else "hparams"
    try:
        skip = SIDECAR_SCORING_KEYS | SIDECAR_SAMPLING_KEYS  # the scoring and sampling keys: no PPO setting
        return {k: parse_value(k, v) for k, v in d.hparams.items() if k not in skip}
    except RefPPOError as exc:
        raise DumpError(f"{where}: {exc}") from None


def preset_overrides_note(
    preset: str, preset_conv: dict[str, Any], sidecar: dict[str, Any], overrides: dict[str, Any]
) -> list[str]:
    """One note per convention key where ``--preset`` replaces a different value from the sidecar.

    The preset wins (it states what the peer's code does); the note says so, so that a sidecar's
    convention is never dropped silently.
    """

    def norm(v: Any) -> Any:
        v = getattr(v, "value", v)
        return tuple(v) if isinstance(v, list) else v

    out = []
    for key in sorted(set(sidecar) & set(preset_conv)):
        if key in overrides or norm(sidecar[key]) == norm(preset_conv[key]):
            continue
        out.append(
            f"note: --preset {preset} sets {key}={norm(preset_conv[key])}, replacing the sidecar's "
            f"{key}={norm(sidecar[key])}; pass --set {key}=... to check another value"
        )
    return out


def _resolve(
    d: Dump, preset: str | None, sidecar: dict[str, Any], parsed: dict[str, Any]
) -> tuple[Setup, Context, list[str]]:
    """The checked setting, the report's context (sources, the preset's conventions) and the notes
    on sidecar conventions the preset replaces."""
    preset_conv = preset_hp = None
    notes: list[str] = []
    if preset:
        # The KL estimator is a run setting in every peer (TRL kl_estimator, verl kl_penalty,
        # OpenRLHF kl_estimator): the run's own (--set, else the sidecar) wins over the preset's.
        estimator = parsed.get("kl_estimator", sidecar.get("kl_estimator"))
        # So is the advantage estimator (verl adv_estimator, OpenRLHF advantage.estimator): the
        # preset then applies the peer's critic-free variant (refppo/oracle/presets/registry.py::VARIANTS).
        advantage = parsed.get("advantage", sidecar.get("advantage"))
        loss_est = parsed.get("kl_loss_estimator", sidecar.get("kl_loss_estimator"))  # kl_in=both's own
        preset_conv, preset_hp = resolve_preset(
            preset,
            None if estimator is None else str(estimator),
            None if advantage is None else str(advantage),
            None if loss_est is None else str(loss_est),
        )
        notes = preset_overrides_note(preset, preset_conv, sidecar, parsed)
    try:
        critic = {"values", "old_values"} <= set(d.tensors)
        setup = build_setup(
            preset_conv=preset_conv, preset_hp=preset_hp, sidecar=sidecar, overrides=parsed, critic=critic
        )
    except HyperparameterError as exc:
        if d.sidecar_keys is None and "missing hyperparameters" in str(exc):
            raise HyperparameterError(f"{no_sidecar_text(d)}; {exc}") from None
        raise
    # the report's convention line shows what differs from the preset as written (its own KL
    # estimator, GAE), so the run's estimator and its critic-free variant are shown too
    plain = resolve_preset(preset)[0] if preset else {}
    base = Setup(Convention(), setup.hp).with_convention(plain)
    ctx = Context(sources(setup, sidecar, preset_conv, preset_hp, parsed), base.convention_dict())
    if d.sidecar_keys is None:
        notes.insert(0, f"{no_sidecar_text(d)}; {ctx.hparams_from(preset)}")
    return setup, ctx, notes


def _searched(line: str) -> str:
    """A diagnosis line without its advice to run ``--detect`` (it was given: its search follows)."""
    return line.replace(f" ({DETECT_HINT})", "; --detect's search is below").replace(
        f"; {DETECT_HINT}", "; --detect's search is below"
    )


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


__all__ = ["INAPPLICABLE", "Outcome", "as_dump", "canonical_key", "check_step"]
