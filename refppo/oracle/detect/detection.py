"""``--detect``: every convention that reproduces a dump, found by walking the pipeline's stage table.

The walk (:func:`refppo.oracle.detect.steps.run_search`) runs the stages of
:data:`refppo.pipeline.stages.STAGES` in pipeline order, grouped in steps, each stage evaluated
through its own function (:meth:`refppo.oracle.detect.search.Search.evaluate`: row blocks, the
ratio buffer and memoisation are arguments of that evaluation, never a second formula). A step
walks the values of the keys it names (every member of an enum key; for a numeric one the peers'
constants and the checked setting's), compares the dumped quantities it names, and when no option
reproduces them its *solver* (:mod:`refppo.oracle.detect.solve`, :mod:`refppo.oracle.detect.solve_score`)
reads constants off the data and the step is walked again with them (a solver only proposes: what
it proposes is evaluated through the stages like any other value). The steps
(:data:`refppo.oracle.detect.steps.STEPS`; keys no step walks stay at the checked setting's value:
:data:`~refppo.oracle.detect.steps.NOT_WALKED`):

- ``kl`` (stages kl): walks kl_estimator, kl_log_ratio_clamp, kl_value_clamp; checked against kl;
  solver: the KL clamps.
- ``token_rewards`` (stages score_map, value_mask, rewards, reward_whitening): walks score_bias,
  score_scale, score_clip, kl_in, score_at, whiten_rewards, whiten_variance, whiten_eps_at,
  score_slot_kl; checked against token_rewards; solver: score bias and scale, score clip.
- ``returns`` (stages rollout_gate, advantages): walks advantage, gae_padding, gae_holes, group_std,
  group_std_level, group_singleton, group_kl, group_eps, gae_bootstrap, rollout_rs, rollout_rs_stat,
  rollout_rs_order, rollout_rs_reduce, rollout_rs_low, rollout_rs_high, rollout_rs_effect; checked
  against returns; solver: group_eps; nothing reproducing returns with rollout_logprobs and a
  critic: a drop_mask gate's band read off returns (detect/drop_gate.py).
- ``advantages`` (stages whitening): walks whiten_advantages, whiten_variance, whiten_eps_at,
  whiten_holes; checked against advantages; solver: (a fitted map, named).
- ``correction`` (stages rollout_correction): walks rollout_is, rollout_is_agg, rollout_is_mode,
  rollout_is_low, rollout_is_high, rollout_rs, rollout_rs_stat, rollout_rs_order, rollout_rs_reduce,
  rollout_rs_low, rollout_rs_high; checks nothing dumped; solver: the bounds C_low, C_high and the
  gates' thresholds read off pg_loss (before the walk: the weight is not dumped; the policy step
  checks it; not walked without rollout_logprobs).
- ``policy`` (stages policy, policy_agg, approx_kl, entropy, kl_loss): walks policy_loss, dual_clip,
  log_ratio_clamp, cliprange, cliprange_high, loss_agg, approx_kl, entropy_agg, kl_grad_is_clip,
  clipfrac_agg, clipfrac_counts, kl_loss_estimator, kl_loss_log_ratio_clamp, kl_loss_value_clamp,
  truncated_rows; checked against pg_loss, pg_clipfrac, approx_kl, entropy_loss, grad_logprobs;
  solver: dual-clip c, clip ranges (off pg_loss, or without it off grad_logprobs; walked with every
  policy_loss).
- ``value`` (stages value, value_agg): walks value_loss, value_clip_form, vf_mask, value_loss_agg,
  cliprange_value, truncated_rows; checked against vf_loss, vf_clipfrac, grad_values; solver: value
  clip range (off vf_loss, or without it off grad_values).
- ``loss`` (stages kl_loss, kl_metric, total): walks kl_loss_agg, kl_metric_agg, truncated_rows;
  checked against kl_loss, loss; solver: —.

A "fitted map" is reported (:attr:`Detection.fitted`) when no convention reproduces a step: the
affine map between the dump and refppo's raw values, for the batch or per row, with the statistics
it matches named (:func:`refppo.oracle.detect.solve.fit_normalisation`).

After each step, options whose stage outputs are bit-identical are merged into one group (so an
inactive clamp, say, never doubles the work of the steps after it), and when the dump holds a
quantity of the step only the groups that reproduce it go on. When none does, the nearest groups
go on and the step is recorded as unmatched. Groups are scored as they are made and the walk holds
a bounded number of typed ``[B, T]`` states (:mod:`refppo.oracle.detect.states`; the others are
replayed when read: :mod:`refppo.oracle.detect.groups`).

Since every value the walk compares is a stage's output, a listed convention is what the pipeline
computes for it. The :data:`VERIFIED` nearest (and, with ``grad_logprobs``, the nearest of each
``kl_estimator``, which only the gradient tells apart: :func:`_recheck`) are still re-checked
through :func:`refppo.oracle.check.diagnose.check`, which also compares the gradients; a convention
that fails it is dropped, and so are the unchecked entries of an estimator the re-check rejected.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from refppo.conventions import AdvantageEstimator, KLEstimator
from refppo.dump.load import Dump
from refppo.errors import ConventionError, RefPPOError
from refppo.oracle.check.diagnose import alt_json, check
from refppo.oracle.check.fastcheck import RolloutMemo
from refppo.oracle.check.settings import Setup
from refppo.oracle.detect.classes import Classes, classify
from refppo.oracle.detect.groups import Group, Marks
from refppo.oracle.detect.prune import prune_held, value_prune_for
from refppo.oracle.detect.search import HP_KEYS, PruneLostError, Search
from refppo.oracle.detect.steps import run_search
from refppo.pipeline.stages import OUTPUTS


@dataclass
class Detection:
    """The outcome of ``--detect``."""

    detected: list[dict[str, Any]]
    """Full conventions that reproduce the dump, nearest first. The first :attr:`n_rechecked`
    passed the re-check through the pipeline (:func:`_recheck`: the :data:`VERIFIED` nearest,
    with ``grad_logprobs`` also the nearest of each ``kl_estimator``); the rest come from the
    staged search alone, minus those of an estimator whose every re-checked entry failed."""
    n_detected: int
    """How many conventions reproduce it in all (``detected`` holds at most ``limit``)."""
    nearest: dict[str, Any] | None
    unmatched_stages: list[str]
    undetermined: list[str]
    fitted: list[str] = field(default_factory=list)
    """For each stage no convention reproduces: the map fitted between the dump and refppo."""
    solved: dict[str, list[Any]] = field(default_factory=dict)
    """Constants read off the data by a solver (not in the named options) that some entry of
    ``detected`` uses, i.e. that the pipeline confirmed."""
    notes: list[str] = field(default_factory=list)
    """What the data cannot decide, one line each: e.g. with one score on every row, the score
    maps ``(s + b)·k`` that reproduce it (the bias and the scale cannot be told apart)."""
    n_rechecked: int = 0
    """How many entries at the head of ``detected`` were re-checked through the pipeline."""
    holes: bool = True
    """Whether the dump's mask has an interior hole (else every ``gae_holes``/``whiten_holes``
    convention gives the same values)."""
    classes: Classes = field(default_factory=lambda: Classes([]))
    """Every listed convention (not only ``detected``) in classes the dump cannot tell apart: the
    members of a class give bit-identical values on every dumped quantity
    (:mod:`refppo.oracle.detect.classes`; member indices are positions in the nearest-first list
    that ``detected`` begins)."""


def _full(base: dict[str, Any], partial: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    out.update(alt_json(partial))
    for k, v in out.items():
        out[k] = getattr(v, "value", v)
        if isinstance(out[k], tuple):
            out[k] = list(out[k])
    return out


def _distance(base: dict[str, Any], conv: dict[str, Any]) -> int:
    return sum(1 for k in conv if conv[k] != base.get(k))


VERIFIED = 5
"""How many detected conventions (closest to the base first) are re-checked through the pipeline
(plus, with ``grad_logprobs``, the nearest of each ``kl_estimator`` not among them: :func:`_recheck`)."""


def _rechecked(convs: list[dict[str, Any]], grads: bool) -> list[int]:
    """Indices into ``convs`` (nearest first) to re-check: the :data:`VERIFIED` nearest and, when
    the dump holds ``grad_logprobs``, the nearest entry of each ``kl_estimator`` not among them
    (k3/k3+, k1/k1+, abs/abs+ share every value, so the search keeps both: only the pipeline's
    gradient tells them apart, and which one fills the first VERIFIED slots is tie order)."""
    picked = list(range(min(VERIFIED, len(convs))))
    if grads:
        seen = {convs[i]["kl_estimator"] for i in picked}
        for i in range(len(picked), len(convs)):
            if convs[i]["kl_estimator"] not in seen:
                seen.add(convs[i]["kl_estimator"])
                picked.append(i)
    return picked


def _recheck(
    dump: Dump, base: Setup, convs: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], set[str]]:
    """``(head, rest, rejected)``: the re-checked entries that the pipeline confirms (nearest first),
    the entries not re-checked, without those of a ``kl_estimator`` whose every re-checked entry
    failed (never report a member of a class the pipeline rejected), and those estimators."""
    picked = _rechecked(convs, dump.has("grad_logprobs"))
    rollouts = RolloutMemo(dump)  # the nearest conventions often share steps 1-4
    ok = {
        i: check(dump, setup_from_json(base, convs[i]), explain_divergence=False, rollouts=rollouts).match
        for i in picked
    }
    del rollouts
    head = [convs[i] for i in picked if ok[i]]
    rejected = {convs[i]["kl_estimator"] for i in picked} - {c["kl_estimator"] for c in head}
    rest = [c for i, c in enumerate(convs) if i not in ok and c["kl_estimator"] not in rejected]
    return head, rest, rejected


def _value_twin_notes(dump: Dump, convs: list[dict[str, Any]], undetermined: list[str]) -> list[str]:
    """Without ``grad_logprobs``, a detected ``k3`` (``k1``, ``abs``) with the KL in the loss is not
    told from its straight-through twin ``k3+`` (same values, another gradient): the search walks
    one of the pair (:func:`refppo.oracle.detect.rollout.kl_candidates`). Adds ``kl_estimator`` to
    ``undetermined`` (in place) and returns the note line; ``[]`` when the dump has gradients or
    no such entry. (With ``kl_in = reward`` no gradient flows through the estimate: the pair is
    the same step, nothing to decide.)"""
    if dump.has("grad_logprobs"):
        return []
    found = {KLEstimator(c["kl_estimator"]) for c in convs if c.get("kl_in") in ("loss", "both")}
    pairs = sorted({e.base.value for e in found if any(t.base is e.base and t is not e for t in KLEstimator)})
    if not pairs:
        return []
    if "kl_estimator" not in undetermined:
        undetermined.append("kl_estimator")
        undetermined.sort()
    both = ", ".join(f"{b} and {b}+" for b in pairs)
    return [
        f"kl_estimator: {both} have the same values (only the gradient differs): without grad_logprobs "
        f"the dump cannot tell them apart; detected lists one of each pair"
    ]


def _search(dump: Dump, base: Setup) -> tuple[Search, list[Group[Any]]]:
    """The walk, pruned by the value loss where that is exact (:mod:`refppo.oracle.detect.prune`):
    when the pruned walk cannot hold (found at the first step that shows it, or afterwards), its
    groups are dropped and the walk runs again unpruned."""
    search = Search(dump, base)
    search.prune = value_prune_for(search)
    try:
        groups = run_search(search)
        if search.prune is None or prune_held(search):
            return search, groups
        del groups
    except PruneLostError:
        pass
    del search  # the pruned walk's states are not read again: free them before the second walk
    search = Search(dump, base)
    return search, run_search(search)


def _refuse_unwalked(base: Setup) -> None:
    """A checked ``drop_mask`` gate under a critic-free estimator, refused in one line: the returns
    step cuts the gate's rows before the group statistics, which verl 0.9.1 takes over every row
    (:func:`refppo.pipeline.row_subset.group_advantages_on_every_row`)."""
    est = base.conv.adv.estimator
    if base.conv.gate.drops and est is not AdvantageEstimator.GAE:
        raise ConventionError(
            f"--detect does not walk rollout_rs_effect=drop_mask under advantage={est} yet (its group "
            "statistics read every row, the search's gate cuts them first): check this setting with "
            "refppo diff --set (without --detect)"
        )


def detect(dump: Dump, base: Setup, *, limit: int = 50) -> Detection:
    """Search the convention space around ``base``.

    Its hyperparameters are kept, except the clip ranges when the policy or value stage's solver
    finds others that reproduce the dump (an entry then names ``cliprange``/``cliprange_high``/
    ``cliprange_value``). A checked setting the walk does not apply is refused (:func:`_refuse_unwalked`).
    """
    _refuse_unwalked(base)
    search, groups = _search(dump, base)
    base_json = _full(base.convention_dict(), {})
    fitted, solved = list(search.fitted), dict(search.solved)
    matched = [g for g in groups if not g.unmatched and g.worst == 0.0]
    if matched:
        convs, origin = _listed(base_json, matched)
        if any(k in c for c in convs for k in HP_KEYS):  # one schema for every entry
            for c in convs:
                for k in HP_KEYS:
                    c.setdefault(k, getattr(base.hp, k))
        convs = [c for c in convs if _valid(base, c)]  # an expanded class may pair refused keys
        convs.sort(key=lambda c: _distance({**base_json, **_hp_json(base)}, c))
        for g in groups:  # the search's [B, T] states are not read again: free them before the re-checks
            g.forget()
        head, rest, rejected = _recheck(dump, base, convs)
        # every re-checked candidate failing means the staged search itself is off: trust none of it
        convs = head + rest if head else []
        # the search's class sizes count every member; a rejected estimator's members share classes
        # with the kept ones (same values), so then only the listed entries are counted
        n_total = 0 if rejected else sum(g.n_equiv for g in matched)
        keys = list(base_json) + [k for k in HP_KEYS if convs and k in convs[0]]
        undetermined = sorted(k for k in keys if len({repr(c.get(k)) for c in convs}) > 1)
        if not search.holes:  # right-padded: every hole convention agrees
            undetermined = sorted({*undetermined, "gae_holes", "whiten_holes"})
        notes = search.notes + _value_twin_notes(dump, convs, undetermined)
        if convs:
            dumped = frozenset(q for q in OUTPUTS if dump.has(q))
            counts = [g.n_equiv for g in matched]
            classes = classify(convs, [origin[id(c)] for c in convs], counts, dumped, counted=not rejected)
            confirmed = _confirmed(solved, convs[:limit])
            n = max(n_total, len(convs))
            shown = convs[:limit]
            return Detection(
                shown,
                n,
                None,
                [],
                undetermined,
                fitted,
                confirmed,
                notes,
                min(len(head), limit),
                search.holes,
                classes,
            )
    best = min(groups, key=lambda g: g.worst) if groups else None
    nearest = _full(base_json, best.convs[0]) if best is not None else None
    return Detection([], 0, nearest, list(dict.fromkeys(search.unmatched)), [], fitted, {}, search.notes)


def _listed(
    base_json: dict[str, Any], matched: list[Group[Any]]
) -> tuple[list[dict[str, Any]], dict[int, tuple[int, Marks]]]:
    """The matched groups' members as full conventions (each once, in walk order) and, by the id
    of each (the dicts are kept through the filters), its group's index and its step digests."""
    seen: set[str] = set()
    convs: list[dict[str, Any]] = []
    origin: dict[int, tuple[int, Marks]] = {}
    for gi, g in enumerate(matched):
        for c, marks in zip(g.convs, g.marks, strict=True):
            full = _full(base_json, c)
            key = repr(sorted(full.items()))
            if key not in seen:
                seen.add(key)
                convs.append(full)
                origin[id(full)] = (gi, marks)
    return convs, origin


