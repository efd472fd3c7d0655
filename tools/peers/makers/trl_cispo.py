"""TRL 1.16.0 GRPOTrainer ``loss_type="cispo"`` step dumps (``trl-grpo`` venv).

TRL's own code, as :mod:`peers.makers.trl_grpo`: the advantage block of
``trl/trainer/grpo_trainer.py::GRPOTrainer._generate_and_score_completions`` and
``GRPOTrainer._compute_loss`` (``loss_type="cispo"``: ``clamp(coef_1, max=epsilon_high).detach()``
times ``−A·per_token_logps``, no lower bound, ``epsilon_high`` the cap on ρ itself; summed over the
tokens / ``num_items_in_batch``) under autograd on the ``per_token_logps`` leaf: ``loss`` =
``pg_loss`` (β = 0) and ``grad_logprobs`` (v2, one rank).

The ``--set`` keys, from TRL's documented semantics: ``policy_loss=cispo``, ``loss_agg=token-mean``
(one process, no accumulation), sidecar ``cliprange = 1`` (no lower bound: ``1 − 1 = 0 < ρ``) and
``cliprange_high = epsilon_high − 1``. The control is ``policy_loss=vanilla``; the test also checks
that refppo's default lower bound (``cliprange = 0.2``) mismatches (the data has ρ < 0.8).
``pg_clipfrac`` is TRL's own logged ``cispo_clip_ratio`` (``_metrics["train"]``: the masked mean of
``(coef_1 > epsilon_high) & (advantages > 0)``), refppo's ``clipfrac_counts=by_advantage``; the
test's control is the default count (``all``: ``ρ`` outside the band on either advantage's sign).
"""

from __future__ import annotations

import collections
import sys
import tempfile
from pathlib import Path
from typing import Any

from peers.makers.common import HP, inputs, save

# (epsilon_high = the cap on ρ, log-ratio spread, dtype)
CASES: list[tuple[float, float, str]] = [(1.5, 1.0, "f64"), (5.0, 2.5, "f64"), (1.28, 1.0, "f32")]
SET: dict[str, Any] = {"advantage": "grpo", "policy_loss": "cispo", "loss_agg": "token-mean"}
COUNTS = "by_advantage"
"""``clipfrac_counts`` of ``cispo_clip_ratio`` (the preset's ``grpo`` variant says so too); the
sidecar carries it (a logging convention the producer declares: ``--detect`` does not walk it)."""


def make(out: Path) -> list[str]:
    import torch

    from peers.makers.trl_grpo import _advantage_block, trl_advantages, trl_loss
    from peers.stubs import StubFinder

    sys.meta_path.insert(0, StubFinder(("requests", "urllib3")))  # TRL's vLLM client only
    from trl import GRPOConfig  # type: ignore[import-not-found]  # trl venv only
    from trl.trainer import grpo_trainer  # type: ignore[import-not-found]  # trl venv only

    n, B, T = 4, 12, 10
    cls = grpo_trainer.GRPOTrainer
    made = []
    for i, (eps_max, spread, dt) in enumerate(CASES):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = GRPOConfig(
                output_dir=tmp, loss_type="cispo", beta=0.0, epsilon_high=eps_max, num_generations=n,
                per_device_train_batch_size=B, report_to=[], use_cpu=True, max_completion_length=T,
            )  # fmt: skip
        x = inputs(1100 + i, B=B, T=T, dtype=torch.float64 if dt == "f64" else torch.float32)
        for k in ("old_values", "values", "entropy"):
            x.pop(k)
        m = x["response_mask"]
        # the log-ratio l − l^old scaled by `spread`: tokens below 1 − 0.2 and above the cap
        lp = x["old_logprobs"] + spread * (x["logprobs"] - x["old_logprobs"])
        x["logprobs"] = torch.where(m.bool(), lp, x["logprobs"])
        x["scores"] = x["scores"] / 4.0
        x["group_index"] = torch.arange(B, dtype=torch.int64) // n
        adv = trl_advantages(grpo_trainer, _advantage_block(cls), x["scores"], cfg.scale_rewards, n)
        leaf = x["logprobs"].clone().requires_grad_(True)
        logged: dict[str, Any] = {k: collections.defaultdict(list) for k in ("train", "eval")}
        loss, _ = trl_loss(
            cls, x, adv, cfg.loss_type, cfg.beta, logged, leaf=leaf, epsilon_high=cfg.epsilon_high
        )
        (clip_ratio,) = logged["train"]["cispo_clip_ratio"]  # TRL's own logged float
        (g_lp,) = torch.autograd.grad(loss, (leaf,))
        dump: dict[str, Any] = dict(x)
        dump.update(
            advantages=torch.where(m.bool(), adv.unsqueeze(1) * m, 0.0 * m), loss=loss.detach(),
            pg_loss=loss.detach(), grad_logprobs=torch.where(m.bool(), g_lp, 0.0),
            pg_clipfrac=torch.tensor(clip_ratio, dtype=torch.float64),
        )  # fmt: skip
        hp = dict(HP, gamma=1.0, lam=1.0, kl_coef=0.0, cliprange=1.0, cliprange_high=cfg.epsilon_high - 1.0)
        hp.update(world_size=1, micro_batches=1, clipfrac_counts=COUNTS)
        made.append(save(out, f"trl1160_cispo_{eps_max}_{dt}", dump, hp, SET, {"policy_loss": "vanilla"}))
    return made
