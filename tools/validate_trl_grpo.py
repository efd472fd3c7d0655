#!/usr/bin/env python3
"""Run TRL's OWN ``GRPOTrainer._compute_loss`` on one batch and compare refppo's pipeline with it.

Not part of CI (by hand; ``tests/peers/test_validate_trl_grpo.py`` runs it when the TRL venv exists).
Two halves, two interpreters, as ``tools/validate_gspo.py``:

1. ``--peer-half IN OUT`` (the TRL venv, ``/work/shared/peers/README.md``: TRL 1.12.0, which has
   ``GRPOTrainer``) loads the batch (``torch.load(weights_only=True)``) and calls
   ``trl/trainer/grpo_trainer.py::GRPOTrainer._compute_loss`` unbound on a stand-in ``self`` whose
   ``_get_per_token_logps_and_entropies`` returns the batch's current log-probs (a leaf tensor), one
   process, no gradient accumulation, no vLLM; it back-propagates and saves the loss and
   ``∂loss/∂logps``. Only ``requests``/``urllib3`` are stubbed (imported by TRL's vLLM client, not
   called).
2. Without it (refppo's interpreter) it runs ``refppo.pipeline.update.update_quantities`` with the mapping
   of spec/conventions.md ("Policy-loss modes and GRPO loss types") and compares the loss (the
   pipeline's, with ``vf_coef = 0``) and the autograd gradient, plus the closed-form twin
   ``refppo.pipeline.grad_naive.objective_grads_naive``; exit 1 when one differs by more than
   ``1e-9·max(1, |value|)`` (float64), or when a contrast (the mapping with one key flipped) does
   NOT differ.

Cases (24): ``loss_type`` grpo, bnpo, dr_grpo, dapo × ``importance_sampling_level`` token (with
``delta`` None or 2.0) or sequence (``delta`` None) × ``beta`` 0 or 0.04 (k3 KL in the loss). For
``dapo``, ``num_items_in_batch`` is the batch's tokens + 10 (a larger accumulated batch): refppo's
``Normalisers(token_count = N + 10)``. ε_low = 0.2, ε_high = 0.28, ``max_completion_length`` = T.
Batch: float64, B = 8, T = 10, lengths 10, 7, 4, 1, 10, 5, 3, 8; token log-ratios spread ±1.2 plus
per-row offsets (every clip region, ratios above δ); finite junk 7.5 on the padding (TRL multiplies
by the mask).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
B, T, JUNK, EXTRA_TOKENS, TOL = 8, 10, 7.5, 10, 1e-9
LENGTHS = (10, 7, 4, 1, 10, 5, 3, 8)
OFFSETS = (-0.5, -0.1, 0.1, 0.5, 0.0, 0.3, 0.22, -0.25)
EPS_LO, EPS_HI = 0.2, 0.28
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
PEER_ENV = "/work/peervenv/trl/bin/python"
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
# Half 1: runs in the TRL venv (no refppo import).
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


def peer_half(inp: str, outp: str) -> int:
    from importlib.metadata import version

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peer_makers import common as pm

    sys.meta_path.insert(0, pm._StubFinder(("requests", "urllib3")))  # TRL's vLLM client only
    from trl.trainer.grpo_trainer import GRPOTrainer  # type: ignore[import-not-found]  # trl venv only

    x = torch.load(inp, weights_only=True)
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
    torch.save(out, outp)
    Path(outp + ".json").write_text(json.dumps({"trl": f"trl {version('trl')}"}))
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

    sys.path.insert(0, str(REPO))
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


def _err(a: Any, b: Any, m: Any = None) -> tuple[float, float]:
    import torch

    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    if m is not None:
        a, b = a[m], b[m]
    return float((a - b).abs().max()), TOL * max(1.0, float(b.abs().max()))


def validate(python: str) -> int:
    import torch

    x = make_batch()
    m = x["mask"].bool()
    if not Path(python).exists():
        print(f"SKIPPED: no interpreter {python}")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        inp, outp = os.path.join(tmp, "batch.pt"), os.path.join(tmp, "out.pt")
        torch.save(x, inp)
        proc = subprocess.run(
            [python, str(Path(__file__).resolve()), "--peer-half", inp, outp],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if proc.returncode != 0:
            print(f"FAILED {python}: {' | '.join(proc.stderr.strip().splitlines()[-3:])}")
            return 1
        print(f"{python}: {json.loads(Path(outp + '.json').read_text())}")
        got = torch.load(outp, weights_only=True)
    failures = compared = 0
    worst: dict[str, float] = {}
    for lt, level, delta, beta in cases():
        key = case_key(lt, level, delta, beta)
        setting = refppo_setting(lt, level, delta, beta)
        ref = refppo_case(x, setting, beta)
        peer_grad = got[key + "/grad"]
        errs = {
            "loss": _err(ref["loss"], got[key + "/loss"]),
            "grad": _err(ref["grad"], peer_grad, m),
            "twin": _err(ref["twin"], peer_grad, m),
        }
        gaps = [
            _err(refppo_case(x, c, beta)["grad"], peer_grad, m) for c in contrasts(setting, lt, level, delta)
        ]
        pad_ok = bool((peer_grad[~m] == 0).all()) and bool((ref["grad"][~m] == 0).all())
        ok = pad_ok and all(e <= tol for e, tol in errs.values()) and all(g > tol for g, tol in gaps)
        failures += not ok
        compared += 1
        for name, (e, _) in errs.items():
            worst[name] = max(worst.get(name, 0.0), e)
        detail = "  ".join(f"{n} {e:.1e}" for n, (e, _) in errs.items())
        flips = ", ".join(f"{g:.1e}" for g, _ in gaps)
        keys = " ".join(f"{k}={v}" for k, v in setting.items())
        print(f"  {'OK ' if ok else 'BAD'} {key:<40} {detail}  contrasts differ by {flips}  [{keys}]")
    print("max abs errors: " + ", ".join(f"{n} {e:.2e}" for n, e in worst.items()))
    print(f"{compared} comparisons, {failures} failure(s)")
    return 1 if failures or not compared else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--peer-half", nargs=2, metavar=("IN", "OUT"), help="(internal) run in the TRL venv")
    ap.add_argument("--peers-python", default=PEER_ENV, help=f"the TRL venv's python (default {PEER_ENV})")
    args = ap.parse_args()
    if args.peer_half:
        return peer_half(*args.peer_half)
    return validate(args.peers_python)


if __name__ == "__main__":
    sys.exit(main())
