"""One check of a dump under one setting: compare every quantity, find the first divergence, explain it.

The explanation re-runs the reference with one convention key changed at a time (only keys that can
affect the divergent quantity; a critic-free dump's estimator and its ``group_*`` options too, where
they apply: :func:`_applies`) and with each known bug of :data:`refppo.oracle.check.recompute.BUGS`
re-enacted; a candidate *explains* the divergence when, under it, the divergent quantity and every
quantity before it in pipeline order match the dump. A candidate under which later quantities still
differ is reported as explaining the first divergence *only*, naming what still differs. A known
bug that explains every quantity silences the hints it makes wrong (the scalar's "constant factor"
hint, "no named gradient pattern"); a gradient first divergence tries the known bugs too when no
gradient pattern explains everything (:func:`_grad_explanation`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from refppo.conventions import AdvantageEstimator
from refppo.core._group_checks import GROUP_ESTIMATORS
from refppo.core.gae import has_holes
from refppo.dump.load import Dump
from refppo.dump.tolerances import TOLERANCES
from refppo.errors import RefPPOError
from refppo.oracle.check.alternatives import AFFECTS, ALTERNATIVES, GROUP_ALTERNATIVES, STD_ESTIMATORS
from refppo.oracle.check.bug_terms import nonfinite_alike
from refppo.oracle.check.compare import FACTOR_HINT, QuantityResult, compare, describe
from refppo.oracle.check.fastcheck import PrefixCheck, RolloutMemo
from refppo.oracle.check.grad import GRAD_QUANTITIES, UpdateInputs, grad_tolerance
from refppo.oracle.check.grad_diagnose import explain_grad
from refppo.oracle.check.grad_notes import first_line
from refppo.oracle.check.recompute import BUGS, Reference, recompute
from refppo.oracle.check.settings import Setup
from refppo.oracle.presets.registry import PRESETS
from refppo.pipeline.bugs import BUGS as BUG_TABLE
from refppo.pipeline.bugs import affected
from refppo.pipeline.rollout import same_slots_as_after_last_valid
from refppo.pipeline.stages import OUTPUTS, ROLLOUT_OUTPUTS


def _applies(key: str, upd: dict[str, Any], setup: Setup, dump: Dump) -> bool:
    """Whether the single change ``upd`` of the critic-free ``key`` can change anything under
    ``setup``: none under ``gae`` (a GAE dump is not re-run through every estimator); a group
    estimator only with a ``group_index``; σ's options only under ``grpo``/``grpo-passk`` (the
    batch levels only with more than one prompt); ``group_singleton`` only with a group of one;
    ``group_kl`` only with a reward KL (``kl_in=reward``, ``kl_coef`` > 0); a rollout correction
    (``rollout_correction``) only on a dump with ``rollout_logprobs``; ``gae_bootstrap`` only under
    ``gae`` on a dump with ``bootstrap_values``; ``score_at`` none that gives another's slots."""
    if key == "score_at":  # after_last_valid_unless_first only where a one-token row tells it apart
        return not same_slots_as_after_last_valid(dump.mask, upd["score_at"])
    if key == "rollout_correction":  # the weight reads the behaviour log-probs
        return "rollout_logprobs" in dump.tensors
    if key == "gae_bootstrap":  # GAE's bootstrap reads the dumped values after the last token
        return "bootstrap_values" in dump.tensors and setup.conv.adv.estimator is AdvantageEstimator.GAE
    if key not in GROUP_ALTERNATIVES:  # the group options (the same keys as _GROUP of its module)
        return True
    conv = setup.conv
    if conv.adv.estimator is AdvantageEstimator.GAE:
        return False
    groups = dump.tensors.get("group_index")
    if key == "advantage":
        return groups is not None or upd["advantage"] in ("reinforce++", "flash-reinforce")
    if groups is None or conv.adv.estimator not in GROUP_ESTIMATORS:
        return False
    if key in ("group_std", "group_eps", "group_std_level"):
        several = int(torch.unique(groups).numel()) > 1
        return conv.adv.estimator in STD_ESTIMATORS and (key != "group_std_level" or several)
    if key == "group_singleton":
        return bool((torch.unique(groups, return_counts=True)[1] == 1).any())
    return conv.kl.placement.in_reward and setup.hp.kl_coef > 0


BUG_AFFECTS: dict[str, frozenset[str]] = {n: affected(b) & frozenset(OUTPUTS) for n, b in BUG_TABLE.items()}
"""The outputs each bug of :data:`BUGS` can change (only a divergence there is tried on it): what its
replaced stages (or the stages reading its swapped inputs) make and everything downstream
(:func:`refppo.pipeline.bugs.affected`)."""
BUG_NEEDS: dict[str, tuple[str, ...]] = {n: b.needs for n, b in BUG_TABLE.items()}
"""The dump keys a bug's re-enactment reads beyond the inputs every dump holds."""


