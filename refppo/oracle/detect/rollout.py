"""The rollout stages of ``--detect`` (:mod:`refppo.oracle.detect.search`): rewards, GAE, whitening.

========= ======================================================= =================================
stage     keys it walks                                             solver (when nothing reproduces)
========= ======================================================= =================================
reward    ``kl_in``, ``score_at``, ``score_clip``; then             the score map ``(s + b)·k`` read
          ``whiten_rewards`` (with ``whiten_variance`` and          off the score slots: AReaL's
          ``whiten_eps_at``, which the later whitening shares)      ``reward_bias``/``reward_scaling``
gae       ``gae_padding``; ``gae_holes`` when the mask has holes    —
whiten    ``whiten_advantages``, ``whiten_variance`` (and           —
          ``whiten_holes`` when the mask has holes); then
          ``whiten_eps_at``
========= ======================================================= =================================

Each stage first walks the checked setting's own value of the keys after "then" and adds the
others only when nothing reproduces the stage (or when the dump lacks the stage's quantity, so
nothing can be checked there). The stages compose the core functions the pipeline composes
(:func:`refppo.pipeline.step.reward_quantities`, :func:`refppo.pipeline.step.rollout_quantities`);
what the
search reports is re-checked through the pipeline by :func:`refppo.oracle.detect.detection.detect`.

When nothing reproduces ``returns`` or ``advantages``, the stages after it read the dump's own
tensor (:func:`_carry_dumped`), so the policy and value conventions are still identified.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from itertools import product
from typing import Any

import torch
from torch import Tensor

from refppo.conventions import (
    GaeHoles,
    GaePadding,
    KLPlacement,
    ScorePosition,
    Variance,
    WhitenEps,
    WhitenHoles,
    Whitening,
)
from refppo.core.gae import gae, has_holes
from refppo.core.normalize import normalize
from refppo.core.rewards import score_positions, token_rewards
from refppo.core.score_map import map_scores
from refppo.errors import RefPPOError
from refppo.oracle.detect.groups import Group
from refppo.oracle.detect.score_const import constant_score_notes, propose_constant_score_map
from refppo.oracle.detect.search import SOLVE_GROUPS, Option, Search, digest, nearest_note
from refppo.oracle.detect.solve import fit_normalisation, nice
from refppo.pipeline.rollout import whiten_advantages

WhitenKey = tuple[str, str, str]
"""``(whiten_rewards, whiten_variance, whiten_eps_at)``."""


def _whiten_reward_opts(s: Search, walk_all: bool) -> list[WhitenKey]:
    c = s.base.conv
    own: WhitenKey = (c.reward.whiten.value, c.norm.variance.value, c.norm.eps_at.value)
    if not walk_all:
        return [own]
    kinds = [w.value for w in Whitening if w is not Whitening.NONE]
    every = [(w, v.value, e.value) for w in kinds for v in Variance for e in WhitenEps]
    return list(dict.fromkeys([own, ("none", own[1], own[2]), *every]))


def reward_stage(s: Search, groups: list[Group]) -> list[Group]:
    """``token_rewards``: KL placement, score slot, score clip and map, reward whitening."""
    t, m, hp = s.t, s.m, s.hp
    ex = s.base.conv.score
    clip_opts: list[float | None] = list(dict.fromkeys([None, 5.0, 10.0, ex.clip]))
    checkable = "token_rewards" in t
    extra_maps: list[tuple[float, float]] = []
    if not checkable:  # a group estimator's dump: the clip read off ``returns`` (scale cancels in σ)
        for k, c in solve_group_score_clip(s, groups):
            s.propose_value("score_clip", c)
            clip_opts.append(c)
            extra_maps.append((ex.bias, k))

    def make(extra: list[tuple[float, float]] | None) -> Callable[[Group], Iterable[Option]]:
        """``extra``: None on the first walk, then the solved score maps (maybe none)."""
        maps = list(dict.fromkeys([(ex.bias, ex.scale), *extra_maps, *(extra or [])]))
        wr_opts = _whiten_reward_opts(s, walk_all=extra is not None or not checkable)
        clips = list(clip_opts)  # as of this walk: a replay must walk the same options

        def opts(g: Group) -> Iterable[Option]:
            for kl_in, score_at, (bias, scale), sc in product(KLPlacement, ScorePosition, maps, clips):
                use_kl = kl_in is KLPlacement.REWARD and hp.kl_coef > 0
                vm = s.value_mask(score_at)
                scores = map_scores(t["scores"], bias=bias, scale=scale, clip=sc)
                r0 = token_rewards(
                    scores, g.state["kl"] if use_kl else None, m, hp.kl_coef, score_at=score_at
                )
                base = {"kl_in": kl_in.value, "score_at": score_at.value, "score_clip": sc}
                base.update(score_bias=bias, score_scale=scale)
                for wr, var, eps_at in wr_opts:
                    upd: dict[str, Any] = {**base, "whiten_rewards": wr}
                    r, fixed = r0, None
                    if wr != "none":  # the advantage whitening shares the two keys
                        r = _whitened(r0, vm, wr, var, eps_at, hp.whiten_eps)
                        upd.update(whiten_variance=var, whiten_eps_at=eps_at)
                        fixed = (var, eps_at)
                    st = {**g.state, "rewards": r, "vm": vm, "kl_in": kl_in.value, "fixed_whiten": fixed}
                    st["scores"] = scores  # the critic-free estimators group them (search_estimator)
                    yield upd, st, digest(g.state["kl_key"], r, vm, kl_in.value, fixed)

        return opts

    def check(st: dict[str, Any]) -> list[float | None]:
        return [s.ratio("token_rewards", st["rewards"], st["vm"])]

    solved: list[tuple[float, float]] = []

    def propose(gs: list[Group]) -> list[tuple[float, float]]:
        solved.extend(_propose_score_map(s, gs, clip_opts))  # a solved score clip joins clip_opts
        # an empty proposal still walks the reward whitening: return a list that is truthy
        return solved or [(ex.bias, ex.scale)]

    out = s.stage(groups, make, check, "token_rewards", propose)
    if solved and float(t["scores"].max() - t["scores"].min()) == 0.0:
        s.notes += constant_score_notes(s, out)
    if "token_rewards" in s.unmatched and out:
        st = out[0].state
        tol = s.tol.of(float(t["token_rewards"].abs().max()))
        fit = fit_normalisation("token_rewards", t["token_rewards"], st["rewards"], st["vm"], tol)
        s.fitted.append(fit.text + nearest_note(out[0]))
    return out


def _whitened(r: Tensor, vm: Tensor, kind: str, var: str, eps_at: str, eps: float) -> Tensor:
    return normalize(r, vm, kind, unbiased=var == Variance.UNBIASED.value, eps=eps, eps_at=eps_at)


def _propose_score_map(
    s: Search, groups: list[Group], clips: list[float | None]
) -> list[tuple[float, float]]:
    """Score maps ``(b, k)`` with ``token_rewards[slot] = k·(s + b) − β·kl[slot]`` on every row.

    For each KL placement and score slot of the nearest groups, the dump's reward at the slot minus
    the KL part (the core's :func:`token_rewards` with zero scores) is fitted against the scores by
    least squares; a fit whose residual is within tolerance on every row is proposed (rounded to
    round numbers by :func:`nice`). When no line fits, the map is fitted on the rows inside
    ``±max|y|`` and that bound, the score clip, is appended to ``clips`` (the options the stage
    walks again) when it binds on some row. With one score on every row the bias and the scale
    cannot be told apart: :func:`~refppo.oracle.detect.score_const.propose_constant_score_map`
    proposes the class instead.
    """
    t = s.t
    scores = t["scores"].double()
    if float(scores.max() - scores.min()) == 0.0:
        return propose_constant_score_map(s, groups)
    tol = s.tol.of(float(t["token_rewards"].abs().max()))
    out: list[tuple[float, float]] = []
    for g in groups[:SOLVE_GROUPS]:
        for _, y in _slot_targets(s, g):
            fit = _fit_line(scores, y, tol) or _fit_clipped_line(scores, y, tol)
            if fit is None:
                continue
            k, c, clip = fit
            b = c / k if abs(c) > tol else 0.0
            out.append((nice(b)[0] if b != 0.0 else 0.0, nice(k)[0]))
            if clip is not None and clip not in clips:
                clips.append(clip)
                s.propose_value("score_clip", clip)
    out = list(dict.fromkeys(out))[:8]
    for b, k in out:
        s.propose_value("score_bias", b)
        s.propose_value("score_scale", k)
    return out


def _slot_targets(s: Search, g: Group) -> Iterable[tuple[str, Tensor]]:
    """For each KL placement and score slot: ``(label, y)``, the dumped reward at each row's score
    slot minus its KL part (the core's :func:`token_rewards` with zero scores), ``[B]`` float64."""
    t, m, hp = s.t, s.m, s.hp
    rows = torch.arange(m.shape[0])
    for kl_in in KLPlacement:
        kl = g.state["kl"] if kl_in is KLPlacement.REWARD and hp.kl_coef > 0 else None
        for score_at in ScorePosition:
            rest = token_rewards(torch.zeros_like(t["scores"]), kl, m, hp.kl_coef, score_at=score_at)
            pos = score_positions(m, score_at)
            yield (
                f"kl_in={kl_in.value} score_at={score_at.value}",
                (t["token_rewards"][rows, pos] - rest[rows, pos]).double(),
            )


def _fit_line(x: Tensor, y: Tensor, tol: float) -> tuple[float, float, None] | None:
    """``y = k·x + c`` by least squares when it holds on every row within ``tol``."""
    if x.numel() < 2 or float(x.max() - x.min()) == 0.0:
        return None
    xc = x - x.mean()
    k = float((xc * (y - y.mean())).sum() / (xc * xc).sum())
    c = float(y.mean()) - k * float(x.mean())
    if k == 0.0 or float((y - (k * x + c)).abs().max()) > tol:
        return None
    return k, c, None


def _fit_clipped_line(x: Tensor, y: Tensor, tol: float) -> tuple[float, float, float] | None:
    """``y = clip(k·x + c, ±C)`` (AReaL clips the mapped score): ``C = max|y|``, the line fitted on
    the rows strictly inside ``±C``; proposed only when some row's line value really exceeds ``C``."""
    bound = float(y.abs().max())
    inside = y.abs() < bound - tol
    fit = _fit_line(x[inside], y[inside], tol) if int(inside.sum()) >= 2 else None
    if fit is None:
        return None
    clip = nice(bound)[0]
    k, c, _ = fit
    line = k * x + c
    if float(line.abs().max()) <= clip + tol:  # the clip binds nowhere: not read off the data
        return None
    if float((torch.clamp(line, -clip, clip) - y).abs().max()) > tol:
        return None
    return k, c, clip


def gae_stage(s: Search, groups: list[Group]) -> list[Group]:
    """``returns`` (and the raw advantages): GAE over the value mask, or through the padding; across
    interior mask holes by every ``gae_holes`` convention (multi-turn dumps only)."""
    t = s.t
    own = s.base.conv.adv.gae_padding.value
    holes = list(GaeHoles) if has_holes(s.m) else [s.base.conv.adv.gae_holes]

    def make(extra: bool | None) -> Callable[[Group], Iterable[Option]]:
        walk_all = extra is not None or "returns" not in t
        pads = list(dict.fromkeys([own, *(p.value for p in GaePadding)])) if walk_all else [own]

        def opts(g: Group) -> Iterable[Option]:
            yield from gae_options(s, g, pads, holes)

        return opts

    def check(st: dict[str, Any]) -> list[float | None]:
        return [s.ratio("returns", st["returns"], st["vm"])]

    out = s.stage(groups, make, check, "returns", lambda _: True)
    if "returns" in s.unmatched and out:
        _carry_dumped(out, "returns", t["returns"])
    return out


def gae_options(s: Search, g: Group, pads: list[str], holes: list[GaeHoles]) -> Iterable[Option]:
    """GAE for each ``gae_padding`` in ``pads`` and each ``gae_holes`` in ``holes`` (named in the
    option only when more than one is walked: a dump with holes)."""
    t, hp = s.t, s.hp
    vm = g.state["vm"]
    for pad, h in product(pads, holes):
        gmask = vm if pad == GaePadding.MASKED.value else torch.ones_like(vm)
        adv_raw, ret = gae(g.state["rewards"], t["old_values"], gmask, gamma=hp.gamma, lam=hp.lam, holes=h)
        ret_key = digest(ret, vm)
        if s.prune is not None and not s.prune.keeps(ret_key, ret, vm):
            continue  # no value loss reproduces the dump on these returns (refppo.oracle.detect.prune)
        upd = {"gae_padding": pad} | ({"gae_holes": h.value} if len(holes) > 1 else {})
        yield with_raw_advantages(g, upd, adv_raw, ret, ret_key)


def with_raw_advantages(
    g: Group, upd: dict[str, Any], adv_raw: Tensor, ret: Tensor, ret_key: bytes | None = None
) -> Option:
    """The option of step 3 (GAE or a critic-free estimator): its raw advantages and returns
    (``ret_key``: their digest with the value mask, when the caller has it)."""
    ret_key = digest(ret, g.state["vm"]) if ret_key is None else ret_key
    st = {**g.state, "adv_raw": adv_raw, "returns": ret, "ret_key": ret_key}
    key = digest(g.state["kl_key"], g.state["kl_in"], ret_key, adv_raw, g.state.get("fixed_whiten"))
    return upd, st, key


def whiten_stage(s: Search, groups: list[Group]) -> list[Group]:
    """``advantages``: the advantage whitening, its variance and where its eps sits."""
    t, m = s.t, s.m
    c = s.base.conv
    # the whitening takes the envelope under whiten_holes=include; only a mask with holes tells them apart
    holes: list[str | None] = [h.value for h in WhitenHoles] if has_holes(m) else [None]

    def make(extra: bool | None) -> Callable[[Group], Iterable[Option]]:
        eps_ats = [c.norm.eps_at.value]
        if extra is not None or "advantages" not in t:
            eps_ats = list(dict.fromkeys([*eps_ats, *(e.value for e in WhitenEps)]))

        def opts(g: Group) -> Iterable[Option]:
            fixed = g.state.get("fixed_whiten")
            for w, wh in product(Whitening, holes):
                for v in Variance:
                    for e in eps_ats if fixed is None else [fixed[1]]:
                        if fixed is not None and v.value != fixed[0]:
                            continue
                        if (
                            w is Whitening.NONE
                            and (v is not c.norm.variance or e != eps_ats[0])
                            and fixed is None
                        ):
                            continue  # unwhitened advantages do not depend on the two keys
                        upd = {"whiten_advantages": w.value, "whiten_variance": v.value, "whiten_eps_at": e}
                        if wh is not None:
                            upd["whiten_holes"] = wh
                        try:
                            adv = whiten_advantages(g.state["adv_raw"], m, c.with_updates(upd), s.base.hp)
                        except RefPPOError:
                            continue
                        adv_key = digest(adv)  # the policy stage's caches key on it (not on id)
                        st = {**g.state, "adv": adv, "adv_key": adv_key}
                        yield (
                            upd,
                            st,
                            digest(g.state["kl_key"], g.state["kl_in"], g.state["ret_key"], adv_key, fixed),
                        )

        return opts

    def check(st: dict[str, Any]) -> list[float | None]:
        return [s.ratio("advantages", st["adv"], m)]

    out = s.stage(groups, make, check, "advantages", lambda _: True)
    if "advantages" in s.unmatched and out:
        st = out[0].state
        tol = s.tol.of(float(t["advantages"].abs().max()))
        fit = fit_normalisation("advantages", t["advantages"], st["adv_raw"], m, tol, s.hp.whiten_eps)
        s.fitted.append(fit.text + nearest_note(out[0]))
        _carry_dumped(out, "adv", t["advantages"], m)
    return out


def _carry_dumped(groups: list[Group], key: str, dumped: Tensor, mask: Tensor | None = None) -> None:
    """After a stage nothing reproduces, the later stages read the dump's own tensor.

    The loss conventions can then still be identified (the nearest convention names them) when the
    trainer's advantages or returns come from a normalisation no convention expresses; the stage
    itself stays unmatched, so nothing is reported as detected.
    """
    zero = torch.zeros((), dtype=dumped.dtype)
    for g in groups:  # compared where the stage compares: the response mask, or the group's value mask
        given = torch.where(g.state["vm"] if mask is None else mask, dumped, zero)
        g.patch({key: given, **({"adv_key": digest(given)} if key == "adv" else {})})


PEER_GROUP_EPS = (1e-5, 1e-6, 1e-4)
"""``group_eps`` a solved scale is read against: AReaL 1e-5, verl/SkyRL 1e-6, TRL GRPOTrainer 1e-4."""


def solve_group_score_clip(s: Search, groups: list[Group]) -> list[tuple[float, float]]:
    """``(k, C)`` of ``s' = clip((s + b)·k, ±C)`` read off a group-normalised dump's ``returns``.

    Within a group the raw advantage at t = 0 is affine in the mapped score,
    ``a_i = α·s'_i + β`` (``(s' − μ_G)/(σ_G + ε)``, GRPO; ``s' − μ_G``, Dr. GRPO); the unclipped
    rows (``s'_i = (s_i + b)·k₀``, the setting's own ``b, k₀``) fix the line through the most rows,
    and each row off it was clipped: ``C₀ = |(a_i − β)/α|``, a median all such rows agree on (within
    1 %). The scale cancels in ``(s' − μ)/σ`` but for ε: under ``k = r·k₀`` the data reads
    ``ε/r``, so ``r = ε/ε_read`` (``ε`` the setting's ``group_eps`` or one of
    :data:`PEER_GROUP_EPS`, kept when ``r`` is round; ``ε_read`` off the rows as
    :func:`refppo.oracle.detect.estimator.solve_group_eps` does). Proposed: ``(k₀, C₀)`` and
    ``(r·k₀, r·C₀)``, rounded by :func:`refppo.oracle.detect.solve.nice`; every candidate is re-checked
    through the pipeline. Needs ``returns`` and ``group_index`` (else ``[]``). With a reward KL
    (``group_kl=to_go``) the KL's return at t = 0 (:func:`token_rewards` with zero scores, summed)
    is taken off ``returns`` first, for each KL of the nearest groups.
    """
    t = s.t
    if "returns" not in t or "group_index" not in t:
        return []
    ret0 = t["returns"][:, 0].double()
    rests = [torch.zeros_like(ret0)]
    if s.hp.kl_coef > 0:
        for g in groups[:SOLVE_GROUPS]:
            kl_r = token_rewards(torch.zeros_like(t["scores"]), g.state["kl"], s.m, s.hp.kl_coef)
            rests.append((kl_r.double() * s.m).sum(1))
    out: list[tuple[float, float]] = []
    for rest in rests:
        out += _solve_clip(s, [float(v) for v in ret0 - rest])
    return list(dict.fromkeys(out))[:4]


def _solve_clip(s: Search, a: list[float]) -> list[tuple[float, float]]:
    """:func:`solve_group_score_clip` for one reading of the score part ``a`` of ``returns[:, 0]``."""
    t, ex = s.t, s.base.conv.score
    x = [float(v) for v in (t["scores"].double() + ex.bias) * ex.scale]
    gi = t["group_index"]
    groups = [(gi == g).nonzero().flatten().tolist() for g in torch.unique(gi)]
    med = _scan_clip(groups, torch.tensor(x, dtype=torch.float64), torch.tensor(a, dtype=torch.float64))
    if med is None:
        return []
    c0 = nice(med)[0]
    out = [(ex.scale, c0)]
    y = [min(max(v, -c0), c0) for v in x]
    eps_read = _eps_read(groups, y, a)
    for eps in dict.fromkeys([s.base.conv.adv.group_eps, *PEER_GROUP_EPS]):
        if eps_read is None:
            break
        if eps <= 0:  # a checked group_eps = 0 gives no ratio; the peers' ε still do
            continue
        ratio = eps / eps_read
        r = nice(ratio)[0]  # a round ratio only (≤ 2 digits): a configured scale, not noise
        if abs(r - ratio) <= 1e-3 * ratio and float(f"{r:.2g}") == r and r != 1.0:
            out.append((nice(ex.scale * r)[0], nice(c0 * r)[0]))
    return list(dict.fromkeys(out))[:4]


def _eps_read(groups: list[list[int]], y: list[float], a: list[float]) -> float | None:
    """``ε = (y_i − μ_G)/a_i − σ_G`` (unbiased σ) over rows with ``a_i ≠ 0``: the median if all agree."""
    eps: list[float] = []
    for rows in groups:
        if len(rows) < 2:
            continue
        g = [y[i] for i in rows]
        mu = sum(g) / len(g)
        sd = math.sqrt(sum((v - mu) ** 2 for v in g) / (len(g) - 1))
        eps += [(y[i] - mu) / a[i] - sd for i in rows if a[i] != 0.0 and y[i] != mu]
    if not eps:
        return None
    med = sorted(eps)[len(eps) // 2]
    return med if med > 0 and max(abs(e - med) for e in eps) <= 0.01 * med else None


def _zscore(v: Tensor, groups: list[list[int]]) -> Tensor:
    """``v`` (``[..., B]``) centred and scaled to unit std within each group of two rows or more."""
    out = torch.zeros_like(v)
    for rows in (r for r in groups if len(r) > 1):
        g = v[..., rows]
        c = g - g.mean(-1, keepdim=True)
        out[..., rows] = c / c.norm(dim=-1, keepdim=True).clamp_min(1e-300)
    return out


def _scan_clip(groups: list[list[int]], x: Tensor, a: Tensor) -> float | None:
    """The ``C`` whose ``clip(x, ±C)`` has the group z-scores of ``a`` (ε aside): a grid over
    ``(0, max|x|)`` refined by bisection-free narrowing; None when no ``C`` fits within 1e-4
    or the best ``C`` clips nothing."""
    za = _zscore(a, groups)
    top = float(x.abs().max())
    if top == 0.0:
        return None
    lo, hi = 1e-4 * top, top
    best = lo
    for _ in range(6):
        cs = torch.linspace(lo, hi, 401, dtype=torch.float64)
        y = torch.maximum(torch.minimum(x.unsqueeze(0), cs.unsqueeze(1)), -cs.unsqueeze(1))
        err = (_zscore(y, groups) - za).abs().amax(-1)
        k = int(err.argmin())
        best, step = float(cs[k]), float(cs[1] - cs[0])
        lo, hi = max(best - step, 1e-12), best + step
    y = x.clamp(-best, best)
    ok = float((_zscore(y, groups) - za).abs().max()) <= 1e-4
    return best if ok and best < top * (1 - 1e-9) else None
