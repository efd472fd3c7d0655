"""TRL 1.12.0 containers for ``tools/peers adapters`` (see :mod:`peers.makers.adapters`).

Two ``PPOTrainer.train`` steps (:func:`refppo.capture.adapters.trl.trace_ppo_step`) and one
``GRPOTrainer`` loss with vLLM's importance-sampling correction (:func:`_grpo_case`): a
``GRPOConfig`` with ``use_vllm``, ``vllm_importance_sampling_mode="token_truncate"``, ``clip_max=2``;
the advantages from TRL's own block (:func:`peers.makers.trl_grpo.trl_advantages`); the IS ratio from
TRL's own lines of ``_generate_and_score_completions``
(:func:`peers.rollout_correction_side.trl_is_ratio`); ``_compute_loss`` with ``backward`` on the
``per_token_logps`` leaf. The inputs it read go through
:func:`refppo.capture.adapters.trl_grpo.from_trl_grpo`, the config through ``trl_grpo_hparams``.
"""

from __future__ import annotations

import types
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
    made.append(_grpo_case(out, v2))
    return made


def _grpo_case(out: Path, v2: bool) -> dict[str, Any]:
    """TRL GRPOTrainer's loss with the behaviour log-probs and the token-truncate IS correction."""
    import sys
    import tempfile

    import torch

    from peers.makers.common import inputs
    from peers.makers.trl_grpo import EPS_HIGH, _advantage_block, trl_advantages, trl_loss
    from peers.rollout_correction_side import trl_is_ratio
    from peers.stubs import StubFinder
    from refppo.capture.adapters.trl_grpo import from_trl_grpo, trl_grpo_hparams

    sys.meta_path.insert(0, StubFinder(("requests", "urllib3")))  # TRL's vLLM client only
    from trl import GRPOConfig  # type: ignore[import-not-found]  # trl venv only
    from trl.trainer import grpo_trainer  # type: ignore[import-not-found]  # trl venv only

    n, B, T = 4, 12, 10
    with tempfile.TemporaryDirectory() as tmp:
        cfg = GRPOConfig(
            output_dir=tmp, loss_type="dapo", beta=0.0, epsilon_high=EPS_HIGH, num_generations=n,
            per_device_train_batch_size=B, report_to=[], use_cpu=True, max_completion_length=T,
            use_vllm=True, vllm_importance_sampling_correction=True,
            vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=2.0,
        )  # fmt: skip
    x = inputs(950, B=B, T=T)
    m = x["response_mask"]
    g = torch.Generator().manual_seed(951)
    beh = x["old_logprobs"] - 0.6 * torch.randn(m.shape, generator=g, dtype=m.dtype)
    x["rollout_logprobs"] = torch.where(m.bool(), beh, torch.full_like(beh, 7.5))
    scores = x["scores"] / 4.0
    cls = grpo_trainer.GRPOTrainer
    adv = trl_advantages(grpo_trainer, _advantage_block(cls), scores, cfg.scale_rewards, n)
    me = types.SimpleNamespace(
        use_vllm=True, vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=cfg.vllm_importance_sampling_mode,
        vllm_importance_sampling_clip_min=cfg.vllm_importance_sampling_clip_min,
        vllm_importance_sampling_clip_max=cfg.vllm_importance_sampling_clip_max,
    )  # fmt: skip
    ratio = trl_is_ratio(me, m.long(), x["old_logprobs"], x["rollout_logprobs"])
    lp = x["logprobs"].clone().requires_grad_(True)
    loss, batch = trl_loss(cls, x, adv, cfg.loss_type, cfg.beta, is_ratio=ratio, leaf=lp)
    loss.backward()
    dump = from_trl_grpo(batch, scores=scores, num_generations=n, logprobs=lp, loss=loss, pg_loss=loss)
    hp, conv = trl_grpo_hparams(cfg)
    bad_adv = dict(dump, advantages=corrupt(dump["advantages"], m))
    same = dict(dump, rollout_logprobs=dump["old_logprobs"].clone())  # every weight 1: the loss must move
    controls = [(bad_adv, "advantages"), (same, "pg_loss")]
    return save_case(out, "trl_grpo_dapo_vllm_token_truncate2", dump, controls, (hp, conv), v2)
