"""refppo's half of ``tools/peers rollout_correction``, continued: verl's losses, OpenRLHF, AReaL,
SkyRL-train and TRL (:mod:`peers.rollout_correction_ref` has the shared checks and verl's weights)."""

from __future__ import annotations

from functools import partial
from typing import Any

from peers import rollout_correction as rc
from peers.harness import Case
from peers.rollout_correction_ref import _clip, _loss_case, _norms, _tensor_case, verl_rs


def _core() -> Any:
    """refppo's core modules (imported on refppo's side only)."""
    import types

    from refppo.core import cispo, rollout_correction, rollout_losses

    return types.SimpleNamespace(
        is_weights=rollout_correction.is_weights, rejection_mask=rollout_correction.rejection_mask,
        corrected=rollout_losses.corrected_policy_loss, cispo=cispo.cispo_policy_loss,
        weighted=cispo.weighted_logprob_loss,
    )  # fmt: skip


def _corrected(lp: Any, x: dict[str, Any], weight: Any, keep: Any = None, **kw: Any) -> Any:
    """refppo's weighted clipped surrogate of the current log-probs ``lp`` (``kw``: rejected, clip, norms)."""
    return _core().corrected(lp, x["prox"], x["adv"], x["mask"].bool(), weight, keep=keep, **kw)


def _cispo(lp: Any, x: dict[str, Any], **kw: Any) -> Any:
    return _core().cispo(lp, x["prox"], x["adv"], x["mask"].bool(), **kw)


def _bypass(lp: Any, x: dict[str, Any], norms: Any, detach: bool) -> Any:
    """verl's bypass REINFORCE: ``w = min(π_θ/π^beh, 2)`` (detached unless the control), ``−w·A·l``."""
    c, m = _core(), x["mask"].bool()
    w = c.is_weights(lp, x["beh"], m, high=rc.BYPASS_CAP, log_ratio_clamp=20.0, detach=detach).weight
    return c.weighted(lp, w, x["adv"], m, norms=norms)


CISPO = {"clip_low": rc.EPS_LO, "clip_high": rc.EPS_HI, "log_ratio_clamp": 20.0}
"""verl's and SkyRL's CISPO range ``[1 − ε_low, 1 + ε_high]`` and κ = 20."""


def verl_losses(x: dict[str, Any], got: dict[str, Any], w: dict[Any, Any]) -> list[Case]:
    import torch

    c, m, ones, cases = _core(), x["mask"].bool(), torch.ones_like(x["prox"]), []
    for (level, thr), agg in rc.verl_weighted_cases():
        ww, nm = w[(level, thr)], _norms(agg)
        ref = partial(_corrected, x=x, weight=ww.weight, keep=ww.keep, clip=_clip(), norms=nm)
        ctl = partial(_corrected, x=x, weight=ones, clip=_clip(), norms=nm)
        key = rc.verl_weighted_key(level, thr, agg)
        cases.append(_loss_case("verl", key, x, got, ref, [("no weight", ctl)]))
    for (opt, thr), agg in rc.verl_drop_cases():
        keep = c.rejection_mask(
            x["prox"], x["beh"], m, **verl_rs(opt, thr), order="behaviour", log_ratio_clamp=20.0
        )
        kw = {"x": x, "weight": ones, "keep": keep, "clip": _clip(), "norms": _norms(agg)}
        ref, ctl = partial(_corrected, rejected="drop", **kw), partial(_corrected, rejected="zero", **kw)
        cases.append(
            _loss_case("verl", rc.verl_drop_key(opt, thr, agg), x, got, ref, [("rejected=zero", ctl)])
        )
    for weighted, agg in rc.verl_cispo_cases():
        wt, nm = (w[("token", 2.0)].weight if weighted else None), _norms(agg)
        ref = partial(_cispo, x=x, weight=wt, norms=nm, **CISPO)
        ctl = partial(_corrected, x=x, weight=ones if wt is None else wt, clip=_clip(), norms=nm)
        key = rc.verl_cispo_key(weighted, agg)
        cases.append(_loss_case("verl", key, x, got, ref, [("clipped surrogate", ctl)]))
    for agg in rc.AGGS_BYPASS:
        ref, ctl = (
            partial(_bypass, x=x, norms=_norms(agg), detach=True),
            partial(_bypass, x=x, norms=_norms(agg), detach=False),
        )
        cases.append(_loss_case("verl", rc.verl_bypass_key(agg), x, got, ref, [("weight not detached", ctl)]))
    return cases


