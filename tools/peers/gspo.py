"""verl's and SkyRL-train's OWN GSPO policy losses on one batch vs refppo's ``policy_loss=gspo``.

``tools/peers gspo`` (``tests/peers/test_validate_gspo.py`` runs it when the side venvs exist). A
``batch`` request of :mod:`peers.harness`:

1. The peer's half (``verl-openrlhf`` and ``skyrl-areal`` venvs; import stand-ins of
   :mod:`peers.stubs`) gets the batch, calls verl 0.9.1
   ``verl/trainer/ppo/core_algos.py::compute_policy_loss_gspo`` (through
   ``get_policy_loss_fn("gspo")``, with a real ``verl.workers.config.ActorConfig``) and/or
   SkyRL-train 0.3.1 ``skyrl_train/utils/ppo_utils.py::gspo_policy_loss`` (``loss_reduction``
   token_mean, sequence_mean, seq_mean_token_sum_norm with ``max_seq_len`` = T) for every case,
   back-propagates, and returns the loss, the clip fraction, verl's ``ppo_kl`` and ``∂loss/∂log_prob``.
2. refppo's half compares each case with
   ``refppo.core.gspo.gspo_policy_loss`` (``log_ratio_max = 10``, verl's hard-coded clamp): loss,
   clip fraction, approx KL and the autograd gradient, plus the closed-form twin
   ``gspo_policy_grad_naive`` against verl's gradient. One line per case with the max abs errors;
   a case fails when one exceeds ``1e-7·max(1, |value|)`` (float64 inputs; verl's ``+ 1e-8`` in its
   denominators is the only difference, ~1e-8 relative) or a gradient reaches a padded
   position; its control — refppo's token-ratio ``vanilla`` loss on the same case — must differ
   from the peer's GSPO gradient.

Batch (float64, B = 8, T = 10, seed 0): lengths 10, 7, 4, 1, 10, 5, 3, 8; per-row offsets of the
log-ratio (± 0.02 per token) put the sequence ratios below, inside and above the clip range, one
between 1.2 and 1.28 (clipped only by the symmetric range), one row's ``S_b`` at 11 > κ = 10;
finite junk 7.5 on the padding (verl multiplies by the mask, NaN would poison its sums). Cases:
the five ``loss_agg`` modes × advantages constant along each row (outcome) or per token × the clip
range symmetric 0.2 or asymmetric (0.2, 0.28): 20 comparisons with verl; SkyRL's three reductions ×
the same: 12.
"""

from __future__ import annotations

import os
import types
from typing import Any

from peers.checks import err
from peers.harness import Case, Control, Report, Unit, parser, root_of, run_venvs, selected, workdir

B, T, JUNK, KAPPA = 8, 10, 7.5, 10.0
TOL = 1e-7
"""Relative tolerance: verl divides by ``L_b + 1e-8`` (``seq-mean-token-mean``) and ``N + 1e-8``
(``masked_mean`` of its metrics) where refppo divides by ``L_b`` and ``N``: ~1e-8 relative."""
LENGTHS = (10, 7, 4, 1, 10, 5, 3, 8)
OFFSETS = (-0.5, -0.1, 0.1, 0.5, 0.0, 11.0, 0.22, -0.25)
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")
CLIPS = ((0.2, 0.2), (0.2, 0.28))
ADVS = ("outcome", "token")
SKYRL_REDUCTION = {
    "token-mean": "token_mean",
    "seq-mean-token-mean": "sequence_mean",
    "seq-mean-token-sum-norm": "seq_mean_token_sum_norm",
}
"""refppo ``loss_agg`` -> SkyRL-train ``loss_reduction`` (``max_seq_len`` = T for the last)."""
VENVS: dict[str, dict[str, Unit]] = {
    "verl-openrlhf": {"verl": Unit("verl", "peers.gspo:peer_verl")},
    "skyrl-areal": {"skyrl": Unit("skyrl-train", "peers.gspo:peer_skyrl")},
}
"""Side venv → unit → (distribution, peer-side function)."""


def cases(peer: str) -> list[tuple[str, str, tuple[float, float]]]:
    """``(agg, advantage kind, (ε_low, ε_high))`` of every comparison with ``peer``."""
    aggs = AGGS if peer == "verl" else tuple(SKYRL_REDUCTION)
    return [(agg, adv, clip) for agg in aggs for adv in ADVS for clip in CLIPS]


def case_key(peer: str, agg: str, adv: str, clip: tuple[float, float]) -> str:
    return f"{peer}/{agg}/{adv}/{clip[0]}-{clip[1]}"


# ------------------------------------------------------------------------------------------------
# The peer's half (side venvs; no refppo import).
# ------------------------------------------------------------------------------------------------


def peer_setup() -> None:
    from peers.stubs import install_stubs

    install_stubs()
    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")


def peer_verl(x: dict[str, Any]) -> dict[str, Any]:
    import torch

    from peers.stubs import mount

    mount("verl")
    from verl.trainer.ppo import core_algos as ca  # type: ignore[import-not-found]  # peers venv only
    from verl.workers.config import ActorConfig  # type: ignore[import-not-found]  # peers venv only

    fn = ca.get_policy_loss_fn("gspo")
    out: dict[str, Any] = {}
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
    return out


def peer_skyrl(x: dict[str, Any]) -> dict[str, Any]:
    import torch

    from peers.stubs import mount

    mount("skyrl_train")
    mount("skyrl_train.utils")
    from skyrl_train.utils import ppo_utils as pu  # type: ignore[import-not-found]  # peers venv only

    out: dict[str, Any] = {}
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
    return out


# ------------------------------------------------------------------------------------------------
# refppo's half.
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


def compare(peer: str, x: dict[str, Any], got: dict[str, Any]) -> list[Case]:
    """One case per ``(agg, advantage, clip)`` of ``peer``'s results."""
    m = x["mask"].bool()
    out = []
    for agg, adv, clip in cases(peer):
        key = case_key(peer, agg, adv, clip)
        ref = refppo_case(x, agg, adv, clip)
        peer_grad = got[key + "/grad"]
        pad_ok = bool((peer_grad[~m] == 0).all()) and bool((ref["grad"][~m] == 0).all())
        errs = {
            "loss": err(ref["loss"], got[key + "/loss"], rtol=TOL),
            "clipfrac": err(ref["clipfrac"], got[key + "/clipfrac"], rtol=TOL),
            "grad": err(ref["grad"], peer_grad, m, rtol=TOL),
            "twin": err(ref["twin"], peer_grad, m, rtol=TOL),
        }
        if key + "/ppo_kl" in got:
            errs["ppo_kl"] = err(ref["ppo_kl"], got[key + "/ppo_kl"], rtol=TOL)
        gap, gap_tol = err(ref["vanilla_grad"], peer_grad, m, rtol=TOL)
        ok = pad_ok and all(e <= tol for e, tol in errs.values())
        control = Control("policy_loss=vanilla", gap > gap_tol, f"gradient differs by {gap:.1e}")
        errors = {name: e for name, (e, _) in errs.items()}
        out.append(Case(peer, key, ok, errors, [control], {"pad_zero": pad_ok}))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser("gspo", __doc__, list(VENVS)).parse_args(argv)
    report = Report("gspo")
    x = make_batch()
    with workdir(args.keep) as work:
        runs = run_venvs(
            report, selected(args, VENVS), root_of(args), work, batch=x, setup="peers.gspo:peer_setup"
        )
        for unit, out, _ in runs:
            import torch

            got = torch.load(out / f"result-{unit}.pt", weights_only=True)
            for case in compare(unit, x, got):
                report.add(case)
    return report.finish(args.json_out)
