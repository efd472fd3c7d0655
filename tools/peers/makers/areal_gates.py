"""AReaL 1.0.4 decoupled-PPO dumps whose behaviour weight is gated by a non-ratio metric or a
non-mean aggregation (``skyrl-areal`` venv): the rejection gates ``rollout_rs*``.

``areal/utils/functional/functional.py::ppo_actor_loss_fn`` with ``rejection_sampling``
(``RejectionSamplingConfig``: ``metric`` kl_k1 / kl_k2 / kl_k3 of ``x = l^prox − l^beh``, or the
ratio reduced by ``agg`` sum / max; ``action: mask``) multiplies the unbounded behaviour ratio (the
token's, or at sequence level with ``metric: ratio`` the row's geometric mean) by the gate's keep
mask, and divides by every valid token (``Rejected.zero``). In refppo's keys: ``rollout_is`` with no
bound (the ratio) plus the gate ``rollout_rs*``, order ``proximal``. The step is
:func:`peers.makers.areal_decoupled.decoupled_step` (AReaL's own functions; v2, the gradient by
autograd through AReaL's loss; ``pg_clipfrac`` AReaL's logged ``clip_ratio``, ``clipfrac_counts=kept``
in the sidecar). Each case's control flips one gate key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peers.makers.areal import HP
from peers.makers.areal_decoupled import COUNTS, behaviour, decoupled_step
from peers.makers.areal_frame import advantages, areal_fns, rolled_batch
from peers.makers.common import inputs, save

RAW_TOKEN: dict[str, Any] = {"rollout_is": "token", "rollout_is_mode": "mask", "rollout_is_high": None}
"""The unbounded token ratio AReaL's gate multiplies."""

# (name, RejectionSamplingConfig kwargs, refppo --set, control)
CASES: list[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]] = [
    (
        "token_kl_k2",
        {"level": "token", "action": "mask", "metric": "kl_k2", "upper": 0.3},
        {**RAW_TOKEN, "rollout_rs": "token", "rollout_rs_stat": "k2", "rollout_rs_high": 0.3},
        {"rollout_rs_stat": "k3"},
    ),
    (
        "sequence_kl_k3_max",
        {"level": "sequence", "action": "mask", "metric": "kl_k3", "agg": "max", "upper": 0.5},
        {**RAW_TOKEN, "rollout_rs": "sequence", "rollout_rs_stat": "k3", "rollout_rs_reduce": "max",
         "rollout_rs_high": 0.5},
        {"rollout_rs_reduce": "mean"},
    ),
    (
        "sequence_kl_k1_sum_band",
        {"level": "sequence", "action": "mask", "metric": "kl_k1", "agg": "sum", "lower": -1.0, "upper": 0.5},
        {**RAW_TOKEN, "rollout_rs": "sequence", "rollout_rs_stat": "k1", "rollout_rs_reduce": "sum",
         "rollout_rs_low": -1.0, "rollout_rs_high": 0.5},
        {"rollout_rs_order": "behaviour"},
    ),
    (
        "sequence_ratio_max",
        {"level": "sequence", "action": "mask", "metric": "ratio", "agg": "max", "upper": 3.0},
        {"rollout_is": "sequence", "rollout_is_agg": "geometric", "rollout_is_mode": "mask",
         "rollout_is_high": None, "rollout_rs": "sequence", "rollout_rs_stat": "ratio",
         "rollout_rs_reduce": "max", "rollout_rs_high": 3.0},
        {"rollout_rs_reduce": "mean"},
    ),
]  # fmt: skip


def make(out: Path) -> list[str]:
    """One v2 dump per case of :data:`CASES`, ``--preset areal`` plus the case's ``--set``."""
    import torch

    fns = areal_fns()
    from areal.api.cli_args import RejectionSamplingConfig  # type: ignore[import-not-found]  # side venv

    made = []
    for i, (name, rs, conv, control) in enumerate(CASES):
        x = behaviour(inputs(720 + i, dtype=torch.float32, full_row=False), 820 + i)
        res = advantages(
            fns, rolled_batch(x, x["response_mask"]), HP, "k1", None, HP["whiten_eps"], (0.0, 1.0, 20.0)
        )
        dump = decoupled_step(fns, RejectionSamplingConfig(**rs), x, res)
        hp = dict(HP, world_size=1, micro_batches=1, **COUNTS)
        made.append(save(out, f"areal_gates_{name}", dump, hp, {"kl_estimator": "k1", **conv}, control))
    return made
