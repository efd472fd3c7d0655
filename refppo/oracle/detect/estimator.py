"""The returns step of ``--detect``: step 3, GAE or a critic-free estimator (the advantages stage),
checked on ``returns``.

A dump with a critic and no ``group_index`` under a ``gae`` setting walks GAE alone
(:func:`gae_step`: ``gae_padding``, and ``gae_holes`` when the mask has holes). Otherwise
(:func:`estimator_step`) it walks ``advantage``: every member of :class:`AdvantageEstimator` the
dump's keys allow (``gae`` with ``old_values``, the grouped ones of the core's ``GROUP_ESTIMATORS``
with ``group_index``, the per-row and batch-baseline ones always), and the options of the critic-free
estimators: ``group_kl`` (only when a reward KL is in play), ``group_std``, ``group_eps`` and
``group_std_level`` (the σ estimators only; the batch levels only when the dump has more than one
prompt), ``group_singleton`` (only when a prompt has one response). The first walk tries the
checked setting's own values; when nothing reproduces ``returns`` (or the dump has none) every
option is walked, with the ``group_eps`` the solver reads off the data (:func:`solve_group_eps`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import product
from typing import Any

import torch
from torch import Tensor

from refppo.conventions import AdvantageEstimator, GaeBootstrap, GaeHoles, GaePadding, KLPlacement, Variance
from refppo.core._group_checks import GROUP_ESTIMATORS
from refppo.errors import RefPPOError
from refppo.group_conventions import GroupKL, GroupSingleton, GroupStdLevel
from refppo.oracle.check.alternatives import GROUP_EPS
from refppo.oracle.detect.drop_gate import returns_walk
from refppo.oracle.detect.groups import Deferrable, Deferred, Group, Option
from refppo.oracle.detect.reward_options import shared_digest
from refppo.oracle.detect.rollout import carry_dumped_returns, with_raw_advantages
from refppo.oracle.detect.search import SOLVE_GROUPS, Search
from refppo.oracle.detect.solve import nice
from refppo.oracle.detect.states import ReturnsState, RewardState, digest
from refppo.pipeline.blocks import Evaluation
from refppo.pipeline.stages import BY_NAME
from refppo.pipeline.unread import SIGMA_ESTIMATORS

NAMED_EPS = GROUP_EPS
"""``group_eps`` of the peers (:data:`refppo.oracle.check.alternatives.GROUP_EPS`)."""
SCREEN_AHEAD = True
"""Whether the GAE step's first walk screens every padding of a rewards group it reads (kept for the
solver walk: :class:`Screens`); False: each walk screens its own (the tests compare the reports)."""
_ROLLOUT = Evaluation()
"""The rollout stages on one process (no all-reduce)."""


def needs_estimator_stage(s: Search) -> bool:
    """True when step 3 may not be GAE: no critic values, a ``group_index``, or a critic-free base."""
    critic_free = s.base.conv.adv.estimator is not AdvantageEstimator.GAE
    return "old_values" not in s.t or "group_index" in s.t or critic_free


def _advantages(
    s: Search, rs: RewardState, upd: dict[str, Any], rows: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The advantages stage on a rewards state under the checked setting with ``upd`` and the
    state's ``kl_in``: ``(advantages_raw, returns)`` (``rows``: on those rows of the batch alone,
    for a row-wise estimator such as GAE)."""
    q = {
        "token_rewards": rs.rewards, "old_values": s.t.get("old_values"), "value_mask": rs.vm, "mask": s.m,
        "mapped_scores": rs.scores, "kl": rs.kl.kl, "group_index": s.t.get("group_index"),
        "bootstrap_values": s.t.get("bootstrap_values"), "truncated": s.t.get("truncated"),
    }  # fmt: skip
    if rows is not None:
        q = {k: (v[rows] if isinstance(v, Tensor) else v) for k, v in q.items()}
    out = s.evaluate("advantages", q, s.setting(**upd, kl_in=rs.kl_in.value), _ROLLOUT)
    return out["advantages_raw"], out["returns"]


