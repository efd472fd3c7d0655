"""The peers' half of ``tools/peers rollout_correction`` (side venvs; no refppo import).

Each function gets the batch of :func:`peers.rollout_correction.make_batch` and returns, for every
case of :mod:`peers.rollout_correction`'s tables, the peer's own outputs keyed ``CASE/QUANTITY``:
weights and kept masks, losses, ``∂loss/∂logp`` (the current log-probs a leaf), clip fractions.
"""

from __future__ import annotations

import inspect
import math
import os
import sys
import textwrap
import types
from typing import Any

from peers import rollout_correction as rc

# ------------------------------------------------------------------------------------------------
# verl 0.9.1 and OpenRLHF 0.11.2 (venv verl-openrlhf)
# ------------------------------------------------------------------------------------------------


def peer_setup() -> None:
    from peers.stubs import install_stubs

    install_stubs()
    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")


def _leaf(x: dict[str, Any]) -> Any:
    return x["cur"].clone().requires_grad_(True)


def _record(out: dict[str, Any], key: str, loss: Any, lp: Any, clipfrac: float | None = None) -> None:
    import torch

    loss.backward()
    out[key + "/loss"], out[key + "/grad"] = loss.detach(), lp.grad
    if clipfrac is not None:
        out[key + "/clipfrac"] = torch.tensor(clipfrac, dtype=torch.float64)


def peer_verl(x: dict[str, Any]) -> dict[str, Any]:
    from peers.stubs import mount

    mount("verl")
    from verl.trainer.ppo import core_algos as ca  # type: ignore[import-not-found]  # side venv only
    from verl.trainer.ppo import rollout_corr_helper as rch

    out: dict[str, Any] = {}
    lr, m = x["prox"] - x["beh"], x["mask"]
    for level, thr in rc.VERL_WEIGHTS:
        w, _ = rch.compute_rollout_correction_weights(lr, m, rollout_is=level, rollout_is_threshold=thr)
        out[rc.verl_weights_key(level, thr) + "/weight"] = w
    for opt, thr in rc.VERL_RS:
        keep, _ = rch.compute_rollout_rejection_mask(lr, m, rollout_rs=opt, rollout_rs_threshold=thr)
        out[rc.verl_rs_key(opt, thr) + "/keep"] = keep
    _verl_losses(ca, x, out)
    return out


def _verl_config(bypass: bool = False) -> Any:
    from verl.trainer.config.algorithm import RolloutCorrectionConfig  # type: ignore[import-not-found]
    from verl.workers.config import ActorConfig  # type: ignore[import-not-found]  # side venv only
    from verl.workers.config.actor import PolicyLossConfig  # type: ignore[import-not-found]

    kw: dict[str, Any] = {}
    if bypass:
        corr = RolloutCorrectionConfig(
            rollout_is="token", rollout_is_threshold=rc.BYPASS_CAP, loss_type="reinforce", bypass_mode=True
        )
        kw["policy_loss"] = PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=corr)
    return ActorConfig(
        strategy="fsdp", clip_ratio=rc.EPS_LO, clip_ratio_low=rc.EPS_LO, clip_ratio_high=rc.EPS_HI,
        ppo_micro_batch_size_per_gpu=1, rollout_n=1, **kw,
    )  # fmt: skip


