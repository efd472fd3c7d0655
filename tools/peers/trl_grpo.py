"""TRL's OWN ``GRPOTrainer._compute_loss`` on one batch vs refppo's pipeline.

``tools/peers trl_grpo`` (``tests/peers/test_validate_trl_grpo.py`` runs it when the TRL venvs
exist). A ``batch`` request of :mod:`peers.harness`, in the ``trl`` (TRL 1.12.0) and ``trl-grpo``
(TRL 1.16.0) side venvs:

1. The peer's half calls ``trl/trainer/grpo_trainer.py::GRPOTrainer._compute_loss`` unbound on a
   stand-in ``self`` whose ``_get_per_token_logps_and_entropies`` returns the batch's current
   log-probs (a leaf tensor), one process, no gradient accumulation, no vLLM; it back-propagates and
   returns the loss and ``∂loss/∂logps``. Only ``requests``/``urllib3`` are stubbed (imported by
   TRL's vLLM client, not called).
2. refppo's half runs ``refppo.pipeline.step.update_quantities`` with the mapping of
   spec/conventions.md ("Policy-loss modes and GRPO loss types") and compares the loss (the
   pipeline's, with ``vf_coef = 0``) and the autograd gradient, plus the closed-form twin
   ``refppo.pipeline.grad_naive.objective_grads_naive``; a case fails when one differs by more than
   ``1e-9·max(1, |value|)`` (float64); its controls (the mapping with one key flipped) must differ.

Cases (24): ``loss_type`` grpo, bnpo, dr_grpo, dapo × ``importance_sampling_level`` token (with
``delta`` None or 2.0) or sequence (``delta`` None) × ``beta`` 0 or 0.04 (k3 KL in the loss). For
``dapo``, ``num_items_in_batch`` is the batch's tokens + 10 (a larger accumulated batch): refppo's
``Normalisers(token_count = N + 10)``. ε_low = 0.2, ε_high = 0.28, ``max_completion_length`` = T.
Batch: float64, B = 8, T = 10, lengths 10, 7, 4, 1, 10, 5, 3, 8; token log-ratios spread ±1.2 plus
per-row offsets (every clip region, ratios above δ); finite junk 7.5 on the padding (TRL multiplies
by the mask).
"""

from __future__ import annotations

import collections
import sys
import types
from typing import Any

from peers.checks import err
from peers.harness import Case, Control, Report, Unit, parser, root_of, run_venvs, selected, workdir

B, T, JUNK, EXTRA_TOKENS, TOL = 8, 10, 7.5, 10, 1e-9
LENGTHS = (10, 7, 4, 1, 10, 5, 3, 8)
OFFSETS = (-0.5, -0.1, 0.1, 0.5, 0.0, 0.3, 0.22, -0.25)
EPS_LO, EPS_HI = 0.2, 0.28
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
VENVS: dict[str, dict[str, Unit]] = {
    "trl": {"trl": Unit("trl", "peers.trl_grpo:peer_trl")},
    "trl-grpo": {"trl-grpo": Unit("trl", "peers.trl_grpo:peer_trl")},
}
"""Side venv → unit (named after the venv) → (distribution, peer-side function): TRL 1.12.0 and
TRL 1.16.0."""
AGG = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "dapo": "token-mean",
}
CONTRAST_AGG = {"grpo": "token-mean", "bnpo": "seq-mean-token-mean", "dr_grpo": "seq-mean-token-sum"}


def cases() -> list[tuple[str, str, float | None, float]]:
    """``(loss_type, importance_sampling_level, delta, beta)`` of every comparison."""
    out: list[tuple[str, str, float | None, float]] = []
    for lt in LOSS_TYPES:
        for level, delta in (("token", None), ("token", 2.0), ("sequence", None)):
            for beta in (0.0, 0.04):
                out.append((lt, level, delta, beta))
    return out


def case_key(lt: str, level: str, delta: float | None, beta: float) -> str:
    return f"{lt}/{level}/delta={delta}/beta={beta}"