def _openrlhf_weights(
    x: dict[str, Any], level: str, mode: str, bounds: tuple[float, float], flip: bool
) -> Any:
    """OpenRLHF's coefficient: token ``clip`` / ``mask`` of the token ratio; ``seq`` gate: the token ratio
    where the row's geometric mean is in the band (``flip``: the other mode / the product gate)."""
    c, m = _core(), x["mask"].bool()
    p, b, (lo, hi) = x["prox"], x["beh"], bounds
    if level == "token":
        md = "truncate" if (mode == "clip") != flip else "mask"
        ww = c.is_weights(p, b, m, mode=md, low=lo, high=hi)
        return ww.weight, ww.keep
    gate = {"stat": "ratio", "order": "proximal", "level": "sequence", "reduce": "sum" if flip else "mean"}
    return c.is_weights(p, b, m).raw, c.rejection_mask(p, b, m, low=lo, high=hi, **gate)


def _openrlhf_loss(lp: Any, x: dict[str, Any], case: tuple[Any, ...], flip: bool) -> Any:
    level, mode, bounds, token_level, dual = case
    wt, keep = _openrlhf_weights(x, level, mode, bounds, flip)
    nm = _norms("token-mean" if token_level else "seq-mean-token-mean")
    return _corrected(lp, x, wt, keep, clip=_clip(dual=dual), norms=nm)


def openrlhf(x: dict[str, Any], got: dict[str, Any]) -> list[Case]:
    cases = []
    for case in rc.OPENRLHF:
        label = "mode swapped" if case[0] == "token" else "gate on the product"
        ref, ctl = (
            partial(_openrlhf_loss, x=x, case=case, flip=False),
            partial(_openrlhf_loss, x=x, case=case, flip=True),
        )
        cases.append(_loss_case("openrlhf", rc.openrlhf_key(*case), x, got, ref, [(label, ctl)]))
    return cases


AREAL_CONTROL: tuple[dict[str, str], ...] = (
    {"action": "clamp"}, {"action": "mask"}, {"is_agg": "product"}, {"is_agg": "product"}, {"agg": "mean"},
    {"order": "behaviour"}, {"agg": "mean"}, {"agg": "mean"},
)  # fmt: skip
"""One flipped convention per case of :data:`peers.rollout_correction.AREAL` (the control)."""


def _areal_weights(x: dict[str, Any], case: tuple[Any, ...], flip: dict[str, str]) -> tuple[Any, Any]:
    """AReaL's behaviour weight ``where(keep, w, 0)`` (float64) and ``keep``, from the float32 log-probs."""
    import torch

    c, m = _core(), x["mask"].bool()
    p32, b32 = x["prox"].float(), x["beh"].float()
    level, action, metric, agg, lower, upper, _ = case
    s = {"level": level, "action": action, "agg": agg, "is_agg": "geometric", "order": "proximal"} | flip
    mode = "mask" if s["action"] == "mask" else "truncate"
    if metric == "ratio" and (level == "token" or s["agg"] == "mean"):
        ww = c.is_weights(p32, b32, m, level=level, agg=s["is_agg"], mode=mode, low=lower, high=upper)
        return ww.weight.double(), ww.keep
    if metric == "ratio":
        raw = c.is_weights(p32, b32, m, level="sequence", agg=s["is_agg"]).raw
        gate = {"stat": "ratio", "level": "sequence", "reduce": s["agg"], "order": s["order"]}
    else:
        raw = c.is_weights(p32, b32, m).raw
        gate = {"stat": metric.removeprefix("kl_"), "level": level, "reduce": s["agg"], "order": s["order"]}
    keep = c.rejection_mask(p32, b32, m, low=lower, high=upper, **gate)
    return torch.where(keep, raw, 0.0).double(), keep


def _areal_loss(lp: Any, x: dict[str, Any], case: tuple[Any, ...], flip: dict[str, str]) -> Any:
    wt, keep = _areal_weights(x, case, flip)
    return _corrected(lp, x, wt, keep, clip=_clip(dual=case[6], kappa=None), norms=_norms("token-mean"))


def areal(x: dict[str, Any], got: dict[str, Any]) -> list[Case]:
    m, cases = x["mask"].bool(), []
    for case, flip in zip(rc.AREAL, AREAL_CONTROL, strict=True):
        key = rc.areal_key(case)
        ref, ctl = (
            partial(_areal_loss, x=x, case=case, flip={}),
            partial(_areal_loss, x=x, case=case, flip=flip),
        )
        cases.append(_loss_case("areal", key, x, got, ref, [(str(flip), ctl)]))
        w_ref, w_ctl = _areal_weights(x, case, {})[0], _areal_weights(x, case, flip)[0]
        cases.append(
            _tensor_case("areal", key + "/weight", got[key + "/weight"], w_ref, [(str(flip), w_ctl)], m)
        )
    return cases


SKYRL_AGG = {"token_mean": "token-mean", "sequence_mean": "seq-mean-token-mean"}
SKYRL_AGG |= {"seq_mean_token_sum_norm": "seq-mean-token-sum-norm"}


