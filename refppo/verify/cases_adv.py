"""The verify cases of the score and critic-free advantage steps: the score map, score positions,
group baselines (every group estimator, std option, std level and singleton rule), REINFORCE++
returns and advantages (every ``holes`` rule) and batch normalisation (every kind and ``eps_at``).

Each case returns a list of (output name, vectorised, naive, mask-or-None) to compare.
Vectorised functions are looked up on their module at call time (so a test can monkeypatch one).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import Tensor

from refppo.conventions import AdvantageEstimator, GaeHoles, ScorePosition, WhitenEps, Whitening
from refppo.core import group_naive, helpers_naive
from refppo.group_conventions import GroupStdLevel
from refppo.verify.batches import Batch, Case, Pair, with_holes

# The modules themselves, looked up by name at call time (see refppo/verify/cases.py).
group_mod = importlib.import_module("refppo.core.group")
normalize_mod = importlib.import_module("refppo.core.normalize")
rewards_mod = importlib.import_module("refppo.core.rewards")
score_map_mod = importlib.import_module("refppo.core.score_map")

E = AdvantageEstimator
GROUPED = (E.GRPO, E.DR_GRPO, E.RLOO, E.REINFORCE_PP_BASELINE, E.OPO, E.GPG, E.GRPO_PASSK)


def _t(x: list[float] | list[int], like: Tensor) -> Tensor:
    return torch.tensor(x, dtype=torch.float64, device=like.device)


def _case_map_scores(b: Batch, dev: torch.device) -> list[Pair]:
    s = b.scores(-6.0, 6.0)
    out: list[Pair] = []
    for bias, scale, clip in ((0.0, 1.0, None), (0.5, 1.0, None), (0.0, 2.5, None), (0.0, 1.0, 3.0),
                              (-0.3, 0.7, 2.0), (1.0, -1.5, 4.0)):  # fmt: skip
        vec = score_map_mod.map_scores(s.to(dev), bias=bias, scale=scale, clip=clip)
        nv = score_map_mod.map_scores_naive(s, bias=bias, scale=scale, clip=clip)
        out.append((f"b={bias},k={scale},C={clip}", vec, _t(nv, vec), None))
    return out


def _case_score_positions(b: Batch, dev: torch.device) -> list[Pair]:
    out: list[Pair] = []
    for tag, mb in (("", b), ("holes,", with_holes(b))):
        for where in ScorePosition:
            vec = rewards_mod.score_positions(mb.mask.to(dev), where)
            out.append(
                (
                    f"{tag}{where.value}",
                    vec,
                    _t(helpers_naive.score_positions_naive(mb.mask, where), vec),
                    None,
                )
            )
    return out


def _groups(b: Batch, singletons: bool) -> Tensor:
    """``group_index [B]``: shuffled, sparse prompt ids; every group of size >= 2 unless ``singletons``."""
    B, _ = b.shape
    if singletons:
        ids = torch.randint(0, B, (B,), generator=b.gen)
    else:
        ids = torch.tensor([min(i // 2, max(B // 2 - 1, 0)) for i in range(B)])  # pairs, odd B: a triple
        ids = ids[torch.randperm(B, generator=b.gen)]
    return ids * 7 + 3  # not 0..K-1: the ids are labels, not indices


def _distinct_scores(b: Batch) -> Tensor:
    """Scores at least 0.7 apart (a random order of a jittered grid): a group's σ is never tiny, so
    the float32 rounding of ``s − μ`` is not blown up by ``1/σ`` beyond the tolerance."""
    B, _ = b.shape
    grid = torch.randperm(B, generator=b.gen).to(torch.float64) - B / 2
    return (grid + 0.3 * torch.rand(B, generator=b.gen, dtype=torch.float64)).to(b.dtype)


def _binary_scores(b: Batch) -> Tensor:
    """0/1 scores: ties inside groups (pass@k's shared best, GPG's zero count, σ = 0 groups)."""
    B, _ = b.shape
    return (torch.rand(B, generator=b.gen) < 0.5).to(b.dtype)


def _adv_configs() -> list[tuple[str, str, dict[str, Any]]]:
    """(tag, scores kind, options) of every compared ``group_advantages`` call."""
    cfgs: list[tuple[str, str, dict[str, Any]]] = []
    for est in (*GROUPED, E.FLASH_REINFORCE):
        cfgs.append((est.value, "distinct", {"estimator": est}))
        cfgs.append((f"{est.value},binary", "binary", {"estimator": est}))
        for single in ("score", "zero"):
            if not (est is E.GRPO_PASSK and single == "score"):  # refused by both (no second best)
                cfgs.append(
                    (f"{est.value},singleton={single}", "singletons", {"estimator": est, "singleton": single})
                )
    for est in (E.GRPO, E.GRPO_PASSK):
        cfgs.append((f"{est.value},no_std", "distinct", {"estimator": est, "scale_by_std": False}))
        cfgs.append((f"{est.value},pop_std", "distinct", {"estimator": est, "unbiased_std": False}))
        for level in (GroupStdLevel.BATCH, GroupStdLevel.BATCH_CENTRED):
            for unb in (True, False):
                opts: dict[str, Any] = {"estimator": est, "std_level": level, "unbiased_std": unb}
                cfgs.append((f"{est.value},{level.value},unbiased={unb}", "distinct", opts))
    for est in (E.GRPO, E.RLOO, E.REINFORCE_PP_BASELINE, E.FLASH_REINFORCE):
        cfgs.append((f"{est.value},penalty", "distinct", {"estimator": est, "token_penalty": True}))
    for unb, form in ((False, "clamp"), (True, "clamp"), (False, "add")):
        opts = {"estimator": E.REINFORCE_PP_BASELINE, "whiten_unbiased": unb, "whiten_eps_form": form}
        cfgs.append((f"reinforce++-baseline,whiten_unbiased={unb},{form}", "distinct", opts))
    return cfgs


def _case_group_advantages(b: Batch, dev: torch.device) -> list[Pair]:
    m = b.mask
    scores = {"distinct": _distinct_scores(b), "binary": _binary_scores(b), "singletons": _distinct_scores(b)}
    groups = {"distinct": _groups(b, False), "binary": _groups(b, False), "singletons": _groups(b, True)}
    penalty = b.floats(-0.3, 0.3)
    out: list[Pair] = []
    for tag, kind, opts in _adv_configs():
        s, g = scores[kind], groups[kind]
        gi = None if opts["estimator"] is E.FLASH_REINFORCE else g
        kw = dict(opts)
        pen = penalty if kw.pop("token_penalty", False) else None
        vec = group_mod.group_advantages(
            s.to(dev), gi.to(dev) if gi is not None else None, m.to(dev),
            token_penalty=pen.to(dev) if pen is not None else None, **kw,
        )  # fmt: skip
        nv = group_naive.group_advantages_naive(s, gi, m, token_penalty=pen, **kw)
        out.append((tag, vec, nv, None))
    # whiten=False leaves reinforce++-baseline's whitening to the caller: a_i = s_i − μ_G (= dr-grpo's).
    s, g = scores["distinct"], groups["distinct"]
    vec = group_mod.group_advantages(
        s.to(dev), g.to(dev), m.to(dev), estimator=E.REINFORCE_PP_BASELINE, whiten=False
    )
    out.append(
        (
            "reinforce++-baseline,whiten=False",
            vec,
            group_naive.group_advantages_naive(s, g, m, estimator=E.DR_GRPO),
            None,
        )
    )
    return out


def _case_group_scalar(b: Batch, dev: torch.device) -> list[Pair]:
    m = b.mask
    s, g, lengths = _distinct_scores(b), _groups(b, False), m.sum(dim=1).to(b.dtype)
    out: list[Pair] = []
    for est in (*GROUPED, E.FLASH_REINFORCE):
        gi = None if est is E.FLASH_REINFORCE else g
        for level in GroupStdLevel:
            vec = group_mod.group_scalar_advantages(
                s.to(dev),
                gi.to(dev) if gi is not None else None,
                estimator=est,
                lengths=lengths.to(dev),
                std_level=level,
            )
            nv = helpers_naive.group_scalar_advantages_naive(
                s, gi, estimator=est, lengths=lengths, std_level=level
            )
            out.append((f"{est.value},{level.value}", vec, _t(nv, vec), None))
    return out


def _case_discounted_returns(b: Batch, dev: torch.device) -> list[Pair]:
    hb = with_holes(b)
    r_junk, r_env = hb.floats(-1.0, 1.0), b.floats(-1.0, 1.0)  # junk on the holes / finite there
    out: list[Pair] = []
    for how in GaeHoles:
        holed_r = r_env if how is GaeHoles.THROUGH else r_junk  # `through` reads the holes
        for gamma in (1.0, 0.9):
            for tag, mask, r in (("", b.mask, r_env), ("holes,", hb.mask, holed_r)):
                vec = group_mod.discounted_returns(r.to(dev), mask.to(dev), gamma=gamma, holes=how)
                nv = group_naive.discounted_returns_naive(r, mask, gamma=gamma, holes=how)
                out.append((f"{tag}{how.value},γ={gamma}", vec, nv, None))
    return out


def _case_reinforce_pp(b: Batch, dev: torch.device) -> list[Pair]:
    hb = with_holes(b)
    r_junk, r_env = hb.floats(-1.0, 1.0), b.floats(-1.0, 1.0)
    out: list[Pair] = []
    for how in GaeHoles:
        r = r_env if how is GaeHoles.THROUGH else r_junk
        for gamma, unb, form in ((1.0, True, "add"), (0.95, False, "clamp")):
            kw: dict[str, Any] = {
                "gamma": gamma,
                "whiten_unbiased": unb,
                "whiten_eps_form": form,
                "holes": how,
            }
            vec = group_mod.reinforce_pp_advantages(r.to(dev), hb.mask.to(dev), **kw)
            nv = group_naive.reinforce_pp_advantages_naive(r, hb.mask, **kw)
            out.append((f"holes,{how.value},γ={gamma},{form}", vec, nv, None))
    vec = group_mod.reinforce_pp_advantages(r_env.to(dev), b.mask.to(dev), gamma=0.9)
    out.append(("γ=0.9", vec, group_naive.reinforce_pp_advantages_naive(r_env, b.mask, gamma=0.9), None))
    return out


def _case_normalize(b: Batch, dev: torch.device) -> list[Pair]:
    x = b.floats(-3.0, 3.0)
    out: list[Pair] = []
    for kind in Whitening:
        for at in WhitenEps:
            for unb in (True, False):
                vec = normalize_mod.normalize(x.to(dev), b.mask.to(dev), kind, unbiased=unb, eps_at=at)
                nv = normalize_mod.normalize_naive(x, b.mask, kind, unbiased=unb, eps_at=at)
                out.append((f"{kind.value},{at.value},unbiased={unb}", vec, nv, None))
    return out


ADV_CASES: dict[str, Case] = {
    "map_scores": _case_map_scores,
    "score_positions": _case_score_positions,
    "group_scalar_advantages": _case_group_scalar,
    "group_advantages": _case_group_advantages,
    "discounted_returns": _case_discounted_returns,
    "reinforce_pp_advantages": _case_reinforce_pp,
    "normalize": _case_normalize,
}
"""The score and critic-free advantage steps' cases, in table order (after the per-token steps)."""
