#!/usr/bin/env python3
"""Dumps computed by TRL 1.12.0's OWN ``PPOTrainer.train`` for ``tools/validate_detect.py``. Not CI.

Runs in the TRL side venv (``tools/build_peer_venvs.sh``)::

    /work/peervenv/trl/bin/python tools/validate_detect_trl.py --make DIR

Each case is one iteration of TRL 1.12.0's unmodified
``trl/experimental/ppo/ppo_trainer.py::PPOTrainer.train`` on the tiny offline set-up of
``tools/validate_trl_preset.py`` (:func:`validate_trl_preset.build_trainer`: random GPT-2
policy / value / reward, 16 prompts, 12 new tokens, fp32 CPU, one minibatch), captured with the
supported tracer ``refppo.capture.adapters.trl`` (:func:`validate_trl_preset.run_trl`). The cases
cover every option of the TRL rows of ``spec/conventions.md`` that changes a dumped quantity
(``kl_estimator`` k1/k3, ``kl_coef``, ``whiten_rewards``, ``missing_eos_penalty`` / ``stop_token``,
``gamma``, ``lam``, ``cliprange``, ``cliprange_value``, ``vf_coef``), each in a combination that
``tools/validate_trl_preset.py`` does not run (k3 on full rows, whitened rewards with k3 or on full
rows, rows without a penalty, captures in the second epoch with k1, ...).

Written like ``tools/peer_makers/common.py::save``: ``NAME.pt`` (``torch.save`` of the tensors,
read with ``weights_only=True``), ``NAME.pt.json`` (the hyperparameters only: no convention, so
``--detect`` starts from refppo's defaults), ``NAME.set.json`` (the ``--set`` keys that, on
``--preset trl``, state the case: TRL's ``kl_estimator`` and, with ``whiten_rewards=True``,
``whiten_rewards=masked_no_shift``) and ``status-trl.json`` (``{"trl": {"made": [...]}}``).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

_EPOCH2 = {"num_ppo_epochs": 2, "learning_rate": 3e-3}
"""Captured in the second PPO epoch: the ratio and the value prediction have moved, so both clip
branches of the policy and the value loss fire."""

CASES: dict[str, dict[str, Any]] = {
    # k3 on full-width rows (validate_trl_preset runs k1 there)
    "trl_k3_full": {
        "stop_token": None,
        "eos_boost": 0.0,
        "capture_epoch": 0,
        "config": {"kl_estimator": "k3"},
    },
    # ragged rows without the EOS penalty; k3, no KL in the reward at all
    "trl_k3_ragged_nopenalty_klcoef0": {
        "stop_token": "eos",
        "eos_boost": 1.0,
        "capture_epoch": 0,
        "config": {"kl_estimator": "k3", "kl_coef": 0.0, "gamma": 0.9, "lam": 1.0},
    },
    # k1, second epoch, every loss hyperparameter off its default
    "trl_k1_ragged_epoch2_clips": {
        "stop_token": "eos",
        "eos_boost": 1.0,
        "capture_epoch": 1,
        "config": {
            "missing_eos_penalty": 2.0,
            "kl_coef": 0.2,
            "gamma": 0.97,
            "lam": 0.8,
            "cliprange": 0.15,
            "cliprange_value": 0.05,
            "vf_coef": 0.3,
            **_EPOCH2,
        },
    },
    # whitened rewards with k3, in the second epoch
    "trl_k3_whiten_rewards_epoch2": {
        "stop_token": "eos",
        "eos_boost": 1.0,
        "capture_epoch": 1,
        "config": {
            "kl_estimator": "k3",
            "whiten_rewards": True,
            "missing_eos_penalty": 0.5,
            "kl_coef": 0.1,
            "cliprange": 0.1,
            "cliprange_value": 0.02,
            "vf_coef": 0.5,
            **_EPOCH2,
        },
    },
    # whitened rewards on full-width rows (the score slot is the last position)
    "trl_k1_whiten_rewards_full": {
        "stop_token": None,
        "eos_boost": 0.0,
        "capture_epoch": 0,
        "config": {"whiten_rewards": True, "gamma": 0.99, "lam": 0.95},
    },
}


def make(out: Path) -> dict[str, Any]:
    """Run every case (TRL's interpreter); write the dumps; return the status."""
    import torch

    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "tools"))
    from validate_trl_preset import run_trl

    made: list[str] = []
    failed: dict[str, str] = {}
    for name, spec in CASES.items():
        try:
            tensors, side, facts = run_trl(name, spec)
        except Exception as exc:  # report the case that could not run; go on with the others
            failed[name] = f"{type(exc).__name__}: {exc} | {traceback.format_exc().splitlines()[-2:]}"
            continue
        conv = {"kl_estimator": spec["config"].get("kl_estimator", "k1")}
        if spec["config"].get("whiten_rewards"):
            conv["whiten_rewards"] = "masked_no_shift"
        torch.save({k: v.detach().contiguous() for k, v in tensors.items()}, out / f"{name}.pt")
        (out / f"{name}.pt.json").write_text(json.dumps(side["hparams"]))
        (out / f"{name}.set.json").write_text(json.dumps(conv))
        (out / f"{name}.facts.json").write_text(json.dumps(facts))
        made.append(name)
    status: dict[str, Any] = {"trl": {"made": made, **({"failed": failed} if failed else {})}}
    (out / "status-trl.json").write_text(json.dumps(status, indent=2))
    return status


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--make", metavar="DIR", required=True, help="write the dumps into DIR")
    args = ap.parse_args()
    out = Path(args.make)
    out.mkdir(parents=True, exist_ok=True)
    status = make(out)
    print(json.dumps(status))
    return 0 if status["trl"]["made"] and not status["trl"].get("failed") else 1


if __name__ == "__main__":
    raise SystemExit(main())