def gae_options(
    s: Search,
    g: Group[RewardState],
    pads: list[str],
    holes: list[GaeHoles],
    defer: bool = True,
    screens: Screens | None = None,
) -> Iterable[Deferrable[ReturnsState]]:
    """GAE for each ``gae_padding`` in ``pads``, each ``gae_holes`` in ``holes`` (named in the
    option only when more than one is walked: a dump with holes) and each ``gae_bootstrap`` (both
    only when the dump has ``bootstrap_values``).

    With dumped ``returns`` (and no value-loss pruning, which reads the full returns) each option is
    :class:`~refppo.oracle.detect.groups.Deferred` when ``defer``: screened on
    :attr:`Search.screen_rows` first (GAE reads each row alone: the rows' returns are the full
    returns' rows, bit for bit), made in full only when the screen cannot rule it out. ``screens``:
    the step's :class:`Screens` (the group's state is then read only when a screen is not there
    or an option is made)."""
    screen = defer and s.prune is None and s.dump.has("returns") and s.screen_rows is not None
    for pad, h, boot in product(pads, holes, _boots(s)):
        stage_upd = {"advantage": "gae", "gae_padding": pad, "gae_holes": h.value, "gae_bootstrap": boot}
        upd = {"gae_padding": pad} | ({"gae_holes": h.value} if len(holes) > 1 else {})
        upd |= {"gae_bootstrap": boot} if boot != s.base.conv.adv.gae_bootstrap.value else {}
        if screen:
            look = (screens or Screens(s, [pad])).get(g, stage_upd)
            yield upd, Deferred(look, _gae_make(s, g, stage_upd, upd)), b""
            continue
        rs = g.state
        adv_raw, ret = _advantages(s, rs, stage_upd)
        ret_key = digest(ret, shared_digest(rs.vm))
        if s.prune is not None and not s.prune.keeps(ret_key, ret, rs.vm):
            continue  # no value loss reproduces the dump on these returns (refppo.oracle.detect.prune)
        yield with_raw_advantages(g, upd, adv_raw, ret, ret_key)


class Screens:
    """The screens of one returns step's GAE options (:func:`_gae_screen`), kept by rewards group
    and option for its two walks: when a group's state is read to screen one padding, every
    padding of ``pads`` is screened on it, so that the solver walk reads the screens, not the
    state (a rewards group's state is replayed: its whitened rewards made again).

    Exact: a screen is a function of the group's state and the option alone (the state is rebuilt
    bit for bit on each replay), so a kept screen is the one the walk would make again."""

    def __init__(self, s: Search, pads: list[str]) -> None:
        self.s, self.pads = s, pads
        self.kept: dict[tuple[int, tuple[Any, ...]], tuple[Group[Any], tuple[float, bytes]]] = {}

    def get(self, g: Group[RewardState], stage_upd: dict[str, Any]) -> Callable[[], tuple[float, bytes]]:
        """The screen of ``g`` under ``stage_upd`` (made, with the other paddings', when first read)."""

        def look() -> tuple[float, bytes]:
            hit = self.kept.get((id(g), tuple(stage_upd.items())))
            if hit is not None and hit[0] is g:
                return hit[1]
            rs = g.state
            out = _gae_screen(self.s, rs, stage_upd)()
            for pad in self.pads:  # the entry holds g: its id is not reused
                other = {**stage_upd, "gae_padding": pad}
                key = (id(g), tuple(other.items()))
                if pad != stage_upd["gae_padding"] and key not in self.kept:
                    self.kept[key] = (g, _gae_screen(self.s, rs, other)())
            self.kept[(id(g), tuple(stage_upd.items()))] = (g, out)
            return out

        return look


def _boots(s: Search) -> list[str]:
    """The ``gae_bootstrap`` values walked: base's, and each one when the dump has ``bootstrap_values``."""
    own = s.base.conv.adv.gae_bootstrap.value
    if "bootstrap_values" not in s.t:
        return [own]
    return list(dict.fromkeys([own, *(b.value for b in GaeBootstrap)]))


