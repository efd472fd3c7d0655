"""The prompt-level mean (``refppo.core.aggregate.prompt_mean_loss``) against SkyRL 0.4.0's own
``prompt_mean`` loss reduction (``skyrl04`` venv; SKIPPED with the reason when it is not built).

The maker (``tools/peers/makers/skyrl_prompt_mean.py``) runs SkyRL's
``apply_loss_reduction_to_advantages_minibatch(prompt_mean)`` then its ``ppo_policy_loss`` on four
prompts of 3, 2, 4 and 1 ragged rows, and records the loss and its gradient. refppo: the per-token
clipped loss of the core (:func:`refppo.core.policy.clipped_policy_token_loss`) aggregated by
``prompt_mean_loss``; controls: ``token-mean`` and ``seq-mean-token-mean`` must mismatch. The same
dump through the pipeline under ``loss_agg=prompt-mean`` (the dump's groups as ``group_index``):
``pg_loss`` and its gradient match; under ``loss_agg=seq-mean-token-mean`` (the control) they do not.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import torch
from _peers import REPO, TOOLS, require

from refppo.core.aggregate import aggregate_loss, prompt_mean_loss
from refppo.core.policy import clipped_policy_token_loss
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import update_grads, update_inputs, update_quantities


def test_prompt_mean_reproduces_skyrl_0_4_0(tmp_path: Path) -> None:
    py = require("skyrl04")
    proc = subprocess.run(
        [str(py), str(TOOLS / "peers" / "makers" / "skyrl_prompt_mean.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TOOLS)])},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads((tmp_path / "skyrl_prompt_mean.json").read_text())
    f32 = torch.float32
    m = torch.tensor(doc["mask"], dtype=torch.bool)
    lp = torch.tensor(doc["logprobs"], dtype=f32, requires_grad=True)
    old, adv = torch.tensor(doc["old_logprobs"], dtype=f32), torch.tensor(doc["advantages"], dtype=f32)
    groups = torch.tensor(doc["groups"])
    per_token = clipped_policy_token_loss(
        lp, old, adv, m, clip_low=doc["cliprange"], clip_high=doc["cliprange_high"]
    ).per_token
    loss = prompt_mean_loss(per_token, m, groups)
    (grad,) = torch.autograd.grad(loss, lp)
    peer_loss, peer_grad = doc["pg_loss"], torch.tensor(doc["grad_logprobs"], dtype=f32)
    # float32 on both sides (SkyRL's ratio is float32); the sums run in another order
    assert abs(float(loss.detach()) - peer_loss) <= 1e-6
    assert float((grad - peer_grad).abs().max()) <= 1e-7
    for control in ("token-mean", "seq-mean-token-mean"):
        other = float(aggregate_loss(per_token.detach(), m, control))
        assert abs(other - peer_loss) > 1e-3, control

    _pipeline_matches(doc, lp.detach(), old, adv, m, groups)


def _pipeline_matches(
    doc: dict[str, Any],
    lp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    m: torch.Tensor,
    g: torch.Tensor,
) -> None:
    """The pipeline under ``loss_agg=prompt-mean`` reproduces the peer's loss and gradient; under the
    control ``seq-mean-token-mean`` it does not."""
    zeros = torch.zeros_like(lp)
    x = {"logprobs": lp, "values": zeros, "old_logprobs": old, "old_values": zeros, "advantages": adv,
         "returns": zeros, "mask": m}  # fmt: skip
    hp = Hyperparams(cliprange=doc["cliprange"], cliprange_high=doc["cliprange_high"])
    peer_loss, peer_grad = doc["pg_loss"], torch.tensor(doc["grad_logprobs"], dtype=torch.float32)
    errs: dict[str, tuple[float, float]] = {}
    for agg in ("prompt-mean", "seq-mean-token-mean"):
        conv = Convention.of(loss_agg=agg, value_loss_agg="token-mean")
        pg = update_quantities(**x, group_index=g, hp=hp, conv=conv).pg_loss
        grad = update_grads(update_inputs(**x, group_index=g), hp=hp, conv=conv, objective="pg_loss")
        errs[agg] = (abs(float(pg) - peer_loss), float((grad["grad_logprobs"] - peer_grad).abs().max()))
    assert errs["prompt-mean"][0] <= 1e-6 and errs["prompt-mean"][1] <= 1e-7, errs
    assert errs["seq-mean-token-mean"][0] > 1e-3 and errs["seq-mean-token-mean"][1] > 1e-4, errs
