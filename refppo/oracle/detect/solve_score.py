"""The score-map solvers of ``--detect``'s token_rewards step: they read ``(s + b)·k`` and its clip off
the dump, and only propose (every proposal is walked through the score_map and rewards stages).

* :func:`propose_score_map`: the dumped reward at each row's score slot minus its KL part (the
  rewards stage with zero scores) is a line in the scores (AReaL ``reward_bias``/``reward_scaling``),
  or a clipped line (``reward_clip``);
* with one score on every row the slot reward ``y = k·(s₀ + b)`` pins only the product: the
  class's two one-key members are proposed (:func:`propose_constant_score_map`) and
  :attr:`Search.notes` names, as examples, only the members the walk confirmed;
* :func:`solve_group_score_clip`: the clip read off a group-normalised dump's ``returns``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from refppo.conventions import KLPlacement, ScorePosition
from refppo.oracle.detect.groups import Group
from refppo.oracle.detect.search import SOLVE_GROUPS, Search
from refppo.oracle.detect.solve import nice
from refppo.oracle.detect.states import KLState


def _rewards_of(
    s: Search, g: Group[KLState], scores: Tensor, kl_in: KLPlacement, score_at: ScorePosition
) -> Tensor:
    """The rewards stage on ``scores`` ``[B]`` with the group's KL (before the reward whitening)."""
    q = {"mapped_scores": scores, "kl": g.state.kl, "mask": s.m}
    st = s.setting(stage="rewards", kl_in=kl_in.value, score_at=score_at.value)
    r: Tensor = s.evaluate("rewards", q, st)["token_rewards_raw"]
    return r


def _slot_targets(s: Search, g: Group[KLState]) -> Iterable[tuple[str, Tensor]]:
    """For each KL placement and score slot: ``(label, y)``, the dumped reward at each row's score
    slot minus its KL part (the rewards stage with zero scores), ``[B]`` float64. The slot is where
    the rewards stage puts a unit score without a KL."""
    t = s.t
    zeros, ones = torch.zeros_like(t["scores"]), torch.ones_like(t["scores"])
    for kl_in in KLPlacement:
        for score_at in ScorePosition:
            rest = _rewards_of(s, g, zeros, kl_in, score_at)
            slot = _rewards_of(s, g, ones, KLPlacement.LOSS, score_at) != 0
            yield (
                f"kl_in={kl_in.value} score_at={score_at.value}",
                (t["token_rewards"][slot] - rest[slot]).double(),
            )