def _gae_screen(s: Search, rs: RewardState, stage_upd: dict[str, Any]) -> Callable[[], tuple[float, bytes]]:
    """The returns check of a GAE option on :attr:`Search.screen_rows` (a lower bound of its ratio)
    and the digest of everything its option digest holds, on those rows."""

    def screen() -> tuple[float, bytes]:
        rows = s.screen_rows
        assert rows is not None
        adv_raw, ret = _advantages(s, rs, stage_upd, rows)
        vm = rs.vm[rows]
        key = digest(rs.kl.key, rs.kl_in.value, ret, vm, adv_raw, rs.fixed_whiten)
        return s.screen_ratio("returns", ret, vm), key

    return screen


def _gae_make(
    s: Search, g: Group[RewardState], stage_upd: dict[str, Any], upd: dict[str, Any]
) -> Callable[[], tuple[ReturnsState, bytes]]:
    """The GAE option in full, as :func:`gae_options` makes it eagerly."""

    def make() -> tuple[ReturnsState, bytes]:
        rs = g.state
        adv_raw, ret = _advantages(s, rs, stage_upd)
        _, st, key = with_raw_advantages(rs, upd, adv_raw, ret)
        return st, key

    return make


def _returns_check(s: Search) -> Callable[[ReturnsState], list[float | None]]:
    return lambda st: [s.ratio("returns", st.carried.returns, st.carried.vm)]


def _holes(s: Search) -> list[GaeHoles]:
    return list(GaeHoles) if s.holes else [s.base.conv.adv.gae_holes]


def gae_step(s: Search, groups: list[Group[RewardState]]) -> list[Group[ReturnsState]]:
    """``returns`` (and the raw advantages): GAE over the value mask, or through the padding; across
    interior mask holes by every ``gae_holes`` convention (multi-turn dumps only)."""
    own = s.base.conv.adv.gae_padding.value

    every = list(dict.fromkeys([own, *(p.value for p in GaePadding)]))
    screens = Screens(s, every if SCREEN_AHEAD else [own])

    def make(extra: bool | None) -> Callable[[Group[RewardState]], Iterable[Deferrable[ReturnsState]]]:
        walk_all = extra is not None or "returns" not in s.t
        pads = every if walk_all else [own]
        holes = _holes(s)  # read at the walk: a drop_mask gate's mask has holes (detect.drop_gate)
        return lambda g: gae_options(s, g, pads, holes, screens=screens)

    out = returns_walk(s, groups, make, _returns_check(s), lambda _: True)  # a drop_mask gate: drop_gate
    if "returns" in s.unmatched and out:
        carry_dumped_returns(out, s.t["returns"])
    return out


def _rank(e: AdvantageEstimator) -> int:
    """The walk's order of the estimators: GAE, the per-row ones, the grouped ones, the batch
    baselines (each in the enum's order)."""
    if e is AdvantageEstimator.GAE:
        return 0
    if e is AdvantageEstimator.FLASH_REINFORCE:
        return 3
    return 2 if e in GROUP_ESTIMATORS else 1


def _estimators(t: dict[str, Any]) -> list[str]:
    """Every estimator the dump's keys allow (``gae`` needs ``old_values``, the grouped ones need
    ``group_index``), in :func:`_rank` order."""
    out = []
    for e in sorted(AdvantageEstimator, key=_rank):
        if (e is AdvantageEstimator.GAE and "old_values" not in t) or (
            e in GROUP_ESTIMATORS and "group_index" not in t
        ):
            continue
        out.append(e.value)
    return out


