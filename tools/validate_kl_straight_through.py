#!/usr/bin/env python3
"""Run verl's OWN straight-through KL estimators and compare value and gradient with refppo's.

Not part of CI (by hand; ``tests/peers/test_validate_kl_straight_through.py`` runs it when the peer
venv exists). Two halves, two interpreters, as ``tools/validate_group_estimators.py`` (import stubs
and ``mount`` from ``tools/peer_makers/common.py``, imported):

1. ``--peer-half IN OUT`` (the verl venv) loads the batch (``torch.load(weights_only=True)``), and for
   each verl name (``kl+``, ``k1+``, ``low_var_kl+``, ``k3+``, ``abs+``, and ``k2+``/``mse+``, which
   verl leaves as ``k2``) calls verl 0.9.1 ``verl/trainer/ppo/core_algos.py::kl_penalty`` on
   ``log π`` with ``requires_grad`` and saves the value and ``∂ Σ_t m_t·KL_t / ∂ log π`` (autograd).
2. Without it (refppo's interpreter) it writes the batch, runs half 1 and prints, per name, the max
   abs error over valid tokens of refppo's ``refppo.core.kl.token_kl`` (the estimator, with the
   clamps of ``--preset verl``: k3 clamps ``d`` to [−20, 20] and the value to [−10, 10]) against
   verl's value, and of its autograd gradient and of the closed-form twin
   ``refppo.core.grad.kl_loss_grad_naive`` (``token-sum``) against verl's gradient; exit 1 on a
   mismatch (> 1e-9, float64). Control: refppo's base estimator (no ``+``) must give a gradient
   that differs from verl's ``+`` one by more than 1e-3 (the batch has ``|d|`` up to 25, so k3's
   clamps bind, and d away from 0 and 1).

Batch: float64, B = 8, T = 12, right-padded, seed 0, ``log π``, ``log π_ref`` ∈ [−6, 0) plus rows
spread to ``d`` = ±25 (the clamps).

Exit 0 when every name matches, 1 on a mismatch or when the verl half crashes, 2 (one line) when
the interpreter does not exist: nothing ran, so it is never reported as a pass.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PEER = os.path.join(os.environ.get("REFPPO_PEERS_ROOT", "/work/peervenv"), "verl-openrlhf", "bin", "python")
B, T = 8, 12
# verl's name → refppo's kl_estimator
NAMES = {
    "kl+": "k1+",
    "k1+": "k1+",
    "low_var_kl+": "k3+",
    "k3+": "k3+",
    "abs+": "abs+",
    "k2+": "k2",
    "mse+": "k2",
}
TOL, CONTROL = 1e-9, 1e-3


def peer_half(inp: str, outp: str) -> int:
    import sysconfig

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peer_makers import common

    common.install_stubs()
    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
    common.mount("verl", sysconfig.get_paths()["purelib"])
    from verl.trainer.ppo import core_algos as ca  # type: ignore[import-not-found]  # peers venv only

    x = torch.load(inp, weights_only=True)
    out: dict[str, Any] = {}
    for name in NAMES:
        lp = x["logp"].clone().requires_grad_(True)
        kl = ca.kl_penalty(lp, x["logp_ref"], name)
        (kl * x["mask"]).sum().backward()
        out[f"{name}.value"], out[f"{name}.grad"] = kl.detach(), lp.grad
    torch.save(out, outp)
    from importlib.metadata import version

    print(f"verl {version('verl')}")
    return 0


def make_batch(seed: int = 0) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T).expand(B, T) < lengths.unsqueeze(1)
    logp = -6.0 * torch.rand(B, T, generator=g, dtype=f64)
    logp_ref = -6.0 * torch.rand(B, T, generator=g, dtype=f64)
    logp_ref[0, :4] = logp[0, :4] + torch.tensor([25.0, -25.0, 12.0, -12.0], dtype=f64)  # clamps bind
    return {"logp": logp, "logp_ref": logp_ref, "mask": mask.to(f64)}


def refppo_side(x: dict[str, Any], est: str) -> tuple[Any, Any, Any]:
    """refppo's ``(value, autograd gradient, closed-form twin gradient)`` under ``--preset verl``."""
    import torch

    sys.path.insert(0, str(REPO))
    from refppo.core.grad import kl_loss_grad_naive
    from refppo.core.kl import token_kl
    from refppo.oracle.presets.registry import resolve_preset

    conv, _ = resolve_preset("verl", estimator=est)
    kw = {"log_ratio_clamp": conv["kl_log_ratio_clamp"], "value_clamp": conv["kl_value_clamp"]}
    m = x["mask"].bool()
    lp = x["logp"].clone().requires_grad_(True)
    kl = token_kl(lp, x["logp_ref"], m, est, **kw)
    (grad,) = torch.autograd.grad(kl.sum(), lp)
    twin = kl_loss_grad_naive(x["logp"], x["logp_ref"], m, est, "token-sum", **kw)
    return kl.detach(), grad, twin


def validate(python: str) -> int:
    import torch

    if not Path(python).exists():  # nothing can run: a failure, never a pass (exit 2, one line)
        print(f"validate_kl_straight_through.py: --peers-python: no interpreter {python}", file=sys.stderr)
        return 2
    x = make_batch()
    m = x["mask"].bool()
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        inp, outp = os.path.join(tmp, "batch.pt"), os.path.join(tmp, "out.pt")
        torch.save(x, inp)
        proc = subprocess.run(
            [python, str(Path(__file__).resolve()), "--peer-half", inp, outp],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if proc.returncode != 0:
            print(f"FAILED {python}: {' | '.join(proc.stderr.strip().splitlines()[-3:])}")
            return 1
        print(proc.stdout.strip())
        got = torch.load(outp, weights_only=True)
    for name, est in NAMES.items():
        value, grad, twin = refppo_side(x, est)
        errs = [
            float((got[f"{name}.value"] - value).abs()[m].max()),
            float((got[f"{name}.grad"] - grad).abs()[m].max()),
            float((got[f"{name}.grad"] - twin).abs()[m].max()),
        ]
        ok = max(errs) <= TOL
        failures += not ok
        print(
            f"  {'OK ' if ok else 'BAD'} verl {name:<12} = refppo kl_estimator={est:<5} value {errs[0]:.1e}, "
            f"autograd grad {errs[1]:.1e}, closed-form grad {errs[2]:.1e}"
        )
        if est.endswith("+"):
            _, base_grad, _ = refppo_side(x, est.removesuffix("+"))
            gap = float((got[f"{name}.grad"] - base_grad).abs()[m].max())
            failures += not gap > CONTROL
            mark = "ok " if gap > CONTROL else "BAD"
            print(f"      {mark} control kl_estimator={est[:-1]}: grad err {gap:.2e}")
    print(f"{len(NAMES)} names, {failures} failure(s)")
    return 1 if failures else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--peer-half", nargs=2, metavar=("IN", "OUT"), help="(internal) run in the verl venv")
    ap.add_argument("--peers-python", default=PEER, help=f"the verl interpreter (default {PEER})")
    args = ap.parse_args()
    if args.peer_half:
        return peer_half(*args.peer_half)
    return validate(args.peers_python)


if __name__ == "__main__":
    sys.exit(main())
