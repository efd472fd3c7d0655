#!/usr/bin/env python3
"""Run verl's and SkyRL-train's OWN GSPO policy losses on one batch and compare refppo's ``policy_loss=gspo``.

Not part of CI (by hand; ``tests/peers/test_validate_gspo.py`` runs it when the peer venv exists).
Two halves, two interpreters, as ``tools/validate_group_estimators.py``; the import stubs are those
of ``tools/peer_makers/common.py`` (imported, not copied):

1. ``--peer-half IN OUT`` (a peers venv, ``/work/shared/peers/README.md``) loads the batch
   (``torch.load(weights_only=True)``), calls verl 0.9.1
   ``verl/trainer/ppo/core_algos.py::compute_policy_loss_gspo`` (through
   ``get_policy_loss_fn("gspo")``, with a real ``verl.workers.config.ActorConfig``) and/or
   SkyRL-train 0.3.1 ``skyrl_train/utils/ppo_utils.py::gspo_policy_loss`` (``loss_reduction``
   token_mean, sequence_mean, seq_mean_token_sum_norm with ``max_seq_len`` = T) for every case,
   back-propagates, and saves the loss, the clip fraction, verl's ``ppo_kl`` and ``∂loss/∂log_prob``.
2. Without it (refppo's interpreter) it writes the batch, runs half 1 and compares each case with
   ``refppo.core.gspo.gspo_policy_loss`` (``log_ratio_max = 10``, verl's hard-coded clamp): loss,
   clip fraction, approx KL and the autograd gradient, plus the closed-form twin
   ``gspo_policy_grad_naive`` against verl's gradient. One line per case with the max abs errors;
   exit 1 when one exceeds ``1e-7·max(1, |value|)`` (float64 inputs; verl's ``+ 1e-8`` in its
   denominators is the only difference, ~1e-8 relative), or when the contrast — refppo's
   token-ratio ``vanilla`` loss on the same case — does NOT differ from verl's GSPO gradient.

Batch (float64, B = 8, T = 10, seed 0): lengths 10, 7, 4, 1, 10, 5, 3, 8; per-row offsets of the
log-ratio (± 0.02 per token) put the sequence ratios below, inside and above the clip range, one
between 1.2 and 1.28 (clipped only by the symmetric range), one row's ``S_b`` at 11 > κ = 10;
finite junk 7.5 on the padding (verl multiplies by the mask, NaN would poison its sums). Cases:
the five ``loss_agg`` modes × advantages constant along each row (outcome) or per token × the clip
range symmetric 0.2 or asymmetric (0.2, 0.28): 20 comparisons with verl; SkyRL's three reductions ×
the same: 12.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
B, T, JUNK, KAPPA = 8, 10, 7.5, 10.0
TOL = 1e-7
"""Relative tolerance: verl divides by ``L_b + 1e-8`` (``seq-mean-token-mean``) and ``N + 1e-8``
(``masked_mean`` of its metrics) where refppo divides by ``L_b`` and ``N``: ~1e-8 relative."""
LENGTHS = (10, 7, 4, 1, 10, 5, 3, 8)
OFFSETS = (-0.5, -0.1, 0.1, 0.5, 0.0, 11.0, 0.22, -0.25)
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")
CLIPS = ((0.2, 0.2), (0.2, 0.28))
ADVS = ("outcome", "token")
PEER_ENVS = ("/work/peervenv/verl-openrlhf/bin/python", "/work/peervenv/skyrl-areal/bin/python")
SKYRL_REDUCTION = {
    "token-mean": "token_mean",
    "seq-mean-token-mean": "sequence_mean",
    "seq-mean-token-sum-norm": "seq_mean_token_sum_norm",
}
"""refppo ``loss_agg`` -> SkyRL-train ``loss_reduction`` (``max_seq_len`` = T for the last)."""


def cases(peer: str) -> list[tuple[str, str, tuple[float, float]]]:
    """``(agg, advantage kind, (ε_low, ε_high))`` of every comparison with ``peer``."""
    aggs = AGGS if peer == "verl" else tuple(SKYRL_REDUCTION)
    return [(agg, adv, clip) for agg in aggs for adv in ADVS for clip in CLIPS]


def case_key(peer: str, agg: str, adv: str, clip: tuple[float, float]) -> str:
    return f"{peer}/{agg}/{adv}/{clip[0]}-{clip[1]}"


# ------------------------------------------------------------------------------------------------
# Half 1: runs in the verl venv (no refppo import).
# ------------------------------------------------------------------------------------------------


def _verl(x: dict[str, Any], site: str, out: dict[str, Any]) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peer_makers import common as pm

    pm.mount("verl", site)
    from verl.trainer.ppo import core_algos as ca  # type: ignore[import-not-found]  # peers venv only
    from verl.workers.config import ActorConfig  # type: ignore[import-not-found]  # peers venv only

    fn = ca.get_policy_loss_fn("gspo")
    for agg, adv, (lo, hi) in cases("verl"):
        cfg = ActorConfig(
            strategy="fsdp", clip_ratio=lo, clip_ratio_low=lo, clip_ratio_high=hi,
            ppo_micro_batch_size_per_gpu=1, rollout_n=1,
        )  # fmt: skip
        lp = x["log_prob"].clone().requires_grad_(True)
        loss, metrics = fn(x["old_log_prob"], lp, x[f"adv_{adv}"], x["mask"], loss_agg_mode=agg, config=cfg)
        loss.backward()
        key = case_key("verl", agg, adv, (lo, hi))
        out[key + "/loss"] = loss.detach()
        out[key + "/grad"] = lp.grad
        out[key + "/clipfrac"] = torch.tensor(metrics["actor/pg_clipfrac"], dtype=torch.float64)
        out[key + "/ppo_kl"] = torch.tensor(metrics["actor/ppo_kl"], dtype=torch.float64)


def _skyrl(x: dict[str, Any], site: str, out: dict[str, Any]) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peer_makers import common as pm

    pm.mount("skyrl_train", site)
    pm.mount("skyrl_train.utils", site)
    from skyrl_train.utils import ppo_utils as pu  # type: ignore[import-not-found]  # peers venv only

    for agg, adv, (lo, hi) in cases("skyrl"):
        cfg = types.SimpleNamespace(
            loss_reduction=SKYRL_REDUCTION[agg], eps_clip_low=lo, eps_clip_high=hi, max_seq_len=T
        )
        lp = x["log_prob"].clone().requires_grad_(True)
        loss, clip_ratio = pu.gspo_policy_loss(
            lp, x["old_log_prob"], x[f"adv_{adv}"], cfg, loss_mask=x["mask"]
        )
        loss.backward()
        key = case_key("skyrl", agg, adv, (lo, hi))
        out[key + "/loss"] = loss.detach()
        out[key + "/grad"] = lp.grad
        out[key + "/clipfrac"] = torch.tensor(clip_ratio, dtype=torch.float64)


def peer_half(inp: str, outp: str) -> int:
    import sysconfig
    from importlib.metadata import PackageNotFoundError, version

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peer_makers import common as pm

    pm.install_stubs()
    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
    site = sysconfig.get_paths()["purelib"]
    x = torch.load(inp, weights_only=True)
    out: dict[str, Any] = {}
    status: dict[str, str] = {}
    for name, dist, fn in (("verl", "verl", _verl), ("skyrl", "skyrl-train", _skyrl)):
        try:
            ver = version(dist)
        except PackageNotFoundError:
            continue
        try:
            fn(x, site, out)
            status[name] = f"{dist} {ver}"
        except Exception as exc:  # report and go on: one peer failing is not fatal to the other
            status[name] = f"{dist} {ver}: FAILED {type(exc).__name__}: {str(exc)[:300]}"
    torch.save(out, outp)
    Path(outp + ".json").write_text(json.dumps(status))
    return 0


# ------------------------------------------------------------------------------------------------
# Half 2: refppo's side.
# ------------------------------------------------------------------------------------------------


def make_batch(seed: int = 0) -> dict[str, Any]:
    """The batch of the module docstring (plain tensors only)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    mask = torch.arange(T).expand(B, T) < torch.tensor(LENGTHS).unsqueeze(1)
    old = torch.rand(B, T, generator=g, dtype=f64) * -3.5 - 0.5
    d = (
        torch.tensor(OFFSETS, dtype=f64).unsqueeze(1)
        + (torch.rand(B, T, generator=g, dtype=f64) - 0.5) * 0.04
    )
    adv_row = torch.randn(B, 1, generator=g, dtype=f64).expand(B, T)
    adv_tok = torch.randn(B, T, generator=g, dtype=f64)
    junk = torch.tensor(JUNK, dtype=f64)
    return {
        "mask": mask.to(f64),
        "old_log_prob": torch.where(mask, old, junk),
        "log_prob": torch.where(mask, old + d, junk),
        "adv_outcome": torch.where(mask, adv_row, junk),
        "adv_token": torch.where(mask, adv_tok, junk),
    }


