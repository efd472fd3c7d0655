"""A gradient-only v2 step of OpenRLHF 0.11.2 with ``algo.kl.use_loss`` and ``algo.kl.unbiased_gradient``
(``verl-openrlhf`` venv; nothing from refppo): two ranks × two micro-batches as
:mod:`peers.makers.grad_only` runs them, each micro-batch's KL term
``compute_approx_kl(log π, log π_ref, log_probs_old=log π_old, kl_estimator, unbiased_gradient=True)``
(``openrlhf/models/utils.py``, as ``trainer/ray/ppo_actor.py::training_step`` calls it) aggregated by
``models/loss.py::aggregate_loss`` with the step's ``loss_batch_info``. Writes ``NAME.pt`` (+ sidecar,
``NAME.set.json``) for ``k1`` and ``k3``; a control with ``unbiased_gradient=False``.

Usage: ``python openrlhf_kl_unbiased.py OUT_DIR`` (PYTHONPATH = the repository and tools/).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from peers.makers.common import HP, inputs
from peers.makers.grad_only import GRAD_HP, K, W, _step, _write

CASES = (("k1", True), ("k3", True), ("k3", False))
"""``(kl_estimator, unbiased_gradient)``; the last is the control (the plain estimator's gradient)."""


def make(out: Path) -> list[str]:
    import torch

    from peers.makers.openrlhf_step import openrlhf_fns, shaped_gae

    fns = openrlhf_fns()
    made = []
    for i, (est, unbiased) in enumerate(CASES):
        x = inputs(830 + i)
        m = x["response_mask"]
        x["logprobs"] = torch.where(
            m.bool(), x["old_logprobs"] + 1.2 * (x["logprobs"] - x["old_logprobs"]), 7.5
        )
        _, rewards, adv, ret = shaped_gae(fns, x, est, 0.0)
        info = {
            "dp_size": W,
            "batch_num_tokens": torch.as_tensor(float(m.sum()) / K),
            "global_batch_size": torch.as_tensor(float(m.shape[0]) / K),
        }
        loss_fn = _loss(fns, x, (adv, ret), info, est, unbiased)
        dump = dict(x, token_rewards=rewards, advantages=adv, returns=ret)
        conv = {"kl_estimator": f"{est}+", "kl_in": "loss", "loss_agg": "token-mean", "kl_grad_is_clip": 10.0}
        name = f"openrlhf_kl_unbiased_{est}" + ("" if unbiased else "__control")
        made.append(_write(out, name, {**dump, **_step(x, loss_fn)}, dict(GRAD_HP), conv))
    return made


def _loss(
    fns: dict[str, Any],
    x: dict[str, Any],
    adv_ret: tuple[Any, Any],
    info: dict[str, Any],
    est: str,
    unbiased: bool,
) -> Any:
    """One micro-batch's ``(policy objective, value objective)`` as OpenRLHF's actor and critic make
    them (token-level ``PolicyLoss``, the KL term ``β·aggregate_loss(compute_approx_kl(...))``,
    ``ValueLoss``), each ``/ gas``."""
    (adv, ret), m = adv_ret, x["response_mask"]
    policy = fns["PolicyLoss"](HP["cliprange"], HP["cliprange"], token_level_loss=True)
    value = fns["ValueLoss"](HP["cliprange_value"])

    def loss_fn(rows: Any, lp: Any, v: Any) -> tuple[Any, Any]:
        mr = m[rows]
        pg = policy(lp, x["old_logprobs"][rows], adv[rows], action_mask=mr, **info)[0]
        kl = fns["compute_approx_kl"](
            lp, x["ref_logprobs"][rows], log_probs_old=x["old_logprobs"][rows], kl_estimator=est,
            unbiased_gradient=unbiased,
        )  # fmt: skip
        pg = pg + HP["kl_coef"] * fns["aggregate_loss"](kl, mr, **info)
        vf = value(v, x["old_values"][rows], ret[rows], action_mask=mr, **info)
        vf = vf[0] if isinstance(vf, tuple) else vf
        return pg / K, vf / K

    return loss_fn


if __name__ == "__main__":
    print(make(Path(sys.argv[1])))
