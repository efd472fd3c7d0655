"""Text and JSON of a detection (``--detect``): counts, the keys that differ, fitted maps.

An entry of ``detected`` is a full convention; what a reader needs is how it differs from the
convention that was checked (preset + ``--set`` + sidecar), so the text prints only those keys
and the JSON carries them as ``detected_changes``.
"""

from __future__ import annotations

from typing import Any

from refppo.oracle.check.diagnose import CheckResult
from refppo.oracle.detect.detection import HP_KEYS, Detection

SHOWN = 10
"""Detected conventions printed by the text report (the JSON holds up to 50)."""


def checked_convention(result: CheckResult) -> dict[str, Any]:
    """The checked setting in the key space of a detected entry (conventions + solvable hparams)."""
    out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in result.setup.convention_dict().items()}
    out.update({k: getattr(result.setup.hp, k) for k in HP_KEYS})
    return out


def changes(checked: dict[str, Any], conv: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``conv`` whose value differs from ``checked`` (in ``conv``'s order)."""
    return {k: v for k, v in conv.items() if v != checked.get(k)}


def detection_json(result: CheckResult, detection: Detection, nearest: CheckResult | None) -> dict[str, Any]:
    checked = checked_convention(result)
    out: dict[str, Any] = {
        "detected": detection.detected,
        "detected_count": detection.n_detected,
        "detected_rechecked": detection.n_rechecked,
        "detected_changes": [changes(checked, c) for c in detection.detected],
        "undetermined_keys": detection.undetermined,
        "solved": detection.solved,
        "fitted": detection.fitted,
        "detect_notes": detection.notes,
        "nearest": None,
    }
    if detection.nearest is not None and nearest is not None:
        out["nearest"] = {
            "convention": detection.nearest,
            "changes": changes(checked, detection.nearest),
            "unmatched_stages": detection.unmatched_stages,
            "still_differs": [n for n, r in nearest.quantities.items() if not r.ok],
            "quantities": {n: r.as_json() for n, r in nearest.quantities.items()},
        }
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(_fmt(x) for x in v)
    if v is None:
        return "none"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _line(ch: dict[str, Any]) -> str:
    return " ".join(f"{k}={_fmt(v)}" for k, v in ch.items()) or "(the checked convention itself)"


def detection_text(result: CheckResult, detection: Detection, nearest: CheckResult | None) -> list[str]:
    checked = checked_convention(result)
    lines = [""]
    if detection.detected:
        n, shown = detection.n_detected, min(SHOWN, len(detection.detected))
        lines.append(
            f"detect: {n} convention(s) reproduce the dump; showing {shown}, nearest to the checked one "
            "first, as the keys that differ from it:"
        )
        lines += [f"  * {_line(changes(checked, c))}" for c in detection.detected[:shown]]
        if detection.undetermined:
            lines.append(f"  keys the dump does not pin down: {', '.join(detection.undetermined)}")
        if detection.solved:
            lines.append(
                "  read off the data (not in the named options; confirmed through the pipeline): "
                + "; ".join(f"{k}={' or '.join(_fmt(v) for v in vs)}" for k, vs in detection.solved.items())
            )
    else:
        lines.append("detect: no convention in the search space reproduces the dump.")
        if detection.nearest is not None:
            lines.append(f"  nearest: {_line(changes(checked, detection.nearest))}")
            if nearest is not None:
                still = [n for n, r in nearest.quantities.items() if not r.ok]
                lines.append(f"  still differs: {', '.join(still) or '(nothing: within tolerance)'}")
                lines += [f"    - {d}" for d in nearest.diagnosis if d.startswith(tuple(still))][:6]
    lines += [f"  note: {n}" for n in detection.notes]
    if detection.fitted:
        lines.append("  fitted (what the dump holds where no convention reproduces it):")
        lines += [f"    - {f}" for f in detection.fitted]
    return lines