def refppo_case(x: dict[str, Any], agg: str, adv: str, clip: tuple[float, float]) -> dict[str, Any]:
    """refppo's loss, clip fraction, approx KL, autograd gradient, twin gradient and the contrast."""
    import torch

    sys.path.insert(0, str(REPO))
    from refppo.core.gspo import gspo_policy_grad_naive, gspo_policy_loss
    from refppo.core.policy import clipped_policy_loss

    m, a = x["mask"].bool(), x[f"adv_{adv}"]
    old, lo, hi = x["old_log_prob"], clip[0], clip[1]
    lp = x["log_prob"].clone().requires_grad_(True)
    out = gspo_policy_loss(lp, old, a, m, clip_low=lo, clip_high=hi, agg=agg, log_ratio_max=KAPPA)
    torch.autograd.backward(out.loss)
    twin = gspo_policy_grad_naive(
        x["log_prob"], old, a, m, clip_low=lo, clip_high=hi, agg=agg, log_ratio_max=KAPPA
    )
    van = x["log_prob"].clone().requires_grad_(True)  # verl "vanilla": κ = 20, dual-clip c = 3
    vanilla = clipped_policy_loss(
        van, old, a, m, clip_low=lo, clip_high=hi, agg=agg, dual_clip=3.0, log_ratio_clamp=20.0
    )
    torch.autograd.backward(vanilla.loss)
    return {
        "loss": out.loss.detach(),
        "clipfrac": out.clipfrac,
        "ppo_kl": out.approx_kl,
        "grad": lp.grad,
        "twin": twin,
        "vanilla_grad": van.grad,
    }