def _verl_losses(ca: Any, x: dict[str, Any], out: dict[str, Any]) -> None:
    m, cfg = x["mask"], _verl_config()
    for (level, thr), agg in rc.verl_weighted_cases():
        lp, w = _leaf(x), out[rc.verl_weights_key(level, thr) + "/weight"]
        loss, met = ca.compute_policy_loss_vanilla(
            x["prox"], lp, x["adv"], m, loss_agg_mode=agg, config=cfg, rollout_is_weights=w
        )
        _record(out, rc.verl_weighted_key(level, thr, agg), loss, lp, met["actor/pg_clipfrac"])
    for (opt, thr), agg in rc.verl_drop_cases():
        lp, keep = _leaf(x), out[rc.verl_rs_key(opt, thr) + "/keep"]
        loss, met = ca.compute_policy_loss_vanilla(
            x["prox"], lp, x["adv"], keep, loss_agg_mode=agg, config=cfg
        )
        _record(out, rc.verl_drop_key(opt, thr, agg), loss, lp, met["actor/pg_clipfrac"])
    for weighted, agg in rc.verl_cispo_cases():
        lp = _leaf(x)
        w = out[rc.verl_weights_key("token", 2.0) + "/weight"] if weighted else None
        loss, met = ca.compute_policy_loss_cispo(
            x["prox"], lp, x["adv"], m, loss_agg_mode=agg, config=cfg, rollout_is_weights=w
        )
        _record(out, rc.verl_cispo_key(weighted, agg), loss, lp, met["actor/pg_clipfrac"])
    bypass = _verl_config(bypass=True)
    for agg in rc.AGGS_BYPASS:
        lp = _leaf(x)
        loss, _ = ca.compute_policy_loss_bypass_mode(
            x["beh"], lp, x["adv"], m, loss_agg_mode=agg, config=bypass
        )
        _record(out, rc.verl_bypass_key(agg), loss, lp)


def peer_openrlhf(x: dict[str, Any]) -> dict[str, Any]:
    from peers.stubs import mount

    for n in ("openrlhf", "openrlhf.models", "openrlhf.utils"):
        mount(n)
    from openrlhf.models.loss import PolicyLoss  # type: ignore[import-not-found]  # side venv only

    out: dict[str, Any] = {}
    for level, mode, bounds, token_level, dual in rc.OPENRLHF:
        fn = PolicyLoss(
            clip_eps_low=rc.EPS_LO, clip_eps_high=rc.EPS_HI, dual_clip=dual, token_level_loss=token_level,
            is_correction_level=level, is_correction_mode=mode, is_correction_threshold=list(bounds),
        )  # fmt: skip
        lp = _leaf(x)
        loss, *_ = fn(lp, x["prox"], x["adv"], action_mask=x["mask"], rollout_log_probs=x["beh"])
        _record(out, rc.openrlhf_key(level, mode, bounds, token_level, dual), loss, lp)
    return out


# ------------------------------------------------------------------------------------------------
# AReaL 1.0.4 and SkyRL-train 0.3.1 (venv skyrl-areal)
# ------------------------------------------------------------------------------------------------


def areal_setup() -> None:
    from peers.stubs import install_stubs

    install_stubs(extra=("areal.infra", "areal.experimental", "transformers"))


def peer_areal(x: dict[str, Any]) -> dict[str, Any]:
    from peers.stubs import mount

    mount("areal")
    from areal.api.cli_args import RejectionSamplingConfig  # type: ignore[import-not-found]  # side venv
    from areal.utils.functional import ppo_actor_loss_fn  # type: ignore[import-not-found]  # side venv

    out: dict[str, Any] = {}
    for case in rc.AREAL:
        level, action, metric, agg, lower, upper, c_clip = case
        cfg = RejectionSamplingConfig(
            level=level, action=action, metric=metric, agg=agg, upper=upper, lower=lower
        )
        lp = _leaf(x)
        loss, stat = ppo_actor_loss_fn(
            lp, x["prox"], x["beh"], x["adv"], rc.EPS_LO, x["mask"].bool(), eps_clip_higher=rc.EPS_HI,
            c_clip=c_clip, rejection_sampling=cfg,
        )  # fmt: skip
        key = rc.areal_key(case)
        _record(out, key, loss, lp)
        out[key + "/weight"] = stat["behave_imp_weight"]
    return out


def peer_skyrl(x: dict[str, Any]) -> dict[str, Any]:
    from peers.stubs import mount

    mount("skyrl_train")
    mount("skyrl_train.utils")
    from skyrl_train.utils import ppo_utils as pu  # type: ignore[import-not-found]  # side venv only

    out: dict[str, Any] = {}
    for kind, reduction, cap in rc.SKYRL:
        cfg = types.SimpleNamespace(
            policy_loss_type=kind, loss_reduction=reduction, eps_clip_low=rc.EPS_LO, eps_clip_high=rc.EPS_HI,
            clip_ratio_c=rc.DUAL, use_tis=cap is not None, tis_imp_ratio_cap=cap, max_seq_len=rc.T,
            cispo=types.SimpleNamespace(cispo_eps_clip_low=rc.EPS_LO, cispo_eps_clip_high=rc.EPS_HI),
        )  # fmt: skip
        lp = _leaf(x)
        fn = pu.compute_policy_loss_cispo if kind == "cispo" else pu.ppo_policy_loss
        loss, clip_ratio = fn(lp, x["prox"], x["adv"], cfg, loss_mask=x["mask"], rollout_logprobs=x["beh"])
        _record(out, rc.skyrl_key(kind, reduction, cap), loss, lp, clip_ratio)
    return out