# ------------------------------------------------------------------------------------------------
# The peer's half (a TRL venv; no refppo import).
# ------------------------------------------------------------------------------------------------


class _Accelerator:
    """One process: gather/reduce are the identity."""

    num_processes = 1

    def gather(self, x: Any) -> Any:
        return x

    def gather_for_metrics(self, x: Any) -> Any:
        return x

    def reduce(self, x: Any, reduction: str = "sum") -> Any:
        return x


def peer_trl(x: dict[str, Any]) -> dict[str, Any]:
    import torch

    from peers.stubs import StubFinder

    sys.meta_path.insert(0, StubFinder(("requests", "urllib3")))  # TRL's vLLM client only
    from trl.trainer.grpo_trainer import GRPOTrainer  # type: ignore[import-not-found]  # trl venv only

    out: dict[str, Any] = {}
    for lt, level, delta, beta in cases():
        lp = x["logps"].clone().requires_grad_(True)
        me = types.SimpleNamespace(
            _get_per_token_logps_and_entropies=lambda *a, _lp=lp, **k: (_lp, torch.zeros_like(_lp), None),
            top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level,
            beta=beta, loss_type=lt, epsilon_low=EPS_LO, epsilon_high=EPS_HI, use_vllm=False,
            vllm_importance_sampling_correction=False, model=types.SimpleNamespace(training=True),
            current_gradient_accumulation_steps=1, max_completion_length=T, accelerator=_Accelerator(),
            args=types.SimpleNamespace(use_bias_correction_kl=False, delta=delta, steps_per_generation=1),
            _metrics={"train": collections.defaultdict(list), "eval": collections.defaultdict(list)},
            _entropy_bonus_enabled=False, aux_loss_enabled=False, use_adaptive_entropy=False,
        )  # fmt: skip
        inputs = {
            "prompt_ids": torch.zeros(B, 2, dtype=torch.long),
            "prompt_mask": torch.ones(B, 2, dtype=torch.long),
            "completion_ids": torch.zeros(B, T, dtype=torch.long),
            "completion_mask": x["mask"],
            "advantages": x["advantages"],
            "old_per_token_logps": x["old_logps"],
            "ref_per_token_logps": x["ref_logps"],
            "num_items_in_batch": x["mask"].sum() + EXTRA_TOKENS,
        }
        loss = GRPOTrainer._compute_loss(me, None, inputs)
        loss.backward()
        key = case_key(lt, level, delta, beta)
        out[key + "/loss"] = loss.detach()
        out[key + "/grad"] = lp.grad
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
    d = torch.tensor(OFFSETS, dtype=f64).unsqueeze(1) + (torch.rand(B, T, generator=g, dtype=f64) - 0.5) * 2.4
    ref = old + (torch.rand(B, T, generator=g, dtype=f64) - 0.5)
    junk = torch.tensor(JUNK, dtype=f64)
    return {
        "mask": mask.long(),
        "old_logps": torch.where(mask, old, junk),
        "logps": torch.where(mask, old + d, junk),
        "ref_logps": torch.where(mask, ref, junk),
        "advantages": torch.randn(B, generator=g, dtype=f64),
    }


def refppo_setting(lt: str, level: str, delta: float | None, beta: float) -> dict[str, Any]:
    """The refppo keys of one TRL case (spec/conventions.md)."""
    return {
        "policy_loss": "gspo" if level == "sequence" else "vanilla",
        "loss_agg": AGG[lt],
        "dual_clip": delta,
        "kl_in": "loss" if beta > 0 else "reward",
        "kl_estimator": "k3",
        "global_tokens": lt == "dapo",
    }


