"""Text and JSON renderings of a check (and of a detection)."""

from __future__ import annotations

from typing import Any

from refppo.dump.load import TOLERANCES, Dump
from refppo.oracle.check.diagnose import CheckResult
from refppo.oracle.detect.detection import Detection


def _dtype_name(dump: Dump) -> str:
    return str(dump.dtype).replace("torch.", "")


def json_report(
    dump: Dump,
    result: CheckResult,
    preset: str | None,
    detection: Detection | None = None,
    nearest: CheckResult | None = None,
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
    if detection is not None:
        from refppo.oracle.detect.report import detection_json

        out.update(detection_json(result, detection, nearest))
    return out


def _step_text(dump: Dump) -> str:
    """`` step: W ranks × K micro-batches`` for a v2 dump that says so (empty for a v1 dump)."""
    st = dump.step
    if st.world_size == 1 and st.micro_batches == 1 and not st.separate_critic:
        return ""
    critic = ", separate critic" if st.separate_critic else ""
    return f"\nstep:       {st.world_size} rank(s) × {st.micro_batches} micro-batch(es) per rank{critic}"


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


def _conv_line(conv: dict[str, Any]) -> str:
    """``key=value`` pairs; the critic-free estimator's options (``group_*``) only when they apply."""
    parts = []
    for k, v in conv.items():
        if k.startswith("group_") and conv.get("advantage", "gae") == "gae":
            continue
        if isinstance(v, (list, tuple)):
            v = ",".join("none" if x is None else f"{x:g}" for x in v)
        elif v is None:
            v = "none"
        elif isinstance(v, float):
            v = f"{v:g}"
        parts.append(f"{k}={v}")
    return " ".join(parts)


def text_report(
    dump: Dump,
    result: CheckResult,
    preset: str | None,
    detection: Detection | None = None,
    nearest: CheckResult | None = None,
) -> str:
    tol = TOLERANCES[dump.dtype]
    lines = [
        f"refppo diff: {dump.path}  (B={dump.B}, T={dump.T}, {_dtype_name(dump)}: "
        f"rtol={tol.rtol:g}, atol={tol.atol:g}; preset {preset or 'none'}){_step_text(dump)}",
        f"convention: {_conv_line(result.setup.convention_dict())}",
        "hparams:    " + " ".join(f"{k}={v}" for k, v in result.setup.hparams_dict().items()),
        "",
        f"{'quantity':<14}{'max_abs_err':>13}{'max_rel_err':>13}{'tol':>11}  ok",
    ]
    for name, r in result.quantities.items():
        mark = "ok" if r.ok else "NOT OK"
        first = "   <- first divergence" if name == result.first_divergence else ""
        lines.append(f"{name:<14}{r.max_abs_err:>13.3e}{r.max_rel_err:>13.3e}{r.tol:>11.2e}  {mark}{first}")
    lines.append("")
    if result.match:
        lines.append(f"MATCH: all {len(result.quantities)} quantities in the dump match the reference.")
    elif not result.quantities:
        lines.append("MISMATCH: the checked convention cannot run on this dump's inputs (see diagnosis).")
    else:
        lines.append(f"MISMATCH: first divergence at {result.first_divergence}.")
    if result.diagnosis:
        lines.append("diagnosis:")
        lines += [f"  - {d}" for d in result.diagnosis]
    if detection is not None:
        from refppo.oracle.detect.report import detection_text

        lines += detection_text(result, detection, nearest)
    return "\n".join(lines)