def _err(a: Any, b: Any, m: Any = None) -> tuple[float, float]:
    """(max abs error, its tolerance ``TOL·max(1, max|b|)``) over ``m`` if given."""
    import torch

    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    if m is not None:
        a, b = a[m], b[m]
    return float((a - b).abs().max()), TOL * max(1.0, float(b.abs().max()))


def _run_peer(python: str, x: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]] | None:
    """Half 1 in ``python``: (results, status) or None (printed why)."""
    import torch

    if not Path(python).exists():
        print(f"SKIPPED: no interpreter {python}")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        inp, outp = os.path.join(tmp, "batch.pt"), os.path.join(tmp, "out.pt")
        torch.save(x, inp)
        proc = subprocess.run(
            [python, str(Path(__file__).resolve()), "--peer-half", inp, outp],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if proc.returncode != 0:
            print(f"FAILED {python}: {' | '.join(proc.stderr.strip().splitlines()[-3:])}")
            return None
        status: dict[str, str] = json.loads(Path(outp + ".json").read_text())
        print(f"{python}: {status}")
        return torch.load(outp, weights_only=True), status


def _compare(peer: str, x: dict[str, Any], got: dict[str, Any], worst: dict[str, float]) -> tuple[int, int]:
    """(comparisons, failures) of one peer's results."""
    m = x["mask"].bool()
    failures = compared = 0
    for agg, adv, clip in cases(peer):
        key = case_key(peer, agg, adv, clip)
        ref = refppo_case(x, agg, adv, clip)
        peer_grad = got[key + "/grad"]
        pad_ok = bool((peer_grad[~m] == 0).all()) and bool((ref["grad"][~m] == 0).all())
        errs = {
            "loss": _err(ref["loss"], got[key + "/loss"]),
            "clipfrac": _err(ref["clipfrac"], got[key + "/clipfrac"]),
            "grad": _err(ref["grad"], peer_grad, m),
            "twin": _err(ref["twin"], peer_grad, m),
        }
        if key + "/ppo_kl" in got:
            errs["ppo_kl"] = _err(ref["ppo_kl"], got[key + "/ppo_kl"])
        gap = _err(ref["vanilla_grad"], peer_grad, m)
        ok = pad_ok and all(e <= tol for e, tol in errs.values()) and gap[0] > gap[1]
        failures += not ok
        compared += 1
        for name, (e, _) in errs.items():
            worst[name] = max(worst.get(name, 0.0), e)
        detail = "  ".join(f"{n} {e:.1e}" for n, (e, _) in errs.items())
        print(f"  {'OK ' if ok else 'BAD'} {key:<48} {detail}  vanilla differs by {gap[0]:.1e}")
    return compared, failures


def validate(pythons: list[str]) -> int:
    x = make_batch()
    failures = compared = 0
    worst: dict[str, float] = {}
    for python in pythons:
        res = _run_peer(python, x)
        if res is None:
            failures += 1
            continue
        got, status = res
        for peer, line in status.items():
            if "FAILED" in line:
                failures += 1
                continue
            c, f = _compare(peer, x, got, worst)
            compared, failures = compared + c, failures + f
    print("max abs errors: " + ", ".join(f"{n} {e:.2e}" for n, e in worst.items()))
    print(f"{compared} comparisons, {failures} failure(s)")
    return 1 if failures or not compared else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--peer-half", nargs=2, metavar=("IN", "OUT"), help="(internal) run in the verl venv")
    ap.add_argument(
        "--peers-python", action="append", help=f"a peers venv's python (repeatable; default {PEER_ENVS})"
    )
    args = ap.parse_args()
    if args.peer_half:
        return peer_half(*args.peer_half)
    return validate(args.peers_python or list(PEER_ENVS))


if __name__ == "__main__":
    sys.exit(main())