@dataclass
class CheckResult:
    """The outcome of one check (what the report prints)."""

    setup: Setup
    quantities: dict[str, QuantityResult]
    first_divergence: str | None
    diagnosis: list[str] = field(default_factory=list)
    explained_by: list[dict[str, Any]] = field(default_factory=list)

    @property
    def match(self) -> bool:
        return self.first_divergence is None


def compare_all(
    dump: Dump, ref: Reference, known: dict[str, QuantityResult] | None = None, *, alike: bool = False
) -> dict[str, QuantityResult]:
    """Every quantity present in both the dump and the reference, in pipeline order.

    ``known``: results already compared for some of them (the same tensors: ``ref`` continues the
    rollout they were compared on), taken as they are. ``alike``: a NaN (an infinity) of the dump
    where the reference has one too compares equal (a bug's re-enactment: :func:`nonfinite_alike`).
    """
    tol = TOLERANCES[dump.dtype]
    out: dict[str, QuantityResult] = {}
    for name in OUTPUTS:
        if known is not None and name in known:
            out[name] = known[name]
        elif dump.has(name) and name in ref.values:
            cm = ref.compare_mask(name)
            qtol = grad_tolerance(tol) if name in GRAD_QUANTITIES else tol
            d, r = nonfinite_alike(dump.tensors[name], ref.values[name], alike)
            res = compare(name, d, r, cm, qtol)
            if not res.ok and name in ref.widen:  # clip fractions: allow rounding ties (computed lazily)
                res = compare(name, d, r, cm, tol, widen=ref.widen[name]())
            out[name] = res
            dump.release(name)  # its pages are read again from the file when next compared
    return out


def first_divergence(results: dict[str, QuantityResult]) -> str | None:
    for name, r in results.items():
        if not r.ok:
            return name
    return None


def _prefix_ok(results: dict[str, QuantityResult], upto: str) -> bool:
    for name, r in results.items():
        if not r.ok:
            return False
        if name == upto:
            return True
    return False


def _presets_using(updates: dict[str, Any]) -> list[str]:
    names = []
    for name, p in PRESETS.items():
        if not any(k in p.conventions for k in updates):
            continue
        if all(p.conventions.get(k, object()) == v for k, v in updates.items() if k in p.conventions):
            names.append(name)
    return names


def _fmt_updates(updates: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_fmt_value(v)}" for k, v in updates.items())


def _fmt_value(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, tuple):
        return ",".join(_fmt_value(x) for x in v)
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(getattr(v, "value", v))


def _candidate(
    dump: Dump, first: str, prefix_ok: PrefixCheck, alt: Setup, bug: str | None = None
) -> dict[str, QuantityResult] | None:
    """Every quantity under ``alt`` (and ``bug``), or None when ``first`` or a quantity before it
    still differs. The rollout stage is tested alone first (cheap): a rollout-stage ``first`` must
    match there, and for a later ``first`` every dumped rollout quantity (all of them come before
    it); only a candidate that passes is recomputed in full, to say whether it explains everything."""
    if not prefix_ok(alt, bug):  # differs at kl/token_rewards already
        return None
    early = first in ROLLOUT_OUTPUTS
    ro = recompute(dump, alt, bug=bug, rollout_only=True)
    res = compare_all(dump, ro, alike=bug is not None)
    if not (_prefix_ok(res, first) if early else all(r.ok for r in res.values())):
        return None
    # continue the rollout just recomputed with the update stage (not steps 1-4 again), holding
    # only what the update reads: the rollout quantities are compared already
    slim = ro.slim()
    del ro
    full = compare_all(dump, recompute(dump, alt, bug=bug, rollout=slim), known=res, alike=bug is not None)
    return full if early or _prefix_ok(full, first) else None


def _worth_trying(key: str, upd: dict[str, Any], current: dict[str, Any], setup: Setup, dump: Dump) -> bool:
    """A change ``upd`` of ``key`` that differs from ``current``, is not a duplicate of another
    candidate and applies to this dump (:func:`_applies`)."""
    norm = {k: (tuple(v) if isinstance(v, list) else v) for k, v in current.items()}
    if all(_same(norm.get(k), v) for k, v in upd.items()):
        return False
    if key == "value_loss_agg" and _same(upd["value_loss_agg"], norm.get("loss_agg")):
        return False  # the same as value_loss_agg=none (also tried): report one of the two
    return _applies(key, upd, setup, dump)


