"""The context of the ``--detect`` walk: the dump, the checked setting, the comparisons, and the one
way a value is made: a pipeline stage evaluated by :meth:`Search.evaluate`.

Every quantity the walk compares, merges or carries is ``BY_NAME[stage].run(q, conv, hp, ev)`` of
:mod:`refppo.pipeline.stages` under the option's setting (:meth:`Search.setting`: the checked setting
with the option's flat keys replaced), so each convention the walk lists is what the pipeline
computes for it. How a stage is evaluated is the walk's business, never a second formula: by row
blocks without autograd above :data:`refppo.pipeline.blocks.ROW_BLOCK_ELEMENTS` (:attr:`Search.ev`),
with the token counts counted once (:meth:`Search.ev_counts`), memoised by the steps where two
options give the same stage inputs (:mod:`refppo.oracle.detect.states` digests).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any, Protocol

import torch
from torch import Tensor

from refppo.conventions import ScorePosition
from refppo.core.checks import count_true
from refppo.dump.load import Dump
from refppo.dump.residency import trim_heap
from refppo.dump.tolerances import TOLERANCES
from refppo.oracle.check.compare import compare
from refppo.oracle.check.settings import Setup
from refppo.oracle.detect.groups import Group, Option, Replayer, expand_groups
from refppo.pipeline.blocks import Evaluation, update_rows
from refppo.pipeline.settings import Convention
from refppo.pipeline.stages import BY_NAME

MAX_EQUIV = 256
"""Equivalent conventions kept per group (the rest are counted)."""
NEAREST = 3
"""Groups kept after a stage that no group reproduces."""
SOLVE_GROUPS = 3
"""Groups (advantage variants) the solvers are run on."""
HP_KEYS = ("cliprange", "cliprange_high", "cliprange_value")
"""Hyperparameters the solvers can recover (an option names them when they differ)."""
SCREEN_ROWS = 8
"""Rows a deferred option is screened on (at most a quarter of the batch):
:meth:`Search.screen_rows`."""
SCREEN_SLACK = 1e-3
"""The screen's margin, as a share of the tolerance bound (:meth:`Search.screen_ratio`)."""
CHECKED_AFTER = ("advantages", "policy")
"""Steps after the returns step whose first walk must pass some group (or check nothing) for a
pruned walk to hold (:mod:`refppo.oracle.detect.prune`)."""


class PruneLostError(Exception):
    """Raised by :meth:`Search.note_walk` in a pruned search as soon as a first walk shows that the
    pruned walk will not hold: the rest of it would be thrown away."""


class Pruner(Protocol):
    """Drops returns no value loss can match (:class:`refppo.oracle.detect.prune.ValuePrune`)."""

    dropped: int

    def keeps(self, ret_key: bytes, returns: Tensor, vm: Tensor) -> bool: ...


