"""refppo's half of ``tools/peers rollout_correction``: each peer case recomputed with refppo's core
(``refppo.core.rollout_correction``, ``rollout_losses``, ``cispo``) and compared, with its control.

The mapping of every peer option onto refppo's conventions is spec/rollout-correction.md's table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from peers import rollout_correction as rc
from peers.checks import err
from peers.harness import Case, Control

TOL = {"verl": 1e-7, "openrlhf": 1e-7, "areal": 1e-9, "skyrl": 1e-6, "trl": 1e-9}
"""Relative tolerance per peer (module docstring of :mod:`peers.rollout_correction`)."""

Fn = Callable[[Any], Any]


def _clip(dual: float | None = rc.DUAL, kappa: float | None = 20.0) -> Any:
    from refppo.core.rollout_losses import PolicyClip

    return PolicyClip(clip_low=rc.EPS_LO, clip_high=rc.EPS_HI, dual_clip=dual, log_ratio_clamp=kappa)


def _norms(agg: str, **kw: Any) -> Any:
    from refppo.core.rollout_losses import Norms

    return Norms(agg=agg, **kw)


def _grad(x: dict[str, Any], loss_of: Fn) -> tuple[Any, Any]:
    """``(loss, ∂loss/∂l)`` of ``loss_of(l)`` with the current log-probs a fresh leaf."""
    lp = x["cur"].clone().requires_grad_(True)
    loss = loss_of(lp)
    loss.backward()
    return loss.detach(), lp.grad


def _loss_case(
    unit: str, key: str, x: dict[str, Any], got: dict[str, Any], ref: Fn, controls: Sequence[tuple[str, Fn]]
) -> Case:
    """Loss and gradient of ``ref`` against the peer's (and its clip fraction when the peer gave one
    and ``ref`` returns ``(loss, clipfrac)``); each control must move the loss or the gradient."""
    m, tol = x["mask"].bool(), TOL[unit]
    out: dict[str, Any] = {}
    loss, grad = _grad(x, lambda lp: _remember(out, ref(lp)))
    errs = {
        "loss": err(loss, got[key + "/loss"], rtol=tol),
        "grad": err(grad, got[key + "/grad"], m, rtol=tol),
    }
    if key + "/clipfrac" in got and "clipfrac" in out:
        errs["clipfrac"] = err(out["clipfrac"], got[key + "/clipfrac"], rtol=tol)
    pad_ok = bool((grad[~m] == 0).all()) and bool((got[key + "/grad"][~m] == 0).all())
    ctl = []
    for label, fn in controls:

        def control(lp: Any, fn: Fn = fn) -> Any:
            return _remember({}, fn(lp))

        c_loss, c_grad = _grad(x, control)
        gap = max(err(c_loss, got[key + "/loss"])[0], err(c_grad, got[key + "/grad"], m)[0])
        ctl.append(Control(label, gap > 1e3 * tol, f"loss or gradient differs by {gap:.1e}"))
    ok = pad_ok and all(e <= t for e, t in errs.values())
    return Case(unit, key, ok, {k: e for k, (e, _) in errs.items()}, ctl, {"pad_zero": pad_ok})


def _remember(out: dict[str, Any], res: Any) -> Any:
    """A refppo loss output's scalar (its clip fraction kept in ``out``)."""
    if hasattr(res, "loss"):
        out["clipfrac"] = res.clipfrac
        return res.loss
    return res[0] if isinstance(res, tuple) else res


def _tensor_case(unit: str, key: str, got: Any, ref: Any, controls: list[tuple[str, Any]], m: Any) -> Case:
    """A weight or a kept mask (bool: counted as mismatching tokens) against the peer's."""
    import torch

    def gap(a: Any) -> float:
        if a.dtype == torch.bool:  # kept masks: the number of tokens kept on one side only
            return float((a != got.bool())[m].sum())
        return err(a, got, m)[0]

    tol = 0.0 if ref.dtype == torch.bool else TOL[unit] * max(1.0, float(got[m].abs().max()))
    e = gap(ref)
    ctl = [
        Control(label, gap(c) > 1e3 * max(tol, 1e-12), f"differs by {gap(c):.3g}") for label, c in controls
    ]
    return Case(unit, key, e <= tol, {"value": e}, ctl)