DETECT_HINT = "run with --detect to search the convention space"
"""The closing advice of a divergence nothing explains (left out of a report that ran ``--detect``)."""


def _closing_note(notes: list[str], found: list[dict[str, Any]], first: str) -> str | None:
    """What :func:`explain` adds when nothing (or nothing complete) explains ``first``."""
    if not notes:
        return f"no single convention change or known bug explains it; {DETECT_HINT}"
    if not any(f["all_match"] for f in found):
        return (
            f"no single convention change or known bug explains every quantity: besides what explains "
            f"{first}, something else differs too ({DETECT_HINT})"
        )
    return None


def _on_off(setup: Setup) -> str:
    return "on" if setup.conv.rollout.on else "off"


def explain(dump: Dump, setup: Setup, first: str) -> tuple[list[str], list[dict[str, Any]]]:
    """Single convention changes and known bugs under which ``first`` (and all before it) match."""
    notes: list[str] = []
    found: list[dict[str, Any]] = []
    current = setup.convention_dict()
    prefix_ok = PrefixCheck(dump, first)
    for key in AFFECTS[first]:
        for upd in {**ALTERNATIVES, **GROUP_ALTERNATIVES}[key]:
            if not _worth_trying(key, upd, current, setup, dump):
                continue
            try:
                alt = setup.with_convention(upd)
                res = _candidate(dump, first, prefix_ok, alt)
            except RefPPOError:
                continue
            if res is not None:
                users = _presets_using(upd)
                tail = f" (as in preset {', '.join(users)})" if users else ""
                if key == "rollout_correction":
                    tail += f" (the checked setting has the rollout correction {_on_off(setup)})"
                notes.append(_explained(f"the convention {_fmt_updates(upd)}{tail}", first, res))
                everything = first_divergence(res) is None
                found.append({"kind": "convention", "change": alt_json(upd), "all_match": everything})
    bug_notes, bug_found = explain_bugs(dump, setup, first, prefix_ok)
    notes += bug_notes
    found += bug_found
    closing = _closing_note(notes, found, first)
    return notes if closing is None else [*notes, closing], found


def explain_bugs(
    dump: Dump, setup: Setup, first: str, prefix_ok: PrefixCheck | None = None
) -> tuple[list[str], list[dict[str, Any]]]:
    """The known bugs of :data:`BUGS` under which ``first`` (and all before it) match, each
    re-enacted by :func:`recompute` and compared quantity by quantity (:func:`_candidate`)."""
    notes: list[str] = []
    found: list[dict[str, Any]] = []
    prefix_ok = PrefixCheck(dump, first) if prefix_ok is None else prefix_ok
    for bug, text in BUGS.items():
        if first not in BUG_AFFECTS[bug] or not all(k in dump.tensors for k in BUG_NEEDS.get(bug, ())):
            continue
        try:
            res = _candidate(dump, first, prefix_ok, setup, bug)
        except (RefPPOError, ValueError):
            continue
        if res is not None:
            notes.append(_explained(f"a known bug ({bug}): {text}", first, res))
            found.append({"kind": "bug", "bug": bug, "all_match": first_divergence(res) is None})
    return notes, found


def _explained(what: str, first: str, res: dict[str, QuantityResult]) -> str:
    """One diagnosis line for a candidate under which ``first`` and everything before it match.

    A candidate that leaves later quantities differing is said to explain ``first`` only — it is
    part of the story, not a fix ("... explains token_rewards only; advantages still differ").
    """
    still = [n for n, r in res.items() if not r.ok]
    if not still:
        return f"explained by {what}; with it every quantity in the dump matches"
    verb = "differs" if len(still) == 1 else "differ"
    return f"{what} explains {first} only; {', '.join(still)} still {verb} (not a fix on its own)"


def alt_json(upd: dict[str, Any]) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else getattr(v, "value", v)) for k, v in upd.items()}