# ------------------------------------------------------------------------------------------------
# TRL 1.16.0 (venv trl-grpo)
# ------------------------------------------------------------------------------------------------


def trl_is_ratio(self: Any, completion_mask: Any, old: Any, sampling: Any) -> Any:
    """TRL's own lines computing ``vllm_importance_sampling_ratio``, cut from the installed
    ``GRPOTrainer._generate_and_score_completions`` (from ``if self.use_vllm and
    self.vllm_importance_sampling_correction:`` to the reference-model comment) and run as they are."""
    import torch
    from trl.trainer.grpo_trainer import GRPOTrainer  # type: ignore[import-not-found]  # trl venv only

    src = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    start = src.index(
        "            if self.use_vllm and self.vllm_importance_sampling_correction:\n                mask"
    )
    end = src.index("            # Compute the per-token log probabilities for the reference model", start)
    scope = {
        "self": self,
        "completion_mask": completion_mask,
        "tool_mask": None,
        "torch": torch,
        "math": math,
    }
    scope |= {"old_per_token_logps": old, "sampling_per_token_logps": sampling}
    exec(compile(textwrap.dedent(src[start:end]), "<trl GRPOTrainer IS ratio>", "exec"), scope)
    return scope["vllm_importance_sampling_ratio"]


def peer_trl(x: dict[str, Any]) -> dict[str, Any]:
    import torch

    from peers.stubs import StubFinder
    from peers.trl_grpo import _Accelerator

    sys.meta_path.insert(0, StubFinder(("requests", "urllib3")))
    from trl.trainer.grpo_trainer import GRPOTrainer

    out: dict[str, Any] = {}
    for case in rc.TRL:
        lt, mode, (cmin, cmax), beta = case
        me = types.SimpleNamespace(
            use_vllm=True, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
            vllm_importance_sampling_clip_min=cmin, vllm_importance_sampling_clip_max=cmax,
        )  # fmt: skip
        ratio = trl_is_ratio(me, x["mask"], x["prox"], x["beh"])
        lp = _leaf(x)
        me.__dict__.update(
            _get_per_token_logps_and_entropies=lambda *a, _lp=lp, **k: (_lp, torch.zeros_like(_lp), None),
            top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
            beta=beta, loss_type=lt, epsilon_low=rc.EPS_LO, epsilon_high=rc.trl_eps_high(lt),
            model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
            max_completion_length=rc.T, accelerator=_Accelerator(), _entropy_bonus_enabled=False,
            args=types.SimpleNamespace(use_bias_correction_kl=True, delta=None, steps_per_generation=1),
            _metrics={"train": _metrics(), "eval": _metrics()}, aux_loss_enabled=False,
            use_adaptive_entropy=False,
        )  # fmt: skip
        long = torch.long
        inputs = {
            "prompt_ids": torch.zeros(rc.B, 2, dtype=long), "prompt_mask": torch.ones(rc.B, 2, dtype=long),
            "completion_ids": torch.zeros(rc.B, rc.T, dtype=long), "completion_mask": x["mask"],
            "advantages": x["adv"], "old_per_token_logps": x["prox"], "ref_per_token_logps": x["ref"],
            "importance_sampling_ratio": ratio, "num_items_in_batch": x["mask"].sum(),
        }  # fmt: skip
        loss = GRPOTrainer._compute_loss(me, None, inputs)
        key = rc.trl_key(case)
        _record(out, key, loss, lp)
        out[key + "/weight"] = ratio.expand(rc.B, rc.T) * x["mask"]
    return out


def _metrics() -> Any:
    import collections

    return collections.defaultdict(list)
