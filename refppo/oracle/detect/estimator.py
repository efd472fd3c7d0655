"""The estimator stage of ``--detect``: GAE or a critic-free estimator (step 3), checked on ``returns``.

Walks ``advantage`` (``gae`` when the dump holds ``old_values``; the group estimators when it
holds ``group_index``; ``reinforce++`` and ``flash-reinforce``, a batch baseline, always) and the
options of the critic-free estimators: ``group_kl`` (only when a reward KL is in play), ``group_std``,
``group_eps`` and ``group_std_level`` (``grpo`` only; the batch levels only when the dump has more
than one prompt),
``group_singleton`` (only when a prompt has one response). The first walk tries the checked
setting's own values; when nothing reproduces ``returns`` (or the dump has none) every option is
walked, with the ``group_eps`` the solver reads off the data (:func:`solve_group_eps`).

Every option's raw advantages come from :func:`refppo.pipeline.rollout.critic_free_advantages` (the
pipeline's own step 3) and GAE from :func:`refppo.oracle.detect.rollout.gae_options`; the
whitening stage (:func:`refppo.oracle.detect.rollout.whiten_stage`) follows unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from refppo.conventions import (
    AdvantageEstimator,
    GaeHoles,
    GaePadding,
    GroupKL,
    GroupSingleton,
    GroupStdLevel,
    Variance,
)
from refppo.core._group_checks import GROUP_ESTIMATORS as _CORE_GROUP_ESTIMATORS
from refppo.core.gae import has_holes
from refppo.core.group import group_scalar_advantages
from refppo.errors import RefPPOError
from refppo.oracle.check.alternatives import GROUP_EPS
from refppo.oracle.detect.groups import Group
from refppo.oracle.detect.rollout import _carry_dumped, gae_options, with_raw_advantages
from refppo.oracle.detect.search import SOLVE_GROUPS, Option, Search
from refppo.oracle.detect.solve import nice
from refppo.pipeline.rollout import critic_free_advantages

GROUP_ESTIMATORS = tuple(e.value for e in _CORE_GROUP_ESTIMATORS)
NAMED_EPS = GROUP_EPS
"""``group_eps`` of the peers (:data:`refppo.oracle.check.alternatives.GROUP_EPS`)."""


def needs_estimator_stage(s: Search) -> bool:
    """True when step 3 may not be GAE: no critic values, a ``group_index``, or a critic-free base."""
    critic_free = s.base.conv.adv.estimator is not AdvantageEstimator.GAE
    return "old_values" not in s.t or "group_index" in s.t or critic_free


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
    ests = ["gae"] if "old_values" in t else []
    ests += ["reinforce++"] + (list(GROUP_ESTIMATORS) if "group_index" in t else []) + ["flash-reinforce"]
    kls = [g.value for g in GroupKL] if s.hp.kl_coef > 0 else [own["group_kl"]]
    singles = [own["group_singleton"]]
    if "group_index" in t and bool((torch.unique(t["group_index"], return_counts=True)[1] == 1).any()):
        singles = list(dict.fromkeys([own["group_singleton"], *(x.value for x in GroupSingleton)]))
    eps_all = list(dict.fromkeys([c.adv.group_eps, *NAMED_EPS, *eps_extra]))
    levels = [own["group_std_level"]]
    if "group_index" in t and int(torch.unique(t["group_index"]).numel()) > 1:  # one prompt: batch = group
        levels = list(dict.fromkeys([own["group_std_level"], *(x.value for x in GroupStdLevel)]))
    out = [own]
    for est in ests:
        if est in ("gae", "reinforce++"):
            out.append({**own, "advantage": est})
            continue
        # grpo and grpo-passk read the std, its ε and its level (refppo.core.group.group_advantages)
        by_std = est in ("grpo", "grpo-passk")
        stds = [v.value for v in Variance] if by_std else [own["group_std"]]
        for kl in kls:
            for std, level in ((d, lv) for d in stds for lv in (levels if by_std else levels[:1])):
                for eps in eps_all if by_std else [own["group_eps"]]:
                    for single in singles if est != "flash-reinforce" else [own["group_singleton"]]:
                        upd = {"advantage": est, "group_kl": kl, "group_std": std, "group_eps": eps}
                        out.append({**upd, "group_std_level": level, "group_singleton": single})
    return [dict(u) for u in dict.fromkeys(tuple(sorted(o.items())) for o in out)]


def _critic_free(s: Search, g: Group, upd: dict[str, Any]) -> Option | None:
    st = g.state
    try:
        setup = s.base.with_convention({**upd, "kl_in": st["kl_in"]})
        adv_raw = critic_free_advantages(
            scores=st["scores"], kl=st["kl"], rewards=st["rewards"], mask=s.m, value_mask_=st["vm"],
            group_index=s.t.get("group_index"), hp=s.hp, conv=setup.conv,
        )  # fmt: skip
    except RefPPOError:
        return None  # e.g. a group of one under group_singleton=error
    return with_raw_advantages(g, upd, adv_raw, adv_raw)


def estimator_stage(s: Search, groups: list[Group]) -> list[Group]:
    """``returns`` (the raw advantages): every estimator the dump's keys allow, GAE included."""
    t = s.t
    own_pad = s.base.conv.adv.gae_padding.value

    def make(extra: list[float] | None) -> Callable[[Group], Iterable[Option]]:
        walk_all = extra is not None or "returns" not in t
        opts_list = _options(s, walk_all, extra or [])
        pads = list(dict.fromkeys([own_pad, *(p.value for p in GaePadding)])) if walk_all else [own_pad]
        holes = list(GaeHoles) if has_holes(s.m) else [s.base.conv.adv.gae_holes]

        def opts(g: Group) -> Iterable[Option]:
            for upd in opts_list:
                if upd["advantage"] == "gae":
                    if "old_values" in t:
                        for gu, st, key in gae_options(s, g, pads, holes):
                            yield {**upd, **gu}, st, key
                    continue
                # reinforce++'s return-to-go crosses interior holes by gae_holes (the pipeline reads it)
                walk = [GaeHoles(h).value for h in holes] if upd["advantage"] == "reinforce++" else [None]
                for h in walk:
                    opt = _critic_free(s, g, upd if h is None else {**upd, "gae_holes": h})
                    if opt is not None:
                        yield opt

        return opts

    def check(st: dict[str, Any]) -> list[float | None]:
        return [s.ratio("returns", st["returns"], st["vm"])]

    def propose(gs: list[Group]) -> list[float]:
        eps = solve_group_eps(s, gs)
        for e in eps:
            s.propose_value("group_eps", e)
        return eps or [s.base.conv.adv.group_eps]  # truthy: walk every named option anyway

    out = s.stage(groups, make, check, "returns", propose)
    if "returns" in s.unmatched and out:
        _carry_dumped(out, "returns", t["returns"])
    return out


def solve_group_eps(s: Search, groups: list[Group]) -> list[float]:
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


def _eps_rows(s: Search, g: Group, a: Tensor, kl: str, std: str) -> float | None:
    upd = {"advantage": "dr-grpo", "group_kl": kl, "group_singleton": "zero"}
    opt = _critic_free(s, g, upd)
    if opt is None:
        return None
    centred = opt[1]["adv_raw"][:, 0].double()  # s_i − μ_G (+ the to-go penalty at t = 0 under to_go)
    if kl == GroupKL.TO_GO.value:
        return None  # the penalty's return-to-go is not scaled by σ: ε is not read per row there
    gi = s.t["group_index"]
    unbiased = std == Variance.UNBIASED.value
    try:  # (s − μ)/σ: the group mean of the centred scores is 0 and their std is σ_G
        sigma_n = group_scalar_advantages(
            centred, gi, estimator="grpo", eps=0.0, singleton="zero", unbiased_std=unbiased
        )
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