def refppo_case(x: dict[str, Any], setting: dict[str, Any], beta: float) -> dict[str, Any]:
    """refppo's loss, autograd gradient and twin gradient under ``setting``."""
    import torch

    from refppo.pipeline.blocks import Normalisers
    from refppo.pipeline.grad_naive import objective_grads_naive
    from refppo.pipeline.settings import Convention, Hyperparams
    from refppo.pipeline.step import update_quantities

    m = x["mask"].bool()
    conv_keys = {k: v for k, v in setting.items() if k != "global_tokens"}
    conv = Convention.from_dict(conv_keys)
    hp = Hyperparams(cliprange=EPS_LO, cliprange_high=EPS_HI, kl_coef=beta, vf_coef=0.0, horizon=float(T))
    norm = Normalisers(token_count=float(m.sum()) + EXTRA_TOKENS) if setting["global_tokens"] else None
    zeros = torch.zeros(B, T, dtype=torch.float64)
    ts = {
        "old_logprobs": x["old_logps"],
        "ref_logprobs": x["ref_logps"],
        "advantages": x["advantages"].unsqueeze(1).expand(B, T).contiguous(),
        "old_values": zeros,
        "returns": zeros,
    }
    lp = x["logps"].clone().requires_grad_(True)
    q = update_quantities(logprobs=lp, values=zeros, mask=m, hp=hp, conv=conv, norm=norm, **ts)
    torch.autograd.backward(q.loss)
    twin, _ = objective_grads_naive(
        logprobs=x["logps"], values=zeros, mask=m, hp=hp, conv=conv, norm=norm, **ts
    )
    return {"loss": q.loss.detach(), "grad": lp.grad, "twin": twin}


def contrasts(setting: dict[str, Any], lt: str, level: str, delta: float | None) -> list[dict[str, Any]]:
    """The mapping with one key flipped: each must NOT reproduce TRL."""
    out = []
    if lt == "dapo":
        out.append({**setting, "global_tokens": False})  # the local token count (issue #10's bug class)
    else:
        out.append({**setting, "loss_agg": CONTRAST_AGG[lt]})
    if delta is not None:
        out.append({**setting, "dual_clip": None})
    if level == "sequence":
        out.append({**setting, "policy_loss": "vanilla"})
    return out


def compare(unit: str, x: dict[str, Any], got: dict[str, Any]) -> list[Case]:
    """One case per ``(loss_type, level, delta, beta)``; its controls are :func:`contrasts`."""
    m = x["mask"].bool()
    out = []
    for lt, level, delta, beta in cases():
        key = case_key(lt, level, delta, beta)
        setting = refppo_setting(lt, level, delta, beta)
        ref = refppo_case(x, setting, beta)
        peer_grad = got[key + "/grad"]
        errs = {
            "loss": err(ref["loss"], got[key + "/loss"], rtol=TOL),
            "grad": err(ref["grad"], peer_grad, m, rtol=TOL),
            "twin": err(ref["twin"], peer_grad, m, rtol=TOL),
        }
        controls = []
        for c in contrasts(setting, lt, level, delta):
            gap, tol = err(refppo_case(x, c, beta)["grad"], peer_grad, m, rtol=TOL)
            flip = " ".join(f"{k}={v}" for k, v in c.items() if setting[k] != v)
            controls.append(Control(flip, gap > tol, f"gradient differs by {gap:.1e}"))
        pad_ok = bool((peer_grad[~m] == 0).all()) and bool((ref["grad"][~m] == 0).all())
        ok = pad_ok and all(e <= tol for e, tol in errs.values())
        keys = " ".join(f"{k}={v}" for k, v in setting.items())
        errors = {n: e for n, (e, _) in errs.items()}
        out.append(Case(unit, key, ok, errors, controls, {"setting": setting}, [f"[{keys}]"]))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser("trl_grpo", __doc__, list(VENVS)).parse_args(argv)
    report = Report("trl_grpo")
    x = make_batch()
    with workdir(args.keep) as work:
        for unit, out, _ in run_venvs(report, selected(args, VENVS), root_of(args), work, batch=x):
            import torch

            got = torch.load(out / f"result-{unit}.pt", weights_only=True)
            for case in compare(unit, x, got):
                report.add(case)
    return report.finish(args.json_out)
