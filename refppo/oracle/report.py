"""Text and JSON renderings of a check (and of a detection).

Besides the quantities, both say what was compared and what was not, and why
(:mod:`refppo.oracle.coverage`), and where every setting came from; the text's ``convention:`` line
shows the keys that differ from the preset (or refppo's defaults), all of them under ``verbose``.
The JSON holds no NaN or infinity (:func:`finite_json`): a value that is not a number is ``null``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from refppo.dump.load import Dump
from refppo.dump.tolerances import TOLERANCES
from refppo.oracle.check.diagnose import CheckResult
from refppo.oracle.coverage import METRICS, NOT_IN_DUMP, intent_warnings, no_sidecar_text, not_compared
from refppo.oracle.detect.detection import Detection

SOURCE_WORDS = {"set": "--set", "sidecar": "the sidecar", "preset": "preset", "default": "refppo's defaults"}


@dataclass
class Context:
    """What the report says around the comparison: each setting's source
    (:func:`refppo.oracle.coverage.sources`), the convention a preset (or refppo) has by default,
    and the outputs that must be compared (``require``)."""

    sources: dict[str, str]
    baseline: dict[str, Any]
    required: list[str] = field(default_factory=list)

    def hparams_from(self, preset: str | None) -> str:
        """``from the sidecar: gamma, lam; preset verl's defaults: vf_coef; ...`` (hyperparameters)."""
        from refppo.pipeline.settings import HPARAM_KEYS

        groups: dict[str, list[str]] = {}
        for k in HPARAM_KEYS:
            if k == "kl_loss_coef" and k not in self.sources:
                continue  # kl_in=both's own β: listed only when set (the line of before otherwise)
            groups.setdefault(self.sources.get(k, "default"), []).append(k)
        words = {**SOURCE_WORDS, "preset": f"preset {preset}'s defaults"}
        parts = [f"{words[src]}: {', '.join(keys)}" for src, keys in groups.items()]
        return "hyperparameters from " + "; ".join(parts)


