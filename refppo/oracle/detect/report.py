"""Text and JSON of a detection (``--detect``): counts, the keys that differ, fitted maps.

An entry of ``detected`` is a full convention; what a reader needs is how it differs from the
convention that was checked (preset + ``--set`` + sidecar), so the text prints only those keys
and the JSON carries them as ``detected_changes``.

When nothing reproduces the dump, the search's *nearest* convention is its best fit, not a finding:
a named explanation of the plain check (``explained_by`` with ``all_match``) outranks it (the
nearest is then not offered: ``nearest_outranked_by``), and a nearest whose changed keys are fixed
only by 0-dim dumped numbers (:data:`EVIDENCE`: a clip constant fitted to ``pg_loss``) says how
many numbers it rests on (``nearest.rests_on``).
"""

from __future__ import annotations

from typing import Any

from refppo.dump.load import Dump
from refppo.oracle.check.diagnose import CheckResult
from refppo.oracle.detect.classes import ConvClass
from refppo.oracle.detect.detection import HP_KEYS, Detection
from refppo.oracle.detect.evidence import Evidence, class_evidence, evidence

SHOWN = 10
"""Detected conventions printed by the text report (the JSON holds up to 50)."""
CLASSES_SHOWN = 5
"""Classes printed by the text report (the JSON holds every class)."""


def checked_convention(result: CheckResult) -> dict[str, Any]:
    """The checked setting in the key space of a detected entry (conventions + solvable hparams)."""
    out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in result.setup.convention_dict().items()}
    out.update({k: getattr(result.setup.hp, k) for k in HP_KEYS})
    return out


def changes(checked: dict[str, Any], conv: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``conv`` whose value differs from ``checked`` (in ``conv``'s order)."""
    return {k: v for k, v in conv.items() if v != checked.get(k)}


EVIDENCE: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("kl_estimator", "kl_log_ratio_clamp", "kl_value_clamp"), ("kl", "token_rewards")),
    **dict.fromkeys(
        ("kl_in", "score_at", "score_clip", "score_bias", "score_scale", "whiten_rewards"), ("token_rewards",)
    ),
    **dict.fromkeys(("gae_padding", "gae_holes"), ("returns", "advantages")),
    **dict.fromkeys(
        ("whiten_advantages", "whiten_variance", "whiten_eps_at", "whiten_holes"), ("advantages",)
    ),
    **dict.fromkeys(
        ("dual_clip", "log_ratio_clamp", "loss_agg", "policy_loss", "cliprange", "cliprange_high"),
        ("pg_loss", "pg_clipfrac", "grad_logprobs"),
    ),
    "approx_kl": ("approx_kl",),
    **dict.fromkeys(
        ("value_loss", "value_clip_form", "vf_mask", "value_loss_agg", "cliprange_value"),
        ("vf_loss", "vf_clipfrac", "grad_values"),
    ),
    "entropy_agg": ("entropy_loss",),
    "kl_loss_agg": ("kl_loss",),
    "kl_metric_agg": ("kl_loss",),
}
"""The dumped quantities that can pin each key (the stages of :mod:`refppo.oracle.detect.detection`); keys
not listed (the critic-free estimator's) are pinned by the rollout tensors."""


def rests_on(dump: Dump, changed: dict[str, Any], nearest: CheckResult | None) -> list[str] | None:
    """The 0-dim dumped quantities the ``changed`` keys of a nearest convention rest on, when no
    ``[B, T]`` tensor that could pin them supports them (a tensor of :data:`EVIDENCE` supports a
    key when it is dumped and matches under the nearest convention; one it does not match refutes,
    not supports); None when a tensor supports one, or nothing is dumped that could pin it."""
    names: list[str] = []
    matched = {} if nearest is None else {n: r.ok for n, r in nearest.quantities.items()}
    for k in changed:
        present = [n for n in EVIDENCE.get(k, ("advantages",)) if dump.has(n)]
        if any(dump.tensors[n].dim() > 0 and matched.get(n, False) for n in present):
            return None
        names += [n for n in present if dump.tensors[n].dim() == 0 and n not in names]
    return names or None