def _skyrl_tis(
    lp: Any, x: dict[str, Any], mode: str | None, cap: float, dual: float | None, norms: Any
) -> Any:
    """SkyRL's TIS: ``min(π^prox/π^beh, cap)`` (κ = 20) times the PPO loss; ``mode`` None: no weight."""
    import torch

    m = x["mask"].bool()
    wt = torch.ones_like(x["prox"])
    if mode is not None:
        wt = _core().is_weights(x["prox"], x["beh"], m, mode=mode, high=cap, log_ratio_clamp=20.0).weight
    return _corrected(lp, x, wt, clip=_clip(dual), norms=norms)


def skyrl(x: dict[str, Any], got: dict[str, Any]) -> list[Case]:
    import torch

    cases, ones = [], torch.ones_like(x["prox"])
    for kind, reduction, cap in rc.SKYRL:
        nm, key = _norms(SKYRL_AGG[reduction]), rc.skyrl_key(kind, reduction, cap)
        if kind == "cispo" or cap is None:
            ref = partial(_cispo, x=x, norms=nm, **CISPO)
            ctl = partial(_corrected, x=x, weight=ones, clip=_clip(None), norms=nm)
            cases.append(_loss_case("skyrl", key, x, got, ref, [("clipped surrogate", ctl)]))
            continue
        kw = {"x": x, "cap": cap, "dual": rc.DUAL if kind == "dual_clip" else None, "norms": nm}
        controls = [
            ("no weight", partial(_skyrl_tis, mode=None, **kw)),
            ("mask mode", partial(_skyrl_tis, mode="mask", **kw)),
        ]
        cases.append(_loss_case("skyrl", key, x, got, partial(_skyrl_tis, mode="truncate", **kw), controls))
    return cases


def _trl_loss(lp: Any, x: dict[str, Any], ww: Any, agg: str, beta: float, detach_kl_weight: bool) -> Any:
    """TRL's GRPO loss with the vLLM IS weight: ``agg(w'·ℓ^PPO + β·ρ·k3)``, ``ρ = π_θ/π^old`` (not
    detached in TRL: ``use_bias_correction_kl``)."""
    from refppo.core.aggregate import aggregate_loss
    from refppo.core.kl import token_kl

    m = x["mask"].bool()
    pol = _corrected(lp, x, ww.weight, ww.keep, clip=_clip(None, None), norms=_norms(agg))
    if beta == 0.0:
        return pol
    rho = _core().is_weights(lp, x["prox"], m, detach=detach_kl_weight).raw
    return aggregate_loss(pol.per_token + beta * rho * token_kl(lp, x["ref"], m, "k3"), m, agg)


def _trl_weights(x: dict[str, Any], mode: str, bounds: tuple[float | None, float], flip: bool) -> Any:
    """TRL's ``vllm_importance_sampling_ratio`` (product at sequence level; ``flip``: geometric / the
    other mode)."""
    level = "sequence" if mode.startswith("sequence") else "token"
    md = "mask" if mode.endswith("mask") else "truncate"
    kw = {"level": level, "mode": md, "low": bounds[0], "high": bounds[1]}
    if flip:
        kw |= (
            {"agg": "geometric"} if level == "sequence" else {"mode": "truncate" if md == "mask" else "mask"}
        )
    return _core().is_weights(x["prox"], x["beh"], x["mask"].bool(), **kw)


def trl(x: dict[str, Any], got: dict[str, Any]) -> list[Case]:
    m, cases = x["mask"].bool(), []
    for case in rc.TRL:
        lt, mode, bounds, beta = case
        key, ww, w_ctl = (
            rc.trl_key(case),
            _trl_weights(x, mode, bounds, False),
            _trl_weights(x, mode, bounds, True),
        )
        flip = "geometric" if mode.startswith("sequence") else "mode swapped"
        cases.append(
            _tensor_case("trl", key + "/weight", got[key + "/weight"], ww.weight, [(flip, w_ctl.weight)], m)
        )
        agg = "seq-mean-token-mean" if lt == "grpo" else "token-mean"
        if lt == "cispo":
            kw = {"x": x, "clip_high": rc.TRL_CISPO_CAP - 1.0, "weight": ww.weight, "norms": _norms(agg)}
            ref = partial(_cispo, clip_low=None, **kw)
            controls = [("a lower bound 1 − ε_low", partial(_cispo, clip_low=rc.EPS_LO, **kw))]
        else:
            ref = partial(_trl_loss, x=x, ww=ww, agg=agg, beta=beta, detach_kl_weight=False)
            if beta:
                controls = [
                    (
                        "KL weight detached",
                        partial(_trl_loss, x=x, ww=ww, agg=agg, beta=beta, detach_kl_weight=True),
                    )
                ]
            else:
                controls = [
                    (flip, partial(_trl_loss, x=x, ww=w_ctl, agg=agg, beta=0.0, detach_kl_weight=False))
                ]
        cases.append(_loss_case("trl", key, x, got, ref, controls))
    return cases
