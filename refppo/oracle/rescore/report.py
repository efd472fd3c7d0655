"""Text and JSON renderings of a re-score (:func:`refppo.oracle.rescore.run.rescore_dump`)."""

from __future__ import annotations

from typing import Any

from refppo.oracle.rescore.engine import PRECISION_FACTOR, EngineItem
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
                "ok": i.ok,
                **_engine_json(i),
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
    w = max([14, *(len(i.key) + 2 for i in items)])  # 14: every key but rollout_logprobs fits
    lines = [
        "re-score with the given checkpoints "
        f"(refppo's read-outs; temperature τ={temperature:g} from the sidecar)",
        f"{'role':<14}{'dump key':<{w}}{'max_abs_err':>13}{'tol':>11}  ok",
    ]
    for i in items:
        r = i.result
        lines.append(f"{i.role:<14}{i.key:<{w}}{r.max_abs_err:>13.3e}{r.tol:>11.2e}  {_status(i)}")
    for i in items:
        for f in i.findings:
            chk = (
                ""
                if f.check is None
                else f" (re-checked: max abs err {f.check.max_abs_err:.3e} <= tol {f.check.tol:.2e})"
            )
            how = "precision" if f.name.startswith("precision_") else "explained"
            lines.append(f"  - {i.role}/{i.key}: {how}: {f.text}{chk}")
        for n in i.notes:
            lines.append(f"  - {i.role}/{i.key}: {n}")
        for what, s in i.precision.items():
            lines.append(f"  - {i.role}/{i.key}: precision {what}: {fmt_stats(s)}")
        if isinstance(i, EngineItem):
            lines.extend(_engine_lines(i))
    ok = all(i.ok for i in items)
    lines.append("RE-SCORE MATCH." if ok else "RE-SCORE MISMATCH.")
    return "\n".join(lines)


def _status(i: RescoreItem) -> str:
    if isinstance(i, EngineItem) and i.verdict == "precision":
        return "ok (within precision)"
    return "ok" if i.ok else "NOT OK"


def _engine_json(i: RescoreItem) -> dict[str, Any]:
    if not isinstance(i, EngineItem):
        return {}
    return {"verdict": i.verdict, "gates": i.gates, "precision_factor": PRECISION_FACTOR}


VERDICTS = {
    "match": "the engine's log-probs equal the trainer's forward within the tolerance",
    "precision": "the engine and the trainer differ within what precision explains (exit 0)",
    "explained": "the engine and the trainer disagree beyond precision; the named cause reproduces it",
    "disagree": "the engine and the trainer disagree beyond what precision explains; no named cause",
}


def _engine_lines(i: EngineItem) -> list[str]:
    g, at = i.gates, f"  - {i.role}/{i.key}"
    if not g.get("tokens"):
        return [f"{at}: verdict {i.verdict}: no valid token"]
    d = g["trust_delta"]
    return [
        f"{at}: gates: ratio exp(l_engine − l_trainer) mean {g['ratio_mean']:.4g} min {g['ratio_min']:.4g} "
        f"max {g['ratio_max']:.4g}; share outside [{1 - d:g}, {1 + d:g}] {g['share_outside_trust']:.3g}; "
        f"KL(engine‖trainer) k1 {g['kl_k1']:.3g} k3 {g['kl_k3']:.3g} (tokens sampled by the engine); "
        f"χ² token {g['chi2_token']:.3g} seq {g['chi2_seq']:.3g}; max|Δlogp| {g['max_abs_dlogp']:.3g} "
        f"over {int(g['tokens'])} tokens",
        f"{at}: verdict {i.verdict}: {VERDICTS[i.verdict]}",
    ]