def detection_json(
    dump: Dump, result: CheckResult, detection: Detection, nearest: CheckResult | None
) -> dict[str, Any]:
    checked = checked_convention(result)
    out: dict[str, Any] = {
        "detected": detection.detected,
        "detected_count": detection.n_detected,
        "detected_rechecked": detection.n_rechecked,
        "detected_changes": [changes(checked, c) for c in detection.detected],
        "undetermined_keys": detection.undetermined,
        "solved": detection.solved,
        "evidence": {e.key: e.json() for e in _evidence(dump, detection)},
        "fitted": detection.fitted,
        "detect_notes": detection.notes,
        **classes_json(checked, detection, dump),
        "nearest": None,
        "nearest_outranked_by": [],
    }
    named = [e for e in result.explained_by if e.get("all_match")]
    if detection.nearest is not None and named and not detection.detected:
        out["nearest_outranked_by"] = named
    if detection.nearest is not None and nearest is not None:
        ch = changes(checked, detection.nearest)
        out["nearest"] = {
            "convention": detection.nearest,
            "changes": ch,
            "unmatched_stages": detection.unmatched_stages,
            "still_differs": [n for n, r in nearest.quantities.items() if not r.ok],
            "quantities": {n: r.as_json() for n, r in nearest.quantities.items()},
            "rests_on": rests_on(dump, ch, nearest),
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


def _named(e: dict[str, Any]) -> str:
    """An ``explained_by`` entry in a few words: the bug's id or the convention change."""
    if "change" in e:
        return _line(e["change"])
    return str(e.get("bug", e.get("kind", "?")))


def _nearest_lines(
    dump: Dump, result: CheckResult, detection: Detection, nearest: CheckResult | None
) -> list[str]:
    """The lines after "no convention reproduces the dump": the named explanation that outranks
    the search's nearest, or the nearest with what still differs and what it rests on."""
    named = [e for e in result.explained_by if e.get("all_match")]
    if named:
        return [
            f"  the diagnosis names what reproduces every quantity ({', '.join(_named(e) for e in named)}): "
            "a named explanation outranks the search's nearest fit, which is not offered"
        ]
    if detection.nearest is None:
        return []
    ch = changes(checked_convention(result), detection.nearest)
    lines = [f"  nearest: {_line(ch)}"]
    on = rests_on(dump, ch, nearest)
    if on:
        what = (
            f"one dumped number, {on[0]}" if len(on) == 1 else f"{len(on)} dumped numbers ({', '.join(on)})"
        )
        lines.append(
            f"  (this nearest rests on {what}, fitted by {len(ch)} changed key(s): a constant fitted to "
            "a number always comes close; it is a fit, not evidence of that convention)"
        )
    if nearest is not None:
        still = [n for n, r in nearest.quantities.items() if not r.ok]
        lines.append(f"  still differs: {', '.join(still) or '(nothing: within tolerance)'}")
        lines += [f"    - {d}" for d in nearest.diagnosis if d.startswith(tuple(still))][:6]
    return lines


def _evidence_lines(dump: Dump, detection: Detection) -> list[str]:
    """How many dumped observations fix each solved constant, and what to dump to pin the keys the
    dump leaves open (:mod:`refppo.oracle.detect.evidence`)."""
    evs = _evidence(dump, detection)
    lines = [f"  solved {e.text()}" for e in evs if e.free]
    by_missing: dict[str, list[str]] = {}
    same = (
        [] if detection.holes else [k for k in ("gae_holes", "whiten_holes") if k in detection.undetermined]
    )
    if same:
        lines.append(
            f"  {', '.join(same)}: the mask has no interior holes, so every choice gives the same values"
        )
    for e in evs:
        if not e.free and e.key not in same:
            by_missing.setdefault(e.missing[0] if e.missing else "", []).append(e.key)
    if by_missing:
        parts = [f"{q} ({', '.join(ks)})" for q, ks in by_missing.items() if q]
        if parts:
            lines.append(
                "  the first undumped output each open key can change (dump it to test them): "
                + "; ".join(parts)
            )
        if "" in by_missing:
            keys = ", ".join(by_missing[""])
            lines.append(
                f"  every output {keys} can change is dumped and agrees: here they give the same values"
            )
    return lines


def _evidence(dump: Dump, detection: Detection) -> list[Evidence]:
    """:func:`evidence` with the free parameters counted per class."""
    reps = [(c.representative, c.differing) for c in detection.classes.classes]
    return evidence(dump, detection.undetermined, detection.solved, reps)


def _class_evidence(dump: Dump | None, detection: Detection, c: ConvClass) -> list[Evidence]:
    if dump is None:
        return []
    return class_evidence(dump, c.representative, c.differing, detection.solved)


def classes_json(checked: dict[str, Any], detection: Detection, dump: Dump | None = None) -> dict[str, Any]:
    """``classes`` (every class of listed conventions, nearest first, each with the evidence of the
    solved constants it uses, counted in that class) and ``classes_unassigned``."""
    n = len(detection.detected)
    out = [
        {
            "size": c.size,
            "listed": len(c.members),
            "members": [i for i in c.members if i < n],
            "representative": c.representative,
            "changes": changes(checked, c.representative),
            "differing": c.differing,
            "to_separate_dump": c.separate,
            "evidence": {e.key: e.json() for e in _class_evidence(dump, detection, c)},
        }
        for c in detection.classes.classes
    ]
    return {"classes": out, "classes_unassigned": detection.classes.unassigned}


def class_lines(checked: dict[str, Any], detection: Detection, dump: Dump | None = None) -> list[str]:
    """The classes the dump cannot tell apart (when more than one convention is listed): each with
    its size, representative and the keys that differ inside it; then what to dump to separate the
    members of a class (the same for every class: it depends on the key and the dump only)."""
    cls = detection.classes.classes
    if detection.n_detected < 2 or not cls:
        return []
    lines = [
        f"  {len(cls)} class(es) the dump cannot tell apart (in a class every dumped quantity is "
        "bit-identical; between classes some dumped quantity differs, within tolerance):"
    ]
    sep: dict[str, str | None] = {}
    for ci, c in enumerate(cls[:CLASSES_SHOWN], 1):
        lines.append(f"  class {ci}: {c.size} convention(s) like {_line(changes(checked, c.representative))}")
        if c.differing:
            lines.append(
                "    inside it: "
                + "; ".join(f"{k}={'|'.join(_fmt(v) for v in vs)}" for k, vs in c.differing.items())
            )
        lines += [f"    solved {e.text()}" for e in _class_evidence(dump, detection, c)]
        sep.update(c.separate)
    if len(cls) > CLASSES_SHOWN:
        lines.append(f"  ... and {len(cls) - CLASSES_SHOWN} more class(es) (--json lists every class)")
    if sep:
        lines.append("  " + _separate(dict(sorted(sep.items()))))
    if detection.classes.unassigned:
        lines.append(
            f"  ({detection.classes.unassigned} counted convention(s) beyond the listed members of a walk "
            "group that spans classes are in no class)"
        )
    return lines


def _separate(sep: dict[str, str | None]) -> str:
    """What to dump to separate a class's members: each undumped output with the keys it tells apart."""
    by_q: dict[str, list[str]] = {}
    for k, q in sep.items():
        by_q.setdefault(q or "", []).append(k)
    parts = [f"{q} ({', '.join(ks)})" for q, ks in by_q.items() if q]
    out = f"to separate the members of a class, dump {'; '.join(parts)}" if parts else ""
    if "" in by_q:
        same = f"nothing separates {', '.join(by_q[''])} (every output it can change is dumped and agrees)"
        out = f"{out}; {same}" if out else same
    return out


def detection_text(
    dump: Dump, result: CheckResult, detection: Detection, nearest: CheckResult | None
) -> list[str]:
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
        lines += _evidence_lines(dump, detection)
        lines += class_lines(checked, detection, dump)
    else:
        lines.append("detect: no convention in the search space reproduces the dump.")
        lines += _nearest_lines(dump, result, detection, nearest)
    lines += [f"  note: {n}" for n in detection.notes]
    if detection.fitted:
        lines.append("  fitted (what the dump holds where no convention reproduces it):")
        lines += [f"    - {f}" for f in detection.fitted]
    return lines
