"""TRL 1.12.0 containers for ``tools/peers adapters`` (see :mod:`peers.makers.adapters`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peers.makers.adapters import corrupt, save_case


def make(out: Path, v2: bool) -> list[dict[str, Any]]:
    from peers.makers.trl_ppo import CASES, build_trainer
    from refppo.capture.adapters.trl import trace_ppo_step, trl_hparams

    made = []
    for case in ("ragged", "ragged_k3_epoch2"):
        spec = CASES[case]
        trainer, conf = build_trainer(spec)
        dump = trace_ppo_step(trainer, epoch=int(spec["capture_epoch"]))
        control = dict(dump, token_rewards=corrupt(dump["token_rewards"], dump["response_mask"]))
        made.append(save_case(out, f"trl_{case}", dump, [(control, "token_rewards")], trl_hparams(conf), v2))
    return made
