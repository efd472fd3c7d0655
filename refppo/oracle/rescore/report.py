"""Text and JSON renderings of a re-score (:func:`refppo.oracle.rescore.run.rescore_dump`)."""

from __future__ import annotations

from typing import Any

from refppo.oracle.rescore.readouts import RescoreItem, fmt_stats


def rescore_json(items: list[RescoreItem], temperature: float) -> dict[str, Any]:
    """The report's ``rescore`` object: one entry per compared key."""
    return {
        "match": all(i.ok for i in items),
        "temperature": temperature,
        "items": [
            {
                "role": i.role,
                "key": i.key,
                **i.result.as_json(),
                "precision": i.precision,
                "explained_by": [
                    {
                        "name": f.name,
                        "text": f.text,
                        "recheck": None if f.check is None else f.check.as_json(),
                    }
                    for f in i.findings
                ],
                "notes": list(i.notes),
            }
            for i in items
        ],
    }


def rescore_text(items: list[RescoreItem], temperature: float) -> str:
    """A block of lines: each role's comparison, its named explanations and the precision statistics."""
    lines = [
        "re-score with the given checkpoints "
        f"(refppo's read-outs; temperature τ={temperature:g} from the sidecar)",
        f"{'role':<14}{'dump key':<14}{'max_abs_err':>13}{'tol':>11}  ok",
    ]
    for i in items:
        r = i.result
        lines.append(
            f"{i.role:<14}{i.key:<14}{r.max_abs_err:>13.3e}{r.tol:>11.2e}  {'ok' if r.ok else 'NOT OK'}"
        )
    for i in items:
        for f in i.findings:
            chk = (
                ""
                if f.check is None
                else f" (re-checked: max abs err {f.check.max_abs_err:.3e} <= tol {f.check.tol:.2e})"
            )
            lines.append(f"  - {i.role}/{i.key}: explained: {f.text}{chk}")
        for n in i.notes:
            lines.append(f"  - {i.role}/{i.key}: {n}")
        for what, s in i.precision.items():
            lines.append(f"  - {i.role}/{i.key}: precision {what}: {fmt_stats(s)}")
    ok = all(i.ok for i in items)
    lines.append("RE-SCORE MATCH." if ok else "RE-SCORE MISMATCH.")
    return "\n".join(lines)