class Search:
    """One ``--detect`` walk over ``dump`` around the checked setting ``base``."""

    def __init__(self, dump: Dump, base: Setup) -> None:
        self.dump = dump
        self.base = base
        self.t = dump.tensors
        self.m = dump.mask
        self.hp = base.hp
        self.tol = TOLERANCES[dump.dtype]
        self.unmatched: list[str] = []
        self.fitted: list[str] = []
        """One line per stage no convention reproduces: the map fitted between dump and refppo."""
        self.notes: list[str] = []
        """What the data cannot decide, in one line each (e.g. a score map with constant scores)."""
        self.solved: dict[str, list[Any]] = {}
        """Constants the solvers proposed, by key (whether or not the pipeline confirmed them)."""
        self.compared: set[str] = set()
        """Dumped keys compared since the last :meth:`release_compared` (their pages are resident)."""
        self.replayer = Replayer()
        """Rebuilds the states the stages do not hold (:mod:`refppo.oracle.detect.groups`)."""
        self.walks: list[tuple[str, bool, bool]] = []
        """``(step, some group passed, some check applied)`` of each walk, in order."""
        self.prune: Pruner | None = None
        """Drops returns no value loss can match (:mod:`refppo.oracle.detect.prune`), when set."""
        self.ev = Evaluation(rows=update_rows(self.m), keep_ratio=False)
        """How the update stages are evaluated: by row blocks above ``ROW_BLOCK_ELEMENTS``, without
        the policy stage's ratio buffer (the walk reads ``ℓ``, the clip fractions and approx_kl)."""
        self.holes = bool((self.m[:, 1:] & ~self.m[:, :-1]).any())
        """Whether a row has an interior hole (a valid token after a masked one): only then do
        ``gae_holes`` and ``whiten_holes`` change anything, so only then are they walked."""
        self._settings: dict[tuple[Any, ...], Setup] = {}
        self._vms: dict[ScorePosition, Tensor] = {}
        self._counts: dict[int, tuple[Evaluation, Tensor]] = {}
        self._dump_scale: dict[str, float] = {}
        B = self.m.shape[0]
        k = min(SCREEN_ROWS, B // 4)
        self.screen_rows: Tensor | None = (
            torch.unique(torch.linspace(0, B - 1, k).round().long()) if k > 0 else None
        )
        """Rows the screens read (evenly spread; None: a batch too small to screen)."""

    # ----- evaluation through the stage table ------------------------------------------------
    def setting(self, stage: str | None = None, **upd: Any) -> Setup:
        """The checked setting with some flat convention keys and the clip hyperparameters
        (:data:`HP_KEYS`) replaced (memoised: the walk asks for the same ones many times).

        ``stage``: a setting for that stage alone, its :attr:`Stage.keys` at the checked values
        (the others at their defaults): what the stage reads is the same, and an option is not
        refused for pairing with another stage's key (a reward whitening with a checked
        ``group_kl=to_go`` is refused only as a whole convention, which the walk then drops)."""
        key = (stage, *sorted(upd.items()))
        out = self._settings.get(key)
        if out is None:
            conv = {k: v for k, v in upd.items() if k not in HP_KEYS}
            hp_up = {k: v for k, v in upd.items() if k in HP_KEYS}
            if stage is None:
                c = self.base.conv.with_updates(conv)
            else:
                own = {k: self.base.conv.get(k) for k in BY_NAME[stage].keys}
                c = Convention.of(**{**own, **conv})
            out = Setup(c, replace(self.hp, **hp_up) if hp_up else self.hp)
            self._settings[key] = out
        return out

    def evaluate(
        self, stage: str, q: Mapping[str, Any], setting: Setup, ev: Evaluation | None = None
    ) -> dict[str, Any]:
        """The outputs of pipeline stage ``stage`` on the quantities ``q`` under ``setting``
        (``ev``: how it is evaluated; default :attr:`ev`)."""
        return BY_NAME[stage].run(q, setting.conv, setting.hp, self.ev if ev is None else ev)

    def ev_counts(self, mask: Tensor) -> Evaluation:
        """:attr:`ev` with ``mask``'s valid-token count as the normaliser: the aggregation stages'
        own count, counted once for the walk instead of once per call (the same number)."""
        hit = self._counts.get(id(mask))
        if hit is None or hit[1] is not mask:
            n = float(count_true(mask))
            hit = (replace(self.ev, norm=replace(self.ev.norm, token_count=n, value_token_count=n)), mask)
            self._counts[id(mask)] = hit  # the entry holds the mask: its id is not reused
        return hit[0]

    def value_mask(self, score_at: ScorePosition) -> Tensor:
        """The value_mask stage once per score slot: one tensor each for the whole walk, so that
        replayed states share it (and :meth:`ev_counts` keyed by it stays valid)."""
        if score_at not in self._vms:
            st = self.setting(score_at=score_at.value)
            self._vms[score_at] = self.evaluate("value_mask", {"mask": self.m}, st)["value_mask"]
        return self._vms[score_at]

    # ----- comparisons and walks ------------------------------------------------------------------
    def ratio(
        self, name: str, ref: Tensor, cmp_mask: Tensor | None, widen: Callable[[], float] | None = None
    ) -> float | None:
        """``max error / tolerance`` of ``ref`` against the dumped ``name`` (0: within tolerance;
        None: not dumped)."""
        if not self.dump.has(name):
            return None
        self.compared.add(name)
        r = compare(name, self.t[name], ref, cmp_mask, self.tol)
        if not r.ok and widen is not None:
            r = compare(name, self.t[name], ref, cmp_mask, self.tol, widen=widen())
        if r.ok:
            return 0.0
        return r.max_abs_err / r.tol if r.tol > 0 else float("inf")

    def screen_ratio(self, name: str, ref_rows: Tensor, cmp_rows: Tensor) -> float:
        """A lower bound of :meth:`ratio` of ``name`` from the rows :attr:`screen_rows` alone:
        ``ref_rows``, ``cmp_rows`` are the reference and the compare mask on those rows (0: the
        rows cannot tell; a check that is not made, or that may pass, is 0).

        The full check compares ``e = max |dump − ref|`` over the compare mask with
        ``tol = atol + rtol·max |ref| <= atol + rtol·(D + e)``, ``D = max |dump|`` over every
        position. ``e >= e_s``, the error on the rows; so when ``e_s·(1 − rtol) > atol + rtol·D``
        the check fails, and its ratio ``e/tol >= e_s/(atol + rtol·(D + e_s))`` (increasing in
        ``e``). ``e_s`` is taken less :data:`SCREEN_SLACK` of ``atol + rtol·D``: an option is
        ruled out only by a clear margin."""
        if not self.dump.has(name) or self.screen_rows is None:
            return 0.0
        if name not in self._dump_scale:
            self._dump_scale[name] = float(self.t[name].abs().max())
        big_d = self._dump_scale[name]
        err = compare(name, self.t[name][self.screen_rows], ref_rows, cmp_rows, self.tol).max_abs_err
        if not (math.isfinite(err) and math.isfinite(big_d)):
            return 0.0
        bound = self.tol.atol + self.tol.rtol * big_d
        err -= SCREEN_SLACK * bound
        if err * (1.0 - self.tol.rtol) <= bound:
            return 0.0
        return err / (bound + self.tol.rtol * err)

    def expand(
        self,
        groups: list[Group[Any]],
        options: Callable[[Group[Any]], Iterable[Option[Any]]],
        checks: Callable[[Any], list[float | None]],
        stage: str,
    ) -> list[Group[Any]]:
        """Expand each group by ``options``, merge, filter, in bounded memory:
        :func:`refppo.oracle.detect.groups.expand_groups`."""
        return expand_groups(self, groups, options, checks, stage, NEAREST, MAX_EQUIV)

    def stage(
        self,
        groups: list[Group[Any]],
        make_options: Callable[[Any], Callable[[Group[Any]], Iterable[Option[Any]]]],
        checks: Callable[[Any], list[float | None]],
        name: str,
        propose: Callable[[list[Group[Any]]], Any] | None = None,
    ) -> list[Group[Any]]:
        """Walk the named options; when none reproduces (or none applies), walk again with the solver's."""
        trim_heap()  # what the previous stage freed is not resident under this one's peak
        out = self.expand(groups, make_options(None), checks, name)
        # none of the first walk's options applies (say advantage=gae on a dump without a critic):
        # that is no match either, so the solver's walk runs too
        if (name in self.unmatched or (groups and not out)) and propose is not None:
            extra = propose(groups)
            if extra:
                if name in self.unmatched:
                    self.unmatched.remove(name)
                out = self.expand(groups, make_options(extra), checks, name)
        return out

    def note_walk(self, stage: str, ok_seen: bool, any_check: bool) -> None:
        """Log a walk in :attr:`walks`; in a pruned search, raise :class:`PruneLostError` when this
        first walk of the step already shows the pruned walk cannot hold (the value step passed no
        group, or a step of :data:`CHECKED_AFTER` checked something and passed no group)."""
        first = all(st != stage for st, _, _ in self.walks)
        self.walks.append((stage, ok_seen, any_check))
        if self.prune is None or not first or ok_seen:
            return
        if stage == "value" or (stage in CHECKED_AFTER and any_check):
            raise PruneLostError(stage)

    def note_unmatched(self, stage: str) -> None:
        self.unmatched.append(stage)

    def release_compared(self) -> None:
        """Hand back the pages of the dumped keys compared by a walk (:meth:`Dump.release`).

        A walk compares one key per candidate group, then the stage moves on to other keys, so
        without this every compared trainer output stays resident for the rest of the search (a
        B=1024, T=8192 float32 key is 33.5 MB). A later read pages the same bytes in again.
        """
        for name in sorted(self.compared):
            self.dump.release(name)
        self.compared.clear()

    def propose_value(self, key: str, value: Any) -> None:
        """Record a solver's proposal for ``key`` (None, "no clamp", is not a proposal)."""
        if value is None:
            return
        v = list(value) if isinstance(value, tuple) else value
        if v not in self.solved.setdefault(key, []):
            self.solved[key].append(v)


def nearest_note(convs: list[dict[str, Any]]) -> str:
    """The rollout keys of a nearest group's first member, for a fitted line."""
    c = convs[0]
    keys = ("kl_estimator", "kl_in", "score_at", "score_clip", "whiten_rewards")
    return (
        " (raw values under the nearest convention: "
        + ", ".join(f"{k}={c.get(k)}" for k in keys if k in c)
        + ")"
    )


__all__ = [
    "CHECKED_AFTER",
    "HP_KEYS",
    "MAX_EQUIV",
    "NEAREST",
    "SCREEN_ROWS",
    "SCREEN_SLACK",
    "SOLVE_GROUPS",
    "PruneLostError",
    "Pruner",
    "Search",
    "nearest_note",
]