def _confirmed(solved: dict[str, list[Any]], shown: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The solved values some shown entry uses (the ones the pipeline confirmed)."""
    out = {k: [v for v in vs if any(c.get(k) == v for c in shown)] for k, vs in solved.items()}
    return {k: vs for k, vs in out.items() if vs}


def _hp_json(base: Setup) -> dict[str, Any]:
    return {k: getattr(base.hp, k) for k in HP_KEYS}


def setup_from_json(base: Setup, conv: dict[str, Any]) -> Setup:
    """A setup with the convention keys of a detected/nearest dict (other hyperparameters from ``base``).

    Solved clip ranges (``cliprange``, ``cliprange_high``) replace the base's.
    """
    upd = {k: (tuple(v) if isinstance(v, list) else v) for k, v in conv.items() if k not in HP_KEYS}
    out = base.with_convention(upd)
    hp_up = {k: conv[k] for k in HP_KEYS if k in conv}
    return replace(out, hp=replace(out.hp, **hp_up)) if hp_up else out


__all__ = ["HP_KEYS", "Detection", "detect", "setup_from_json"]


def _valid(base: Setup, c: dict[str, Any]) -> bool:
    """False when the setting ``c`` is refused (e.g. ``group_kl=to_go`` with ``whiten_rewards``)."""
    try:
        setup_from_json(base, c)
    except RefPPOError:
        return False
    return True
