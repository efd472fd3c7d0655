"""OpenRLHF's OWN importance-weighted KL-loss gradient vs refppo's ``kl_grad_is_clip``: value and gradient.

``tools/peers kl_unbiased`` (``tests/peers/test_validate_kl_unbiased.py`` runs it when the
``verl-openrlhf`` side venv exists). A ``batch`` request of :mod:`peers.harness`:

1. The peer's half calls OpenRLHF 0.11.2 ``openrlhf/models/utils.py::compute_approx_kl`` with
   ``unbiased_gradient=True`` and ``log_probs_old`` (as ``trainer/ray/ppo_actor.py::training_step``
   passes the old log-probs when ``algo.kl.use_loss``) for k1, k2, k3 on ``log π`` with
   ``requires_grad``, and returns the value and ``∂ Σ_t m_t·KL_t / ∂ log π`` (autograd).
2. refppo's half: ``refppo.core.kl.token_kl`` with ``--preset openrlhf``'s clamps (value ±10; k3:
   ``d ≥ −10``), the straight-through estimator (``k1+``, ``k2``, ``k3+``: value of OpenRLHF's
   estimator, gradient ``d``) and ``grad_is_clip=10`` (OpenRLHF ``KL_IS_WEIGHT_CLIP``); the max abs
   error of its value, its autograd gradient and the closed-form twin
   ``refppo.core.grad.kl_loss_grad_naive`` (``token-sum``) against the peer's; a case fails above
   1e-5 (float32, the dtype OpenRLHF computes in: :data:`TOL`). ``k2`` is compared on the tokens
   where ``½ d² ≤ 10`` only (beyond, refppo's ``k2`` is clamped in value *and* gradient; OpenRLHF's
   gradient stays ``w·d``: no refppo name).
   Control of each: the same estimator without the weight must differ by more than 1e-3.

Batch: float32, B = 8, T = 12, right-padded, seed 0; ``log π − log π_old`` ∈ [−1.5, 3] (so the
weight ``exp(·)`` is clipped at 10 on some tokens), ``d = log π − log π_ref`` spread to ±25 on row 0.
"""

from __future__ import annotations

from typing import Any

from peers.checks import err
from peers.harness import Case, Control, Report, Unit, parser, root_of, run_venvs, selected, workdir

B, T = 8, 12
NAMES = {"k1": "k1+", "k2": "k2", "k3": "k3+"}
"""OpenRLHF's ``kl_estimator`` → refppo's (the straight-through form of its value)."""
CLIP = 10.0
"""OpenRLHF 0.11.2 ``models/utils.py::KL_IS_WEIGHT_CLIP``."""
TOL, CONTROL = 1e-5, 1e-3
"""float32: OpenRLHF returns ``value + s − sg(s)`` with ``s = w·½d²`` up to ~3e3, which rounds the value at
``s``'s magnitude (refppo's ``sg(KL) + w·(KL − sg(KL))`` keeps it exact); the gradients agree bit for bit."""
VENVS: dict[str, dict[str, Unit]] = {
    "verl-openrlhf": {"openrlhf": Unit("openrlhf", "peers.kl_unbiased:peer_openrlhf")},
}


def peer_openrlhf(x: dict[str, Any]) -> dict[str, Any]:
    """The peer's half (the OpenRLHF venv; no refppo import)."""
    from peers.makers.openrlhf_step import openrlhf_fns

    approx_kl = openrlhf_fns()["compute_approx_kl"]
    out: dict[str, Any] = {}
    for name in NAMES:
        lp = x["logp"].clone().requires_grad_(True)
        kl = approx_kl(
            lp, x["logp_ref"], log_probs_old=x["logp_old"], kl_estimator=name, unbiased_gradient=True
        )
        (kl * x["mask"]).sum().backward()
        out[f"{name}.value"], out[f"{name}.grad"] = kl.detach(), lp.grad
    return out


def make_batch(seed: int = 0) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    f64 = torch.float32  # OpenRLHF computes the KL and its weight in float32 (``.float()``)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T).expand(B, T) < lengths.unsqueeze(1)
    logp = -6.0 * torch.rand(B, T, generator=g, dtype=f64)
    logp_ref = logp + 6.0 * (torch.rand(B, T, generator=g, dtype=f64) - 0.5)
    logp_ref[0, :4] = logp[0, :4] + torch.tensor([25.0, -25.0, 12.0, -12.0], dtype=f64)  # clamps bind
    logp_old = logp - (4.5 * torch.rand(B, T, generator=g, dtype=f64) - 1.5)  # w up to e³ > 10
    return {"logp": logp, "logp_ref": logp_ref, "logp_old": logp_old, "mask": mask.to(f64)}


def refppo_side(x: dict[str, Any], est: str, clip: float | None) -> tuple[Any, Any, Any]:
    """refppo's ``(value, autograd gradient, closed-form twin gradient)`` under ``--preset openrlhf``."""
    import torch

    from refppo.core.grad import kl_loss_grad_naive
    from refppo.core.kl import token_kl
    from refppo.oracle.presets.registry import resolve_preset

    conv, _ = resolve_preset("openrlhf", estimator=est.removesuffix("+"))
    kw: dict[str, Any] = {
        "log_ratio_clamp": conv["kl_log_ratio_clamp"],
        "value_clamp": conv["kl_value_clamp"],
    }
    kw.update(logp_old=x["logp_old"], grad_is_clip=clip)
    m = x["mask"].bool()
    lp = x["logp"].clone().requires_grad_(True)
    kl = token_kl(lp, x["logp_ref"], m, est, **kw)
    (grad,) = torch.autograd.grad(kl.sum(), lp)
    twin = kl_loss_grad_naive(x["logp"], x["logp_ref"], m, est, "token-sum", **kw)
    return kl.detach(), grad, twin


def compare(x: dict[str, Any], got: dict[str, Any]) -> list[Case]:
    m = x["mask"].bool()
    d = x["logp"] - x["logp_ref"]
    out = []
    for name, est in NAMES.items():
        mg = m & (0.5 * d * d <= 10.0) if est == "k2" else m  # k2: where its value clamp is not hit
        value, grad, twin = refppo_side(x, est, CLIP)
        errors = {
            "value": err(got[f"{name}.value"], value, m)[0],
            "grad": err(got[f"{name}.grad"], grad, mg)[0],
            "twin": err(got[f"{name}.grad"], twin, mg)[0],
        }
        _, plain, _ = refppo_side(x, est, None)
        gap = err(got[f"{name}.grad"], plain, mg)[0]
        controls = [Control("kl_grad_is_clip=none", gap > CONTROL, f"grad err {gap:.2e}")]
        ok = max(errors.values()) <= TOL
        out.append(
            Case("openrlhf", name, ok, errors, controls, {"kl_estimator": est, "kl_grad_is_clip": CLIP})
        )
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser("kl_unbiased", __doc__, list(VENVS)).parse_args(argv)
    report = Report("kl_unbiased")
    x = make_batch()
    with workdir(args.keep) as work:
        for unit, out, _ in run_venvs(report, selected(args, VENVS), root_of(args), work, batch=x):
            import torch

            got = torch.load(out / f"result-{unit}.pt", weights_only=True)
            for case in compare(x, got):
                report.add(case)
    return report.finish(args.json_out)
