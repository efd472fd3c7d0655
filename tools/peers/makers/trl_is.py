"""TRL 1.16.0 GRPOTrainer step dumps with the vLLM importance-sampling correction (``trl-grpo`` venv).

For each ``vllm_importance_sampling_mode`` (token/sequence × truncate/mask): the IS ratio from TRL's own
lines of ``GRPOTrainer._generate_and_score_completions`` (run as installed:
:func:`peers.rollout_correction_side.trl_is_ratio`; the sequence modes sum the log-ratios: a
product weight), the advantages from TRL's own block (:func:`peers.makers.trl_grpo.trl_advantages`),
``GRPOTrainer._compute_loss`` (``per_token_loss * importance_sampling_ratio``) under autograd on
the ``per_token_logps`` leaf: ``loss`` = ``pg_loss`` (β = 0) and ``grad_logprobs`` (v2, one rank).
The ``--set`` keys are written here from TRL's documented semantics (not from refppo's adapter):
``rollout_is`` the level, ``rollout_is_agg=product``, ``rollout_is_mode`` truncate/mask,
``rollout_is_low``/``high`` = ``vllm_importance_sampling_clip_min``/``max``; the control flips the mode.
"""

from __future__ import annotations

import sys
import tempfile
import types
from pathlib import Path
from typing import Any

from peers.makers.common import HP, inputs, save

# (mode, clip_min, clip_max, loss_type)
CASES: list[tuple[str, float | None, float | None, str]] = [
    ("token_truncate", None, 2.0, "dapo"),
    ("token_mask", 0.5, 2.0, "dapo"),
    ("sequence_truncate", None, 1.5, "grpo"),
    ("sequence_mask", 0.5, 2.0, "dapo"),
]
AGG = {"dapo": "token-mean", "grpo": "seq-mean-token-mean"}


def make(out: Path) -> list[str]:
    import torch

    from peers.makers.trl_grpo import EPS_HIGH, _advantage_block, trl_advantages, trl_loss
    from peers.rollout_correction_side import trl_is_ratio
    from peers.stubs import StubFinder

    sys.meta_path.insert(0, StubFinder(("requests", "urllib3")))  # TRL's vLLM client only
    from trl import GRPOConfig  # type: ignore[import-not-found]  # trl venv only
    from trl.trainer import grpo_trainer  # type: ignore[import-not-found]  # trl venv only

    n, B, T = 4, 12, 10
    cls = grpo_trainer.GRPOTrainer
    made = []
    for i, (mode, lo, hi, loss_type) in enumerate(CASES):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = GRPOConfig(
                output_dir=tmp, loss_type=loss_type, beta=0.0, epsilon_high=EPS_HIGH, num_generations=n,
                per_device_train_batch_size=B, report_to=[], use_cpu=True, max_completion_length=T,
                use_vllm=True, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
                vllm_importance_sampling_clip_min=lo, vllm_importance_sampling_clip_max=hi,
            )  # fmt: skip
        x = inputs(1000 + i, B=B, T=T)
        for k in (
            "old_values",
            "values",
            "entropy",
        ):  # ref_logprobs kept (unread at β = 0): --detect's KL walk
            x.pop(k)
        m = x["response_mask"]
        g = torch.Generator().manual_seed(1050 + i)
        scale = 0.25 if mode.startswith("sequence") else 0.6  # a row's summed log-ratio stays moderate
        beh = x["old_logprobs"] - scale * torch.randn(m.shape, generator=g, dtype=m.dtype)
        x["rollout_logprobs"] = torch.where(m.bool(), beh, torch.full_like(beh, 7.5))
        x["scores"] = x["scores"] / 4.0
        x["group_index"] = torch.arange(B, dtype=torch.int64) // n
        adv = trl_advantages(grpo_trainer, _advantage_block(cls), x["scores"], cfg.scale_rewards, n)
        me = types.SimpleNamespace(
            use_vllm=True, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
            vllm_importance_sampling_clip_min=lo, vllm_importance_sampling_clip_max=hi,
        )  # fmt: skip
        ratio = trl_is_ratio(me, m.long(), x["old_logprobs"], x["rollout_logprobs"])
        lp = x["logprobs"].clone().requires_grad_(True)
        loss, _ = trl_loss(cls, x, adv, cfg.loss_type, cfg.beta, is_ratio=ratio, leaf=lp)
        (g_lp,) = torch.autograd.grad(loss, (lp,))
        dump: dict[str, Any] = dict(x)
        dump.update(
            advantages=torch.where(m.bool(), adv.unsqueeze(1) * m, 0.0 * m), loss=loss.detach(),
            pg_loss=loss.detach(), grad_logprobs=torch.where(m.bool(), g_lp, 0.0),
        )  # fmt: skip
        hp = dict(HP, gamma=1.0, lam=1.0, kl_coef=0.0, cliprange=cfg.epsilon, cliprange_high=EPS_HIGH)
        hp.update(world_size=1, micro_batches=1)  # γ, λ, the value clip: read by --detect's defaults only
        level, how = mode.split("_")
        conv = {
            "advantage": "grpo", "loss_agg": AGG[loss_type], "rollout_is": level, "rollout_is_agg": "product",
            "rollout_is_mode": how, "rollout_is_low": lo, "rollout_is_high": hi,
        }  # fmt: skip
        control = {"rollout_is_mode": "mask" if how == "truncate" else "truncate"}
        made.append(save(out, f"trl1160_is_{mode}", dump, hp, conv, control))
    return made
