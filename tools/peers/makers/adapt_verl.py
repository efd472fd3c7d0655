"""verl 0.9.1 containers for ``tools/peers adapters`` (see :mod:`peers.makers.adapters`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from peers.makers.adapters import corrupt, save_case
from peers.makers.common import inputs, install_stubs, mount

# (name, use_kl_in_reward, kl_penalty, use_kl_loss, kl_loss_type, loss_agg_mode, clip low/high, c,
#  entropy_coeff, micro-batch row splits)
VERL_CASES: list[dict[str, Any]] = [
    {"name": "verl_token-mean_klreward_2mb", "kl_reward": "kl", "agg": "token-mean", "splits": (3, 8)},
    {
        "name": "verl_seq-mean-token-mean_klloss_2mb",
        "kl_loss": "low_var_kl",
        "agg": "seq-mean-token-mean",
        "clip": (0.2, 0.28),
        "c": 2.0,
        "ent": 0.01,
        "splits": (5, 8),
    },
    {"name": "verl_token-sum_mse_1mb", "kl_reward": "mse", "agg": "token-sum", "splits": (8,)},
    # the engine's rollout_log_probs in the DataProto, verl's rollout correction (TIS at 2.0) through
    # rollout_corr_helper.compute_rollout_correction_and_add_to_batch into ppo_loss
    {
        "name": "verl_token-mean_klreward_tis2_2mb",
        "kl_reward": "kl",
        "agg": "token-mean",
        "splits": (3, 8),
        "rollout_correction": {"rollout_is": "token", "rollout_is_threshold": 2.0},
    },
    {
        "name": "verl_seq-mean-token-mean_klloss_icepop_2mb",
        "kl_loss": "low_var_kl",
        "agg": "seq-mean-token-mean",
        "splits": (5, 8),
        "rollout_correction": {"rollout_is": "token", "rollout_is_threshold": "0.5_2.0"},
    },
]
"""Each case's verl settings (keys read by :func:`_verl_container`); ``rollout_correction`` adds the
behaviour log-probs ``old_log_probs − 0.6·N(0, 1)`` (weights on both sides of every bound)."""


def _verl_import() -> dict[str, Any]:
    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
    install_stubs(extra=("pandas", "cachetools"))
    mount("verl")
    from verl.protocol import DataProto  # type: ignore[import-not-found]  # side venv only

    sys.modules["verl"].__dict__["DataProto"] = DataProto  # verl/__init__.py's export (not run: mounted)
    from verl.trainer.config.algorithm import AlgoConfig  # type: ignore[import-not-found]
    from verl.trainer.ppo import core_algos, ray_trainer, rollout_corr_helper  # type: ignore[import-not-found]
    from verl.utils import tensordict_utils as tu  # type: ignore[import-not-found]
    from verl.workers.config import ActorConfig, CriticConfig  # type: ignore[import-not-found]
    from verl.workers.utils.losses import ppo_loss, value_loss  # type: ignore[import-not-found]

    return dict(
        DataProto=DataProto,
        AlgoConfig=AlgoConfig,
        ca=core_algos,
        rt=ray_trainer,
        tu=tu,
        ActorConfig=ActorConfig,
        CriticConfig=CriticConfig,
        ppo_loss=ppo_loss,
        value_loss=value_loss,
        rch=rollout_corr_helper,
    )


def _no_padding(x: Any, mask: Any, prompt_len: int) -> Any:
    """verl's no-padding model output: per row ``prompt_len + L`` slots, the response's values at
    ``prompt_len - 1 … prompt_len + L - 2`` (``workers/utils/padding.py::no_padding_2_padding``
    reads them there: the output at position i scores token i + 1)."""
    import torch

    segs = []
    for b in range(x.shape[0]):
        n = int(mask[b].sum())
        z = x.new_zeros(prompt_len - 1)
        segs.append(torch.cat([z, x[b, :n], x.new_zeros(1)]))
    return torch.cat(segs)


def _verl_container(v: dict[str, Any], case: dict[str, Any], seed: int) -> tuple[Any, dict[str, Any], Any]:
    import torch

    x = inputs(seed)
    m = x["response_mask"]
    B, T = m.shape
    P = 4
    g = torch.Generator().manual_seed(seed)
    last = (m.sum(dim=1) - 1).long()
    scores = torch.zeros_like(m)
    scores[torch.arange(B), last] = x["scores"]
    data = v["DataProto"].from_dict(
        tensors={
            "prompts": torch.randint(3, 60, (B, P), generator=g),
            "responses": torch.randint(3, 60, (B, T), generator=g),
            "attention_mask": torch.cat([torch.ones(B, P, dtype=torch.long), m.long()], dim=1),
            "response_mask": m,
            "old_log_probs": x["old_logprobs"],
            "ref_log_prob": x["ref_logprobs"],
            "values": x["old_values"],
            "token_level_scores": scores,
        }
    )
    config = {
        "algorithm": {
            "gamma": 0.99,
            "lam": 0.95,
            "use_kl_in_reward": "kl_reward" in case,
            "kl_penalty": case.get("kl_reward", "kl"),
            "kl_ctrl": {"kl_coef": 0.05},
        },
        "actor_rollout_ref": {
            "actor": {
                "clip_ratio": case.get("clip", (0.2, 0.2))[0],
                "clip_ratio_low": case.get("clip", (0.2, 0.2))[0],
                "clip_ratio_high": case.get("clip", (0.2, 0.2))[1],
                "clip_ratio_c": case.get("c", 3.0),
                "loss_agg_mode": case["agg"],
                "entropy_coeff": case.get("ent", 0.0),
                "use_kl_loss": "kl_loss" in case,
                "kl_loss_type": case.get("kl_loss", "low_var_kl"),
                "kl_loss_coef": 0.05,
            }
        },
        "critic": {"cliprange_value": 0.5, "loss_agg_mode": case["agg"]},
    }
    kl = None
    if "kl_reward" in case:
        data, _ = v["rt"].apply_kl_penalty(
            data, kl_ctrl=v["ca"].FixedKLController(0.05), kl_penalty=case["kl_reward"]
        )
        kl = v["ca"].kl_penalty(x["old_logprobs"], x["ref_logprobs"], kl_penalty=case["kl_reward"])
    else:
        data.batch["token_level_rewards"] = data.batch["token_level_scores"]  # RayPPOTrainer.fit
    algo = v["AlgoConfig"](gamma=0.99, lam=0.95, adv_estimator="gae")
    gae = v["ca"].AdvantageEstimator.GAE
    data = v["rt"].compute_advantage(data, adv_estimator=gae, gamma=0.99, lam=0.95, config=algo)
    data = _with_correction(v, data, x, g, case, config)
    return data, {"x": x, "kl": kl, "P": P}, config


def _with_correction(
    v: dict[str, Any], data: Any, x: dict[str, Any], g: Any, case: dict[str, Any], config: dict[str, Any]
) -> Any:
    """With the case's ``rollout_correction`` (also put in ``config``): the engine's log-probs
    (``old − 0.6·N(0, 1)``, junk on padding) as ``rollout_log_probs``, then verl's own
    ``compute_rollout_correction_and_add_to_batch`` (``rollout_is_weights`` into the batch)."""
    import torch

    if "rollout_correction" not in case:
        return data
    rc = case["rollout_correction"]
    config["algorithm"]["rollout_correction"] = dict(rc)
    m = x["response_mask"]
    beh = x["old_logprobs"] - 0.6 * torch.randn(m.shape, generator=g, dtype=m.dtype)
    data.batch["rollout_log_probs"] = torch.where(m.bool(), beh, torch.full_like(beh, 7.5))
    data, _ = v["rch"].compute_rollout_correction_and_add_to_batch(data, rc)
    assert "rollout_is_weights" in data.batch and torch.equal(data.batch["response_mask"], m)
    return data


def _verl_update(
    v: dict[str, Any],
    data: Any,
    extra: dict[str, Any],
    config: dict[str, Any],
    case: dict[str, Any],
    global_info: bool = True,
) -> dict[str, Any]:
    """verl's own losses on the batch, micro-batch by micro-batch; returns the adapter's kwargs."""
    import torch

    x, P = extra["x"], extra["P"]
    actor_cfg, critic_cfg = _verl_configs(v, config)
    m = data.batch["response_mask"]
    B = m.shape[0]
    lp = x["logprobs"].clone().requires_grad_(True)
    vp = x["values"].clone().requires_grad_(True)
    metrics: dict[str, Any] = {}
    loss = torch.zeros((), dtype=lp.dtype)
    micro = torch.zeros(B, dtype=torch.long)
    start = 0
    for i, end in enumerate(case["splits"]):
        rows = torch.arange(start, end)
        micro[rows] = i
        td = data.batch[start:end]
        if global_info:  # what FSDPEngine.forward_backward_batch and the trainer assign
            v["tu"].assign_non_tensor(td, dp_size=1, batch_num_tokens=int(m.sum()), global_batch_size=B)
        else:  # agg_loss's fallback: each micro-batch normalised by its own counts
            v["tu"].assign_non_tensor(td, dp_size=1, batch_num_tokens=None, global_batch_size=None)
        out = {
            "log_probs": _no_padding(lp[rows], m[rows], P),
            "entropy": _no_padding(x["entropy"][rows], m[rows], P),
        }
        pl, pm = v["ppo_loss"](actor_cfg, out, td)
        pl.backward()
        loss = loss + pl.detach()
        vl, vm = v["value_loss"](critic_cfg, {"values": _no_padding(vp[rows], m[rows], P)}, td)
        vl.backward()
        for k, val in {**pm, **vm}.items():
            if hasattr(val, "aggregate"):
                metrics.setdefault(k, val.init_list()).append(val)
            else:
                metrics.setdefault(k, []).append(val)
        start = end
    return {
        "metrics": _exact_for_the_step(metrics),
        "all_metrics": metrics,
        "logprobs": lp,
        "values": vp,
        "entropy": x["entropy"],
        "kl": extra["kl"],
        "loss": loss,
        "micro_batch": micro,
    }


def _verl_configs(v: dict[str, Any], config: dict[str, Any]) -> tuple[Any, Any]:
    """verl's own ``ActorConfig`` and ``CriticConfig`` from the case's trainer ``config`` (FSDP, one
    rollout per prompt, micro-batches of 4 rows, no dynamic batch size)."""
    a = config["actor_rollout_ref"]["actor"]
    actor_cfg = v["ActorConfig"](
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=4,
        use_dynamic_bsz=False,
        clip_ratio=a["clip_ratio"],
        clip_ratio_low=a["clip_ratio_low"],
        clip_ratio_high=a["clip_ratio_high"],
        clip_ratio_c=a["clip_ratio_c"],
        loss_agg_mode=a["loss_agg_mode"],
        entropy_coeff=a["entropy_coeff"],
        use_kl_loss=a["use_kl_loss"],
        kl_loss_type=a["kl_loss_type"],
        kl_loss_coef=a["kl_loss_coef"],
    )
    critic_cfg = v["CriticConfig"](
        strategy="fsdp",
        ppo_micro_batch_size_per_gpu=4,
        use_dynamic_bsz=False,
        cliprange_value=config["critic"]["cliprange_value"],
        loss_agg_mode=config["critic"]["loss_agg_mode"],
    )
    return actor_cfg, critic_cfg


def _exact_for_the_step(metrics: dict[str, Any]) -> dict[str, Any]:
    """The merged metrics that are exact for the whole step: those of one micro-batch, or summed.

    With several micro-batches verl's clip fractions and ``ppo_kl`` are means of per-micro-batch
    values, which the adapter refuses (not the step's value)."""
    return {
        k: val
        for k, val in metrics.items()
        if len(val.values if hasattr(val, "values") else val) == 1
        or str(getattr(getattr(val, "aggregation", None), "value", "")) == "sum"
    }


def make(out: Path, v2: bool) -> list[dict[str, Any]]:
    from refppo.capture.adapters.verl import from_verl, verl_hparams

    v = _verl_import()
    made = []
    for i, case in enumerate(VERL_CASES):
        data, extra, config = _verl_container(v, case, 300 + i)
        kw = _verl_update(v, data, extra, config, case)
        all_metrics = kw.pop("all_metrics")
        if len(case["splits"]) > 1:  # the adapter must refuse a mean over micro-batches
            try:
                from_verl(data, all_metrics, **{k: val for k, val in kw.items() if k != "metrics"})
            except ValueError as exc:
                if (
                    "actor/pg_clipfrac" not in str(exc)
                    and "ppo_kl" not in str(exc)
                    and "vf_clipfrac" not in str(exc)
                ):
                    raise
            else:
                raise AssertionError("from_verl took a clip fraction averaged over micro-batches")
        dump = from_verl(data, kw.pop("metrics"), **kw)
        controls = []
        if v2 and len(case["splits"]) > 1:  # verl's losses without the global batch info
            local = _verl_update(v, data, extra, config, case, global_info=False)
            keys = ("logprobs", "values", "micro_batch")
            controls.append((from_verl(data, None, **{k: local[k] for k in keys}), "grad_logprobs"))
        data.batch["advantages"] = corrupt(data.batch["advantages"], data.batch["response_mask"])
        control = from_verl(
            data, None, logprobs=kw["logprobs"], values=kw["values"], micro_batch=kw["micro_batch"]
        )
        hp, conv = verl_hparams(config)
        hp["micro_batches"] = len(case["splits"])  # dump v2: K per rank per optimizer step
        controls.append((control, "advantages"))
        if "rollout_correction" in case:  # behaviour := proximal (every weight 1): the loss must move
            same = {**dump, "rollout_logprobs": dump["old_logprobs"].clone()}
            controls.append((same, "pg_loss"))
        made.append(save_case(out, case["name"], dump, controls, (hp, conv), v2))
    return made
