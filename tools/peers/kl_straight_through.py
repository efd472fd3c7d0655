"""verl's OWN straight-through KL estimators vs refppo's: value and gradient.

``tools/peers kl_straight_through`` (``tests/peers/test_validate_kl_straight_through.py`` runs it
when the verl side venv exists). A ``batch`` request of :mod:`peers.harness`:

1. The peer's half (``verl-openrlhf`` venv) calls, for each verl name (``kl+``, ``k1+``,
   ``low_var_kl+``, ``k3+``, ``abs+``, and ``k2+``/``mse+``, which verl leaves as ``k2``), verl 0.9.1
   ``verl/trainer/ppo/core_algos.py::kl_penalty`` on ``log π`` with ``requires_grad`` and returns
   the value and ``∂ Σ_t m_t·KL_t / ∂ log π`` (autograd).
2. refppo's half: one case per name, the max abs error over valid tokens of refppo's
   ``refppo.core.kl.token_kl`` (the estimator, with the clamps of ``--preset verl``: k3 clamps ``d``
   to [−20, 20] and the value to [−10, 10]) against verl's value, and of its autograd gradient and
   of the closed-form twin ``refppo.core.grad.kl_loss_grad_naive`` (``token-sum``) against verl's
   gradient; a case fails above 1e-9 (float64). Control of each ``+`` name: refppo's base estimator
   (no ``+``) must give a gradient that differs from verl's by more than 1e-3 (the batch has ``|d|``
   up to 25, so k3's clamps bind, and d away from 0 and 1).

Batch: float64, B = 8, T = 12, right-padded, seed 0, ``log π``, ``log π_ref`` ∈ [−6, 0) plus rows
spread to ``d`` = ±25 (the clamps).
"""

from __future__ import annotations

import os
from typing import Any

from peers.checks import err
from peers.harness import Case, Control, Report, Unit, parser, root_of, run_venvs, selected, workdir

B, T = 8, 12
NAMES = {
    "kl+": "k1+",
    "k1+": "k1+",
    "low_var_kl+": "k3+",
    "k3+": "k3+",
    "abs+": "abs+",
    "k2+": "k2",
    "mse+": "k2",
}
"""verl's name → refppo's ``kl_estimator``."""
TOL, CONTROL = 1e-9, 1e-3
VENVS: dict[str, dict[str, Unit]] = {
    "verl-openrlhf": {"verl": Unit("verl", "peers.kl_straight_through:peer_verl")},
}


def peer_verl(x: dict[str, Any]) -> dict[str, Any]:
    """The peer's half (the verl venv; no refppo import)."""
    from peers.stubs import install_stubs, mount

    install_stubs()
    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
    mount("verl")
    from verl.trainer.ppo import core_algos as ca  # type: ignore[import-not-found]  # peers venv only

    out: dict[str, Any] = {}
    for name in NAMES:
        lp = x["logp"].clone().requires_grad_(True)
        kl = ca.kl_penalty(lp, x["logp_ref"], name)
        (kl * x["mask"]).sum().backward()
        out[f"{name}.value"], out[f"{name}.grad"] = kl.detach(), lp.grad
    return out


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


def compare(x: dict[str, Any], got: dict[str, Any]) -> list[Case]:
    m = x["mask"].bool()
    out = []
    for name, est in NAMES.items():
        value, grad, twin = refppo_side(x, est)
        errors = {
            "value": err(got[f"{name}.value"], value, m)[0],
            "grad": err(got[f"{name}.grad"], grad, m)[0],
            "twin": err(got[f"{name}.grad"], twin, m)[0],
        }
        controls = []
        if est.endswith("+"):
            _, base_grad, _ = refppo_side(x, est.removesuffix("+"))
            gap = err(got[f"{name}.grad"], base_grad, m)[0]
            controls.append(Control(f"kl_estimator={est[:-1]}", gap > CONTROL, f"grad err {gap:.2e}"))
        ok = max(errors.values()) <= TOL
        out.append(Case("verl", name, ok, errors, controls, {"kl_estimator": est}))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser("kl_straight_through", __doc__, list(VENVS)).parse_args(argv)
    report = Report("kl_straight_through")
    x = make_batch()
    with workdir(args.keep) as work:
        for unit, out, _ in run_venvs(report, selected(args, VENVS), root_of(args), work, batch=x):
            import torch

            got = torch.load(out / f"result-{unit}.pt", weights_only=True)
            for case in compare(x, got):
                report.add(case)
    return report.finish(args.json_out)