def _options(s: Search, walk_all: bool, eps_extra: list[float]) -> list[dict[str, Any]]:
    c = s.base.conv
    own = {
        "advantage": c.adv.estimator.value,
        "group_kl": c.adv.group_kl.value,
        "group_std": c.adv.group_std.value,
        "group_std_level": c.adv.group_std_level.value,
        "group_eps": c.adv.group_eps,
        "group_singleton": c.adv.group_singleton.value,
    }
    if not walk_all:
        return [own]
    t = s.t
    kls = [g.value for g in GroupKL] if s.hp.kl_coef > 0 else [own["group_kl"]]
    singles = [own["group_singleton"]]
    if "group_index" in t and bool((torch.unique(t["group_index"], return_counts=True)[1] == 1).any()):
        singles = list(dict.fromkeys([own["group_singleton"], *(x.value for x in GroupSingleton)]))
    eps_all = list(dict.fromkeys([c.adv.group_eps, *NAMED_EPS, *eps_extra]))
    levels = [own["group_std_level"]]
    if "group_index" in t and int(torch.unique(t["group_index"]).numel()) > 1:  # one prompt: batch = group
        levels = list(dict.fromkeys([own["group_std_level"], *(x.value for x in GroupStdLevel)]))
    out = [own]
    for est in _estimators(t):
        if est in ("gae", "reinforce++"):
            out.append({**own, "advantage": est})
            continue
        # the σ estimators read the std, its ε and its level (refppo.core.group.group_advantages)
        by_std = AdvantageEstimator(est) in SIGMA_ESTIMATORS
        stds = [v.value for v in Variance] if by_std else [own["group_std"]]
        grouped = est != AdvantageEstimator.FLASH_REINFORCE.value
        for kl in kls:
            for std, level in ((d, lv) for d in stds for lv in (levels if by_std else levels[:1])):
                for eps in eps_all if by_std else [own["group_eps"]]:
                    for single in singles if grouped else [own["group_singleton"]]:
                        upd = {"advantage": est, "group_kl": kl, "group_std": std, "group_eps": eps}
                        out.append({**upd, "group_std_level": level, "group_singleton": single})
    return [dict(u) for u in dict.fromkeys(tuple(sorted(o.items())) for o in out)]


def _critic_free(s: Search, g: Group[RewardState], upd: dict[str, Any]) -> Option[ReturnsState] | None:
    try:
        adv_raw, _ = _advantages(s, g.state, upd)
    except RefPPOError:
        return None  # e.g. a group of one under group_singleton=error
    return with_raw_advantages(g, upd, adv_raw, adv_raw)


def _estimator_options(
    s: Search, opts_list: list[dict[str, Any]], pads: list[str]
) -> Callable[[Group[RewardState]], Iterable[Deferrable[ReturnsState]]]:
    holes = _holes(s)
    reads = BY_NAME["advantages"].reads_now

    def opts(g: Group[RewardState]) -> Iterable[Deferrable[ReturnsState]]:
        for upd in opts_list:
            if upd["advantage"] == "gae":
                if "old_values" in s.t:
                    for gu, st, key in gae_options(s, g, pads, holes, defer=False):
                        yield {**upd, **gu}, st, key
                continue
            # an estimator that reads gae_holes (reinforce++'s return-to-go) walks them too
            crosses = "gae_holes" in reads(s.setting(advantage=upd["advantage"]).conv)
            for h in [x.value for x in holes] if crosses else [None]:
                opt = _critic_free(s, g, upd if h is None else {**upd, "gae_holes": h})
                if opt is not None:
                    yield opt

    return opts


def estimator_step(s: Search, groups: list[Group[RewardState]]) -> list[Group[ReturnsState]]:
    """``returns`` (the raw advantages): every estimator the dump's keys allow, GAE included."""
    t = s.t
    own_pad = s.base.conv.adv.gae_padding.value

    def make(extra: list[float] | None) -> Callable[[Group[RewardState]], Iterable[Deferrable[ReturnsState]]]:
        walk_all = extra is not None or "returns" not in t
        pads = list(dict.fromkeys([own_pad, *(p.value for p in GaePadding)])) if walk_all else [own_pad]
        return _estimator_options(s, _options(s, walk_all, extra or []), pads)

    def propose(gs: list[Group[RewardState]]) -> list[float]:
        eps = solve_group_eps(s, gs)
        for e in eps:
            s.propose_value("group_eps", e)
        return eps or [s.base.conv.adv.group_eps]  # truthy: walk every named option anyway

    out = returns_walk(s, groups, make, _returns_check(s), propose)  # a drop_mask gate: detect.drop_gate
    if "returns" in s.unmatched and out:
        carry_dumped_returns(out, s.t["returns"])
    return out