def finite_json(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by None (JSON has no NaN or Infinity)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def _dtype_name(dump: Dump) -> str:
    return str(dump.dtype).replace("torch.", "")


def _coverage_json(dump: Dump, result: CheckResult, ctx: Context | None) -> dict[str, Any]:
    """``compared``, ``not_compared`` (output → why), ``warnings``, ``required``/``required_missing``,
    ``sidecar`` and the sources of the settings."""
    out: dict[str, Any] = {
        "compared": list(result.quantities),
        "not_compared": not_compared(dump, result),
        "warnings": intent_warnings(dump, result),
        "sidecar": _sidecar_json(dump),
    }
    if ctx is not None:
        from refppo.pipeline.settings import HPARAM_KEYS

        out["required"] = list(ctx.required)
        out["required_missing"] = [n for n in ctx.required if n not in result.quantities]
        out["hparams_source"] = {k: ctx.sources[k] for k in HPARAM_KEYS if k in ctx.sources}
        out["convention_source"] = {k: v for k, v in ctx.sources.items() if k not in HPARAM_KEYS}
    return out


def _sidecar_json(dump: Dump) -> str | None:
    if dump.hparams_path is not None:
        return str(dump.hparams_path)
    return None if dump.sidecar_keys is None else "<in memory>"


def json_report(
    dump: Dump,
    result: CheckResult,
    preset: str | None,
    detection: Detection | None = None,
    nearest: CheckResult | None = None,
    ctx: Context | None = None,
) -> dict[str, Any]:
    tol = TOLERANCES[dump.dtype]
    out: dict[str, Any] = {
        "match": result.match,
        "first_divergence": result.first_divergence,
        "quantities": {n: r.as_json() for n, r in result.quantities.items()},
        "convention": _jsonable(result.setup.convention_dict()),
        "hparams": result.setup.hparams_dict(),
        "diagnosis": list(result.diagnosis),
        "explained_by": result.explained_by,
        "preset": preset,
        "dump": {
            "path": str(dump.path),
            "B": dump.B,
            "T": dump.T,
            "dtype": _dtype_name(dump),
            "rtol": tol.rtol,
            "atol": tol.atol,
            "hparams_file": str(dump.hparams_path) if dump.hparams_path else None,
            "world_size": dump.step.world_size,
            "micro_batches": dump.step.micro_batches,
            "separate_critic": dump.step.separate_critic,
        },
    }
    out.update(_coverage_json(dump, result, ctx))
    if detection is not None:
        from refppo.oracle.detect.report import detection_json

        out.update(detection_json(dump, result, detection, nearest))
    clean: dict[str, Any] = finite_json(out)
    return clean


def _step_text(dump: Dump) -> str:
    """`` step: W ranks × K micro-batches`` for a v2 dump that says so (empty for a v1 dump)."""
    st = dump.step
    if st.world_size == 1 and st.micro_batches == 1 and not st.separate_critic:
        return ""
    critic = ", separate critic" if st.separate_critic else ""
    return f"\nstep:       {st.world_size} rank(s) × {st.micro_batches} micro-batch(es) per rank{critic}"


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


def _fmt(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join("none" if x is None else f"{x:g}" for x in v)
    if v is None:
        return "none"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _conv_line(conv: dict[str, Any], ctx: Context | None = None, preset: str | None = None) -> str:
    """``key=value`` pairs; the critic-free estimator's options (``group_*``) only when they apply.

    With ``ctx`` only the keys that differ from ``ctx.baseline`` (the preset's conventions, else
    refppo's defaults), each with its source, then what the rest are."""
    parts = []
    for k, v in conv.items():
        if k.startswith("group_") and conv.get("advantage", "gae") == "gae":
            continue
        if ctx is not None and _fmt(v) == _fmt(ctx.baseline.get(k)):
            continue
        src = "" if ctx is None else f" ({SOURCE_WORDS[ctx.sources.get(k, 'default')]})"
        parts.append(f"{k}={_fmt(v)}{src}")
    if ctx is None:
        return " ".join(parts)
    rest = f"preset {preset}'s" if preset else "refppo's defaults"
    if not parts:
        return f"{rest} (-v lists every key)"
    return ", ".join(parts) + f"; the rest {rest} (-v lists every key)"


def _hparams_lines(result: CheckResult, ctx: Context | None, preset: str | None) -> list[str]:
    line = "hparams:    " + " ".join(f"{k}={v}" for k, v in result.setup.hparams_dict().items())
    if ctx is None:
        return [line]
    return [line, "            " + ctx.hparams_from(preset)]


def _rel_text(r: Any) -> str:
    """The max_rel_err column: ``ref = 0`` where the reference is 0 at every compared position
    (a relative error is then not a number), ``nan`` where the dump holds NaN there."""
    if r.ref_zero and r.max_abs_err > 0:
        return "ref = 0"
    if math.isnan(r.max_rel_err):
        return "nan"
    return f"{r.max_rel_err:.3e}"


def _coverage_lines(dump: Dump, result: CheckResult, ctx: Context | None) -> list[str]:
    """``compared: ...``, ``not compared: ... (why)``, the warnings, the required outputs missing."""
    lines = [f"compared:     {', '.join(result.quantities) or '(nothing)'}"]
    why: dict[str, list[str]] = {}
    for n, reason in not_compared(dump, result).items():
        why.setdefault(reason, []).append(n)
    if why:
        lines.append("not compared: " + "; ".join(f"{', '.join(ns)} ({r})" for r, ns in why.items()))
    lines += [f"warning: {w}" for w in intent_warnings(dump, result)]
    missing = [] if ctx is None else [n for n in ctx.required if n not in result.quantities]
    if missing:
        lines.append(
            f"REQUIRED BUT NOT COMPARED: {', '.join(missing)}; dump them, or name what must be compared "
            "(assert_step_matches(require=(...)), refppo diff --require KEY,...; require=() for none)"
        )
    elif result.match and (absent := [n for n in why.get(NOT_IN_DUMP, []) if n not in METRICS]):
        lines.append(
            f"note: {', '.join(absent)}: the dump's inputs allow them, the dump does not hold them, so "
            "they were not checked (a CI gate requires them: refppo diff --require all, assert_step_matches)"
        )
    return lines


def text_report(
    dump: Dump,
    result: CheckResult,
    preset: str | None,
    detection: Detection | None = None,
    nearest: CheckResult | None = None,
    ctx: Context | None = None,
    verbose: bool = False,
) -> str:
    tol = TOLERANCES[dump.dtype]
    conv = result.setup.convention_dict()
    lines = [
        f"refppo diff: {dump.path}  (B={dump.B}, T={dump.T}, {_dtype_name(dump)}: "
        f"rtol={tol.rtol:g}, atol={tol.atol:g}; preset {preset or 'none'}){_step_text(dump)}",
        f"convention: {_conv_line(conv, None if verbose else ctx, preset)}",
        *_hparams_lines(result, ctx, preset),
        "",
        f"{'quantity':<14}{'max_abs_err':>13}{'max_rel_err':>13}{'tol':>11}  ok",
    ]
    if dump.sidecar_keys is None:  # first: every hyperparameter below is a default, not the run's
        lines.insert(1, f"{no_sidecar_text(dump)}: the hyperparameters below are defaults, not the run's")
    for name, r in result.quantities.items():
        mark = "ok" if r.ok else "NOT OK"
        first = "   <- first divergence" if name == result.first_divergence else ""
        lines.append(f"{name:<14}{r.max_abs_err:>13.3e}{_rel_text(r):>13}{r.tol:>11.2e}  {mark}{first}")
    lines.append("")
    if result.match:
        lines.append(f"MATCH: all {len(result.quantities)} quantities in the dump match the reference.")
    elif not result.quantities:
        lines.append("MISMATCH: the checked convention cannot run on this dump's inputs (see diagnosis).")
    else:
        lines.append(f"MISMATCH: first divergence at {result.first_divergence}.")
    lines += _coverage_lines(dump, result, ctx)
    if result.diagnosis:
        lines.append("diagnosis:")
        lines += [f"  - {d}" for d in result.diagnosis]
    if detection is not None:
        from refppo.oracle.detect.report import detection_text

        lines += detection_text(dump, result, detection, nearest)
    return "\n".join(lines)