def compare(unit: str, x: dict[str, Any], got: dict[str, Any]) -> list[Case]:
    """Every case of ``unit`` (a peer)."""
    from peers import rollout_correction_ref2 as more

    table: dict[str, Callable[[dict[str, Any], dict[str, Any]], list[Case]]] = {
        "verl": _verl, "openrlhf": more.openrlhf, "areal": more.areal, "skyrl": more.skyrl, "trl": more.trl,
    }  # fmt: skip
    return table[unit](x, got)


def verl_threshold(thr: float | str) -> tuple[str, float | None, float]:
    """verl's ``rollout_is_threshold``: ``(mode, C_low, C_high)``."""
    if isinstance(thr, str):
        lo, hi = (float(v) for v in thr.split("_"))
        return "mask", lo, hi
    return "truncate", None, float(thr)


def verl_rs(opt: str, thr: float | str) -> dict[str, Any]:
    """verl's ``rollout_rs`` option as :func:`refppo.core.rollout_correction.rejection_mask` keywords:
    k1 bounds are ratio bounds of ``π^beh/π^prox`` (``behaviour`` order, ``ratio`` statistic)."""
    level = "token" if opt.startswith("token") else "sequence"
    reduce = opt.split("_")[1] if level == "sequence" else "mean"
    kind = opt.rsplit("_", 1)[1]
    if kind == "k1":
        lo, hi = (float(v) for v in str(thr).split("_")) if "_" in str(thr) else (1 / float(thr), float(thr))
        return {"stat": "ratio", "level": level, "reduce": reduce, "low": lo, "high": hi}
    return {"stat": kind, "level": level, "reduce": reduce, "low": None, "high": float(thr)}


VERL_RS_CONTROL = {
    "token_k1": {"order": "proximal"},
    "token_k2": {"stat": "k3"},
    "token_k3": {"order": "proximal"},
    "seq_sum_k1": {"reduce": "mean"},
    "seq_mean_k1": {"reduce": "sum"},
    "seq_sum_k2": {"reduce": "mean"},
    "seq_mean_k3": {"order": "proximal"},
    "seq_max_k2": {"reduce": "mean"},
    "seq_max_k3": {"order": "proximal"},
}
"""One flipped convention per verl ``rollout_rs`` option (the control)."""


def _verl_weights(x: dict[str, Any]) -> dict[tuple[str, float | str], Any]:
    from refppo.core.rollout_correction import is_weights

    out = {}
    for level, thr in rc.VERL_WEIGHTS:
        mode, lo, hi = verl_threshold(thr)
        out[(level, thr)] = is_weights(
            x["prox"], x["beh"], x["mask"], level=level, mode=mode, low=lo, high=hi, log_ratio_clamp=20.0
        )
    return out


def _verl(x: dict[str, Any], got: dict[str, Any]) -> list[Case]:
    from refppo.core.rollout_correction import is_weights, rejection_mask

    m, cases, w = x["mask"].bool(), [], _verl_weights(x)
    for (level, thr), ref in w.items():
        mode, lo, hi = verl_threshold(thr)
        flip: dict[str, Any] = {"agg": "geometric"} if level == "sequence" else {}
        if level == "token":
            flip = {"mode": "truncate" if mode == "mask" else "mask", "low": lo or 1 / hi}
        kw = {"level": level, "mode": mode, "low": lo, "high": hi, "log_ratio_clamp": 20.0} | flip
        control = is_weights(x["prox"], x["beh"], x["mask"], **kw).weight
        key = rc.verl_weights_key(level, thr)
        cases.append(_tensor_case("verl", key, got[key + "/weight"], ref.weight, [(str(flip), control)], m))
    for opt, thr in rc.VERL_RS:
        kw = verl_rs(opt, thr) | {"order": "behaviour", "log_ratio_clamp": 20.0}
        ref, flip = rejection_mask(x["prox"], x["beh"], x["mask"], **kw), VERL_RS_CONTROL[opt]
        control = rejection_mask(x["prox"], x["beh"], x["mask"], **(kw | flip))
        key = rc.verl_rs_key(opt, thr)
        cases.append(_tensor_case("verl", key, got[key + "/keep"].bool(), ref, [(str(flip), control)], m))
    from peers.rollout_correction_ref2 import verl_losses

    return cases + verl_losses(x, got, w)


__all__ = ["TOL", "compare", "verl_rs", "verl_threshold"]
