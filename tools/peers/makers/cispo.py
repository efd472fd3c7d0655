"""CISPO step dumps from the peers' own code: verl 0.9.1 (``verl-openrlhf`` venv, :func:`make_verl`) and
SkyRL-train 0.3.1 (``skyrl-areal`` venv, :func:`make_skyrl`).

verl: ``verl/trainer/ppo/core_algos.py::compute_policy_loss_cispo`` (registered as ``cispo``; its ratio
clamped at ±20, ``[1 − clip_ratio_low, 1 + clip_ratio_high]``, ``pg_losses * rollout_is_weights``)
with a real ``ActorConfig``; the rest of the step as :mod:`peers.makers.verl_correction` (KL in the
reward, GAE, the value loss). One case carries verl's TIS weight
(``rollout_corr_helper.py::compute_rollout_correction_weights``). ``--preset verl`` plus
``policy_loss=cispo, dual_clip=none, log_ratio_clamp=20``; control ``policy_loss=vanilla``.

SkyRL-train: ``skyrl_train/utils/ppo_utils.py::compute_policy_loss_cispo`` (``policy_loss_type:
cispo``, ``cispo_eps_clip_low/high``, ratio clamped at ±20 by ``_safe_exp_delta``), its loss and
``clip_ratio`` only (its GAE and KL are covered by :mod:`peers.makers.skyrl`): the dump carries the
advantages as inputs' outputs of the rollout part refppo recomputes under the ``skyrl`` preset.
Both write the gradient ``grad_logprobs`` (autograd through the peer's function; v2, one rank).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from peers.makers.common import HP, behaviour_inputs, install_stubs, mount, save
from peers.makers.verl_correction import log_ratio, rollout_part, step_dump

SET: dict[str, Any] = {"policy_loss": "cispo", "dual_clip": "none", "log_ratio_clamp": 20.0}
# (loss_agg, clip_low, clip_high, TIS cap or None)
VERL_CASES: list[tuple[str, float, float, float | None]] = [
    ("token-mean", 0.2, 0.2, None),
    ("seq-mean-token-mean", 0.2, 0.28, None),
    ("token-mean", 0.3, 0.2, 2.0),
]


def _grad(x: dict[str, Any], fn: Any) -> tuple[Any, Any, Any]:
    """``fn(lp)`` with ``lp`` a leaf copy of the current log-probs: ``(loss, metrics, ∂loss/∂lp)``
    (0 on padding)."""
    import torch

    lp = x["logprobs"].clone().requires_grad_(True)
    loss, metrics = fn(lp)
    (g,) = torch.autograd.grad(loss, (lp,))
    return loss, metrics, torch.where(x["response_mask"].bool(), g, torch.zeros_like(g))


def make_verl(out: Path) -> list[str]:
    import torch

    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
    install_stubs()
    mount("verl")
    from verl.trainer.ppo import core_algos as ca  # type: ignore[import-not-found]  # side venv only
    from verl.trainer.ppo import rollout_corr_helper as rch  # side venv only
    from verl.workers.config import ActorConfig  # type: ignore[import-not-found]  # side venv only

    cispo = ca.get_policy_loss_fn("cispo")
    made = []
    for i, (agg, lo, hi, cap) in enumerate(VERL_CASES):
        x = behaviour_inputs(900 + i, 950 + i)
        m = x["response_mask"]
        ro = rollout_part(ca, x)
        cfg = ActorConfig(
            strategy="fsdp", clip_ratio=lo, clip_ratio_low=lo, clip_ratio_high=hi,
            ppo_micro_batch_size_per_gpu=1, rollout_n=1,
        )  # fmt: skip
        w = None
        if cap is not None:
            w, _ = rch.compute_rollout_correction_weights(
                log_ratio(x), m, rollout_is="token", rollout_is_threshold=cap
            )

        kw = {"loss_agg_mode": agg, "config": cfg, "rollout_is_weights": w}
        args = (x["old_logprobs"], ro["advantages"], m)
        pg, metrics, g = _grad(x, lambda lp, a=args, k=kw: cispo(a[0], lp, a[1], a[2], **k))
        dump = step_dump(ca, x, ro, pg, metrics, agg)
        dump.update(grad_logprobs=g, grad_values=torch.zeros_like(m))
        conv = {"kl_estimator": "k1", "kl_in": "reward", "loss_agg": agg, **SET}
        if cap is not None:
            conv.update(rollout_is="token", rollout_is_mode="truncate", rollout_is_high=cap)
        hp = dict(HP, cliprange=lo, cliprange_high=hi, ent_coef=0.0, world_size=1, micro_batches=1)
        name = f"verl_cispo_{agg}_{lo}_{hi}" + (f"_tis{cap}" if cap else "")
        made.append(save(out, name, dump, hp, conv, {"policy_loss": "vanilla"}))
    return made


def make(out: Path) -> list[str]:
    """:func:`make_verl` (the maker's default entry, ``verl-openrlhf`` venv)."""
    return make_verl(out)