def _same(a: Any, b: Any) -> bool:
    a = getattr(a, "value", a)
    b = getattr(b, "value", b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return tuple(a) == tuple(b)
    return bool(a == b)


def _recheck(
    dump: Dump, setup: Setup, rollouts: RolloutMemo | None
) -> tuple[dict[str, QuantityResult], Reference]:
    """Every quantity's comparison under ``setup`` and the reference of the update stage.

    Steps 1-4 first, compared at once; the update stage then continues a slim copy of them (what
    it reads, and the first divergent rollout quantity for describe()): one reference at a time."""
    ro = recompute(dump, setup, rollout_only=True) if rollouts is None else rollouts.get(setup)
    known = compare_all(dump, ro)
    first_ro = first_divergence(known)
    slim = ro.slim(() if first_ro is None else (first_ro,))
    del ro
    ref = recompute(dump, setup, rollout=slim)
    del slim
    return compare_all(dump, ref, known=known), ref


def _padding_notes(out: CheckResult, dump: Dump, where: str) -> None:
    """No output to compare; outputs equal on valid tokens that differ at ignored positions."""
    if not out.quantities:
        out.diagnosis.append("the dump holds no trainer outputs to compare (only inputs)")
    for name, r in out.quantities.items():
        if r.ok and r.padding_diff:
            out.diagnosis.append(
                f"{name}: also differs at {r.padding_diff} {where} (not compared: they are ignored)"
            )


def _first_lines(dump: Dump, ref: Reference, first: str, r: QuantityResult, where: str) -> list[str]:
    """The first divergence of a non-gradient quantity: its line and the description of how."""
    lines = [
        f"first divergence: {first} (max abs err {r.max_abs_err:.3g} > tol {r.tol:.3g}); "
        "later quantities may inherit it"
    ]
    lines += describe(
        first, dump.tensors[first], ref.values[first], ref.compare_mask(first), dump.mask, r.tol
    )
    if r.padding_diff:
        lines.append(f"{first}: also differs at {r.padding_diff} {where} (not compared)")
    return lines


def _explain_first(
    out: CheckResult, dump: Dump, setup: Setup, first: str, inp: UpdateInputs | None, grad_bad: bool
) -> None:
    """The convention changes that explain a non-gradient first divergence (:func:`explain`), and
    the gradient's explanation (:func:`explain_grad` on ``inp``) when a gradient diverges too."""
    notes, found = explain(dump, setup, first)
    everything = any(f["all_match"] for f in found)  # re-checked on every quantity, gradients too
    if grad_bad and inp is not None and not everything:  # e.g. pg_loss logged per micro-batch
        g_notes, g_found = explain_grad(dump, setup, inp, out.quantities)
        if g_found and not found:  # the gradient's explanation replaces "nothing explains it"
            notes = [n for n in notes if not n.startswith("no single convention change")]
        notes += g_notes
        found += g_found
    if any(f["all_match"] and f["kind"] == "bug" for f in found):  # the hint points elsewhere
        out.diagnosis = [line.replace(FACTOR_HINT, "") for line in out.diagnosis]
    out.diagnosis += notes
    out.explained_by = found


def _grad_explanation(
    dump: Dump, setup: Setup, first: str, inp: UpdateInputs, results: dict[str, QuantityResult]
) -> tuple[list[str], list[dict[str, Any]]]:
    """A gradient first divergence: :func:`explain_grad`'s lines and, when no gradient pattern
    explains every quantity, the known bugs re-enacted (:func:`explain_bugs`: a bug of the update
    stage, or of the rollout when the dump holds no rollout quantity it would change)."""
    notes, found = explain_grad(dump, setup, inp, results)
    if any(f["all_match"] or f.get("bug") == "non_finite" for f in found):
        return notes, found
    b_notes, b_found = explain_bugs(dump, setup, first)
    if b_found:  # named after all: not "no named gradient pattern reproduces ..."
        notes = [n for n in notes if not n.startswith("no named gradient pattern")]
    return notes + b_notes, found + b_found


def check(
    dump: Dump, setup: Setup, *, explain_divergence: bool = True, rollouts: RolloutMemo | None = None
) -> CheckResult:
    """Compare every quantity under ``setup``; diagnose and explain the first divergence.

    ``rollouts``: steps 1–4 are taken from (and kept in) this memo (``--detect``'s re-checks).
    """
    results, ref = _recheck(dump, setup, rollouts)
    first = first_divergence(results)
    out = CheckResult(setup, results, first)
    where = "masked positions (padding and holes)" if has_holes(dump.mask) else "padded positions"
    _padding_notes(out, dump, where)
    grad_bad = any(not r.ok for n, r in results.items() if n in GRAD_QUANTITIES)
    if first is not None and first in GRAD_QUANTITIES:
        r = results[first]
        out.diagnosis.append(first_line(dump, first, r.max_abs_err, r.tol))
        if explain_divergence and ref.update_inputs is not None:
            g_inp = ref.update_inputs
            del ref  # the bug candidates recompute their own
            notes, found = _grad_explanation(dump, setup, first, g_inp, results)
            out.diagnosis += notes
            out.explained_by = found
    elif first is not None:
        inp = ref.update_inputs if grad_bad else None  # held through explain() only when used there
        out.diagnosis += _first_lines(dump, ref, first, results[first], where)
        del ref  # the candidates below recompute their own: never hold two references at once
        if explain_divergence:
            _explain_first(out, dump, setup, first, inp, grad_bad)
    out.diagnosis += dump.key_notes()
    return out