def solve_group_eps(s: Search, groups: list[Group[RewardState]]) -> list[float]:
    """``ε`` of ``a_i = (s_i − μ_G)/(σ_G + ε)`` read off the dumped ``returns`` (row value at t = 0).

    Per row ``ε_i = (s_i − μ_G)/a_i − σ_G`` over rows with ``a_i ≠ 0`` and ``σ_G > 0``, for each
    ``group_kl`` form and std of the nearest groups; a median all rows agree on (within 1 % and the
    dump's tolerance) is proposed, rounded by :func:`refppo.oracle.detect.solve.nice`.
    """
    t = s.t
    if "returns" not in t or "group_index" not in t:
        return []
    a = t["returns"][:, 0].double()
    out: list[float] = []
    for g in groups[:SOLVE_GROUPS]:
        for kl in GroupKL:
            for std in Variance:
                eps = _eps_rows(s, g, a, kl.value, std.value)
                if eps is not None:
                    out.append(nice(eps)[0])
    return [e for e in dict.fromkeys(out) if e > 0.0][:4]


def _group_sigma(s: Search, g: Group[RewardState], centred: Tensor, std: str) -> Tensor:
    """``(c − μ_G)/σ_G`` per row at t = 0: the advantages stage under ``grpo`` with ε = 0 on the
    scores ``centred`` ``[B]`` (placed at the score slot by the rewards stage, no KL)."""
    vm = s.value_mask(s.base.conv.reward.score_at)
    q = {"mapped_scores": centred, "kl": None, "mask": s.m}
    r = s.evaluate("rewards", q, s.setting(stage="rewards", kl_in="loss"), _ROLLOUT)
    rs = RewardState(g.state.kl, KLPlacement.LOSS, vm, centred, r["token_rewards_raw"], None)
    upd = {"advantage": "grpo", "group_eps": 0.0, "group_singleton": "zero", "group_std": std}
    upd |= {"group_std_level": GroupStdLevel.GROUP.value, "group_kl": GroupKL.FOLD.value}
    return _advantages(s, rs, upd)[0][:, 0]


def _eps_rows(s: Search, g: Group[RewardState], a: Tensor, kl: str, std: str) -> float | None:
    if kl == GroupKL.TO_GO.value:
        return None  # the penalty's return-to-go is not scaled by σ: ε is not read per row there
    opt = _critic_free(s, g, {"advantage": "dr-grpo", "group_kl": kl, "group_singleton": "zero"})
    if opt is None:
        return None
    centred = opt[1].adv_raw[:, 0].double()  # s_i − μ_G
    try:  # (s − μ)/σ: the group mean of the centred scores is 0 and their std is σ_G
        sigma_n = _group_sigma(s, g, centred, std)
    except RefPPOError:
        return None
    ok = (a.abs() > s.tol.atol) & torch.isfinite(sigma_n) & (sigma_n != 0) & (centred.abs() > s.tol.atol)
    if int(ok.sum()) < 2:
        return None
    sigma = centred[ok] / sigma_n[ok]  # σ_G = (s − μ)/((s − μ)/σ)
    eps_i = centred[ok] / a[ok] - sigma
    med = float(eps_i.median())
    spread = float((eps_i - med).abs().max())
    return med if med > 0 and spread <= 0.01 * med + s.tol.rtol * float(sigma.abs().max()) else None


__all__ = [
    "SCREEN_AHEAD",
    "Screens",
    "estimator_step",
    "gae_options",
    "gae_step",
    "needs_estimator_stage",
    "solve_group_eps",
]
