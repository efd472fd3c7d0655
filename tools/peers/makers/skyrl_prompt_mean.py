"""SkyRL 0.4.0's ``prompt_mean`` loss reduction run with its own code (the ``skyrl04`` venv's python).

Called (``skyrl/backends/skyrl_train/utils/ppo_utils.py``): ``apply_loss_reduction_to_advantages_minibatch``
(``loss_reduction="prompt_mean"``: each advantage scaled by ``1/(P·N_p)``, ``prompt_boundaries`` the
contiguous rows of each prompt) and ``ppo_policy_loss`` (``regular``; its ``reduce_loss`` sums
``loss·mask``), as SkyRL's ``trainer.py`` chains them for one mini-batch; the gradient is the peer
loss's autograd gradient with respect to the log-probs. Writes ``skyrl_prompt_mean.json``: the inputs,
the groups, the peer's loss and gradient (float32: SkyRL's ``safe_exp_delta`` takes the ratio in
float32 whatever the input; written as ``repr`` floats, an exact round trip).

Usage: ``python skyrl_prompt_mean.py OUT_DIR`` (PYTHONPATH = tools/).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

from peers.stubs import install_stubs, mount, site_packages

SIZES = (3, 2, 4, 1)
"""Rows per prompt (contiguous, as SkyRL lays them out: ``compute_prompt_boundaries(uids)``)."""
T = 7
EPS_LOW, EPS_HIGH = 0.2, 0.28


def _peer() -> Any:
    """SkyRL 0.4.0's ``ppo_utils`` without its package ``__init__``s (cloudpathlib, the backends);
    ``ray`` stubbed, ``skyrl.train.config`` replaced by a module with the one name the file imports."""
    install_stubs()
    for name in (
        "skyrl",
        "skyrl.backends",
        "skyrl.backends.skyrl_train",
        "skyrl.backends.skyrl_train.utils",
        "skyrl.train",
    ):
        mount(name, site_packages())
    cfg = types.ModuleType("skyrl.train.config")
    cfg.AlgorithmConfig = object  # type: ignore[attr-defined]  # a type annotation only, in the peer
    sys.modules["skyrl.train.config"] = cfg
    from skyrl.backends.skyrl_train.utils import ppo_utils  # type: ignore[import-not-found]  # side venv only

    return ppo_utils


def make(out: Path, seed: int = 2301) -> Path:
    """One mini-batch of ``len(SIZES)`` prompts: ragged rows, ratios off 1 so that both clip sides bind."""
    import torch
    from omegaconf import OmegaConf  # type: ignore[import-not-found]  # side venv only

    pu = _peer()
    g = torch.Generator().manual_seed(seed)
    B = sum(SIZES)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old = -torch.rand(B, T, generator=g, dtype=torch.float32) * 3 - 0.05
    lp = (old + (torch.rand(B, T, generator=g, dtype=torch.float32) - 0.5) * 0.8).requires_grad_(True)
    adv = torch.randn(B, T, generator=g, dtype=torch.float32)
    bounds, groups, start = [], [], 0
    for p, n in enumerate(SIZES):
        bounds.append((start, start + n))
        groups += [p] * n
        start += n
    scaled = pu.apply_loss_reduction_to_advantages_minibatch(
        advantages=adv, loss_mask=mask.float(), loss_reduction="prompt_mean", micro_batch_size=B,
        max_seq_len=T, prompt_boundaries=bounds,
    )  # fmt: skip
    cfg = OmegaConf.create(
        {
            "policy_loss_type": "regular",
            "eps_clip_low": EPS_LOW,
            "eps_clip_high": EPS_HIGH,
            "off_policy_correction": {},
        }
    )
    loss, _ = pu.ppo_policy_loss(lp, old, scaled, cfg, loss_mask=mask.float())
    (grad,) = torch.autograd.grad(loss, lp)
    doc = {
        "peer": "skyrl==0.4.0 apply_loss_reduction_to_advantages_minibatch(prompt_mean), ppo_policy_loss",
        "cliprange": EPS_LOW,
        "cliprange_high": EPS_HIGH,
        "mask": mask.tolist(),
        "groups": groups,
        "logprobs": lp.detach().tolist(),
        "old_logprobs": old.tolist(),
        "advantages": adv.tolist(),
        "pg_loss": float(loss.detach()),
        "grad_logprobs": grad.tolist(),
    }
    path = out / "skyrl_prompt_mean.json"
    path.write_text(json.dumps(doc))
    return path


if __name__ == "__main__":
    print(make(Path(sys.argv[1])))