def propose_score_map(
    s: Search, groups: list[Group[KLState]], clips: list[float | None]
) -> list[tuple[float, float]]:
    """Score maps ``(b, k)`` with ``token_rewards[slot] = k·(s + b) − β·kl[slot]`` on every row.

    For each KL placement and score slot of the nearest groups, the dump's reward at the slot minus
    the KL part (the rewards stage with zero scores) is fitted against the scores by
    least squares; a fit whose residual is within tolerance on every row is proposed (rounded to
    round numbers by :func:`nice`). When no line fits, the map is fitted on the rows inside
    ``±max|y|`` and that bound, the score clip, is appended to ``clips`` (the options the stage
    walks again) when it binds on some row. With one score on every row the bias and the scale
    cannot be told apart: :func:`propose_constant_score_map`
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


def propose_constant_score_map(s: Search, groups: list[Group[KLState]]) -> list[tuple[float, float]]:
    """Every row holds the same score ``s₀``: the slot reward ``y = k·(s₀ + b)`` pins only the
    product, so the map is proposed as its two one-key members, ``(0, y/s₀)`` (scale only, when
    ``s₀ ≠ 0``) and ``(y − s₀, 1)`` (bias only), each the roundest number that still gives ``y``
    (:func:`_roundest`: 2.69 for 3.5/1.3 misses the slots by 3e-3, the exact quotient does not).
    ``y`` must be one number on every row (within tolerance) for some KL placement and slot.
    Which members the walk confirmed is said afterwards by :func:`constant_score_notes`."""
    s0 = float(s.t["scores"].double().flatten()[0])
    tol = s.tol.of(float(s.t["token_rewards"].abs().max()))
    out: list[tuple[float, float]] = []
    for g in groups[:SOLVE_GROUPS]:
        for _, y in _slot_targets(s, g):
            if float(y.max() - y.min()) > tol:
                continue
            y0 = float(y.mean())
            if s0 != 0.0 and y0 != 0.0:
                out.append((0.0, _roundest(y0 / s0, lambda k: k * s0, y0, tol)))
            out.append((_roundest(y0 - s0, lambda b: s0 + b, y0, tol), 1.0))
    out = list(dict.fromkeys(out))[:8]
    for b, k in out:
        s.propose_value("score_bias", b)
        s.propose_value("score_scale", k)
    return out


def _roundest(x: float, slot: Callable[[float], float], y0: float, tol: float) -> float:
    """The first of :func:`nice`'s roundings of ``x`` whose slot value is within ``tol/4`` of
    ``y0``, else ``x`` itself (2.69 for 3.5/1.3 gives 3.497: the exact quotient is proposed)."""
    return next((r for r in nice(x) if abs(slot(r) - y0) <= tol / 4), x)


def constant_score_notes(s: Search, out: list[Group[Any]]) -> list[str]:
    """One :attr:`Search.notes` line per KL placement and score slot for a constant-score dump
    whose score map was solved: the class ``k·(s₀ + b) = y`` and, as examples, only the maps
    the walk confirmed (those in the matching groups' conventions), printed so they reproduce."""
    if "token_rewards" in s.unmatched:
        return []
    s0 = float(s.t["scores"].double().flatten()[0])
    found: dict[str, list[tuple[float, float]]] = {}
    for g in out:
        for c in g.convs:
            if c.get("whiten_rewards", "none") != "none":  # the slot value is not k·(s₀ + b) there
                continue
            label = f"kl_in={c['kl_in']} score_at={c['score_at']}"
            mp = (float(c["score_bias"]), float(c["score_scale"]))
            if mp not in found.setdefault(label, []):
                found[label].append(mp)
    notes = []
    for label, maps in found.items():
        y0 = maps[0][1] * (s0 + maps[0][0])
        notes.append(
            f"token_rewards: every score is {s0:g}, so score_bias b and score_scale k cannot be told "
            f"apart: every map with k·({s0:g} + b) = {y0:.6g} reproduces the score slots ({label}), "
            "e.g. " + " or ".join(f"score_bias={_exact(b)} score_scale={_exact(k)}" for b, k in maps)
        )
    return notes


def _exact(v: float) -> str:
    """``v`` in the fewest digits that read back as ``v`` (``2.8``, ``0``, ``2.692307692307692``)."""
    return f"{v:g}" if float(f"{v:g}") == v else repr(v)


PEER_GROUP_EPS = (1e-5, 1e-6, 1e-4)
"""``group_eps`` a solved scale is read against: AReaL 1e-5, verl/SkyRL 1e-6, TRL GRPOTrainer 1e-4."""


def solve_group_score_clip(s: Search, groups: list[Group[KLState]]) -> list[tuple[float, float]]:
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
    (``group_kl=to_go``) the KL's return at t = 0 (summed)
    is taken off ``returns`` first (the rewards stage with zero scores), for each KL of the nearest groups.
    """
    t = s.t
    if "returns" not in t or "group_index" not in t:
        return []
    ret0 = t["returns"][:, 0].double()
    rests = [torch.zeros_like(ret0)]
    if s.hp.kl_coef > 0:
        for g in groups[:SOLVE_GROUPS]:
            kl_r = _rewards_of(
                s, g, torch.zeros_like(t["scores"]), KLPlacement.REWARD, ScorePosition.LAST_VALID
            )
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


__all__ = [
    "constant_score_notes",
    "propose_constant_score_map",
    "propose_score_map",
    "solve_group_score_clip",
]
