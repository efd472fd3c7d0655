"""Dumps built by ``refppo.capture.adapters`` from the peers' OWN containers (``validate_adapters.py``).

Unlike the other makers, these import refppo (the adapters are what is tested): the runner puts the
repository on ``PYTHONPATH``. Each case builds the peer's container by running the peer's code:

- verl 0.9.1 (``verl-openrlhf`` venv): a ``DataProto`` through ``ray_trainer.apply_kl_penalty`` (or,
  without KL in the reward, ``token_level_rewards = token_level_scores`` as ``RayPPOTrainer.fit``
  does) and ``ray_trainer.compute_advantage(GAE)``; then the update through
  ``verl/workers/utils/losses.py::ppo_loss`` and ``value_loss`` with verl's own ``ActorConfig`` /
  ``CriticConfig``, micro-batch by micro-batch with the global batch info the FSDP engine assigns
  (``dp_size``, ``batch_num_tokens``, ``global_batch_size``), the model output in verl's
  no-padding layout, ``backward`` on each micro-batch's loss (the gradient accumulates on the
  ``[B, T]`` leaves, as in ``forward_backward_batch``), metrics merged with ``Metric.append``.
- OpenRLHF 0.11.2 (same venv): an ``Experience`` as ``make_experience`` leaves it (``kl`` from
  ``compute_approx_kl``; ``base_action_log_probs`` dropped unless ``algo.kl.use_loss``), then
  ``RemoteExperienceMaker.compute_advantages_and_returns`` (the real method, on a stand-in ``self``
  holding ``args``/``kl_ctl``), then ``PolicyLoss``/``ValueLoss``/``aggregate_loss`` with
  ``backward``.
- TRL 1.12.0 (``trl`` venv): ``trace_ppo_step`` around one ``PPOTrainer.train`` of
  ``validate_trl_preset.py``'s tiny set-up.

Each case also writes a control: the same container with one field corrupted (at one valid
position), adapted again; the runner checks that the control mismatches at that quantity.
``v2=False`` (an oracle without dump v2) leaves out the gradients and the ``separate_critic``
sidecar key (``vf_coef = 0``: the v1 rule for a critic with its own optimizer).
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from typing import Any

from peer_makers.common import inputs, install_stubs, mount

V2_KEYS = ("grad_logprobs", "grad_values", "micro_batch", "rank")


def _write(
    out: Path, name: str, tensors: dict[str, Any], hp: dict[str, Any], conv: dict[str, Any], v2: bool
) -> None:
    from refppo.dump import write_dump

    hp = dict(hp)
    if not v2:
        tensors = {k: v for k, v in tensors.items() if k not in V2_KEYS}
        if hp.pop("separate_critic", False):
            hp["vf_coef"] = 0.0
    write_dump(out / f"{name}.safetensors", tensors, hparams=hp)
    (out / f"{name}.set.json").write_text(json.dumps(conv))


def _save_case(
    out: Path,
    name: str,
    dump: dict[str, Any],
    control: dict[str, Any],
    quantity: str,
    side: tuple[Any, Any],
    v2: bool,
) -> dict[str, Any]:
    hp, conv = side
    _write(out, name, dump, hp, conv, v2)
    _write(out, f"{name}.control", control, hp, conv, v2)
    return {"name": name, "control_breaks": quantity, "keys": sorted(dump)}


def _corrupt(t: Any, mask: Any) -> Any:
    """``t`` with 0.5 added at the last valid position of row 0."""
    c = t.detach().clone()
    last = int(mask[0].sum()) - 1
    c[0, last] += 0.5
    return c


# ------------------------------------------------------------------------------------------------ verl

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
]


def _verl_import() -> dict[str, Any]:
    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
    install_stubs(extra=("pandas", "cachetools"))
    mount("verl")
    from verl.protocol import DataProto  # type: ignore[import-not-found]  # side venv only

    sys.modules["verl"].__dict__["DataProto"] = DataProto  # verl/__init__.py's export (not run: mounted)
    from verl.trainer.config.algorithm import AlgoConfig  # type: ignore[import-not-found]
    from verl.trainer.ppo import core_algos, ray_trainer  # type: ignore[import-not-found]
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
    return data, {"x": x, "kl": kl, "P": P}, config


def _verl_update(
    v: dict[str, Any], data: Any, extra: dict[str, Any], config: dict[str, Any], case: dict[str, Any]
) -> dict[str, Any]:
    """verl's own losses on the batch, micro-batch by micro-batch; returns the adapter's kwargs."""
    import torch

    x, P = extra["x"], extra["P"]
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
        v["tu"].assign_non_tensor(td, dp_size=1, batch_num_tokens=int(m.sum()), global_batch_size=B)
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
    # several micro-batches: verl's clip fractions and ppo_kl are means of per-micro-batch values,
    # which the adapter refuses (not the step's value); keep only what is exact for the step
    exact = {
        k: val
        for k, val in metrics.items()
        if len(val.values if hasattr(val, "values") else val) == 1
        or str(getattr(getattr(val, "aggregation", None), "value", "")) == "sum"
    }
    return {
        "metrics": exact,
        "all_metrics": metrics,
        "logprobs": lp,
        "values": vp,
        "entropy": x["entropy"],
        "kl": extra["kl"],
        "loss": loss,
        "micro_batch": micro,
    }


def make_verl(out: Path, v2: bool) -> list[dict[str, Any]]:
    from refppo.capture.adapters import from_verl, verl_hparams

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
        data.batch["advantages"] = _corrupt(data.batch["advantages"], data.batch["response_mask"])
        control = from_verl(data, None, logprobs=kw["logprobs"], values=kw["values"])
        made.append(_save_case(out, case["name"], dump, control, "advantages", verl_hparams(config), v2))
    return made


# ------------------------------------------------------------------------------------------------ OpenRLHF

OPENRLHF_CASES: list[dict[str, Any]] = [
    {"name": "openrlhf_k1_reward_token-mean", "est": "k1", "use_loss": False, "agg": "token-mean"},
    {
        "name": "openrlhf_k3_loss_seq_dual",
        "est": "k3",
        "use_loss": True,
        "agg": "seq-mean-token-mean",
        "eps": (0.2, 0.28),
        "dual": 3.0,
        "ent": 0.01,
    },
]


def _ns(**kw: Any) -> types.SimpleNamespace:
    return types.SimpleNamespace(**kw)


def _openrlhf_import() -> dict[str, Any]:
    install_stubs()
    for n in ("openrlhf", "openrlhf.models", "openrlhf.trainer", "openrlhf.trainer.ppo_utils"):
        mount(n)
    for n in ("openrlhf.trainer.ray", "openrlhf.utils"):
        mount(n)
    launcher = types.ModuleType("openrlhf.trainer.ray.launcher")
    launcher.RayActorGroup = object  # type: ignore[attr-defined]  # stand-in; never used
    sys.modules[launcher.__name__] = launcher
    from openrlhf.models import loss  # type: ignore[import-not-found]  # side venv only
    from openrlhf.models.utils import compute_approx_kl  # type: ignore[import-not-found]
    from openrlhf.trainer.ppo_utils.experience import Experience  # type: ignore[import-not-found]
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker  # type: ignore[import-not-found]

    return dict(loss=loss, kl=compute_approx_kl, Experience=Experience, Maker=RemoteExperienceMaker)


def make_openrlhf(out: Path, v2: bool) -> list[dict[str, Any]]:
    import functools

    import torch

    from refppo.capture.adapters import from_openrlhf, openrlhf_hparams

    o = _openrlhf_import()
    made = []
    for i, case in enumerate(OPENRLHF_CASES):
        x = inputs(400 + i, dtype=torch.float32)  # OpenRLHF whitens in float32 (``.float()``)
        m = x["response_mask"].bool()
        eps = case.get("eps", (0.2, 0.2))
        args = _ns(
            algo=_ns(
                advantage=_ns(estimator="gae", gamma=0.99, lambd=0.95, no_std_norm=False),
                kl=_ns(estimator=case["est"], use_loss=case["use_loss"], init_coef=0.05),
            ),
            actor=_ns(
                eps_clip_low_high=eps,
                dual_clip=case.get("dual"),
                entropy_coef=case.get("ent", 0.0),
                loss_agg_mode=case["agg"],
            ),
            critic=_ns(value_clip=0.5),
            rollout=_ns(n_samples_per_prompt=1),
            reward=_ns(clip_range=(-10.0, 10.0), overlong_buffer_len=None, stop_properly_penalty_coef=None),
        )
        # make_experience: KL of the experience-time log-probs, zero when the KL is a loss term
        kl = (
            torch.zeros_like(x["old_logprobs"])
            if case["use_loss"]
            else o["kl"](x["old_logprobs"], x["ref_logprobs"], kl_estimator=case["est"])
        )
        exp = o["Experience"](
            action_mask=m,
            action_log_probs=x["old_logprobs"],
            values=x["old_values"],
            rewards=x["scores"],
            base_action_log_probs=x["ref_logprobs"] if case["use_loss"] else None,
            kl=kl,
            index=list(range(m.shape[0])),
        )
        maker = _ns(
            strategy=_ns(args=args),
            advantage_estimator="gae",
            kl_ctl=_ns(value=0.05),
            get_advantages_and_returns=functools.partial(o["Maker"].get_advantages_and_returns, None),
        )
        (exp,) = o["Maker"].compute_advantages_and_returns(maker, [exp])
        tl = case["agg"] == "token-mean"
        lp = x["logprobs"].clone().requires_grad_(True)
        vp = x["values"].clone().requires_grad_(True)
        pol = o["loss"].PolicyLoss(eps[0], eps[1], dual_clip=case.get("dual"), token_level_loss=tl)(
            lp, exp.action_log_probs, exp.advantages, action_mask=exp.action_mask
        )
        vf = o["loss"].ValueLoss(0.5)(vp, exp.values, exp.returns, action_mask=exp.action_mask)
        ent = o["loss"].aggregate_loss(x["entropy"], exp.action_mask)  # training_step: token level
        loss = pol[0] - ent * case.get("ent", 0.0)
        kl_loss = None
        if case["use_loss"]:
            kl_loss = o["loss"].aggregate_loss(
                o["kl"](lp, exp.base_action_log_probs, kl_estimator=case["est"]), exp.action_mask
            )
            loss = loss + kl_loss * 0.05
        loss.backward()
        vf.backward()
        kw: dict[str, Any] = {
            "policy_loss": pol,
            "value_loss": vf,
            "logprobs": lp,
            "values": vp,
            "entropy": x["entropy"],
            "entropy_loss": ent,
            "kl_loss": kl_loss,
            "loss": loss,
            "kl": None if case["use_loss"] else kl,
            "ref_logprobs": None if case["use_loss"] else x["ref_logprobs"],
        }
        dump = from_openrlhf(exp, **kw)
        exp.returns = _corrupt(exp.returns, exp.action_mask)
        control = from_openrlhf(exp, ref_logprobs=kw["ref_logprobs"], kl=kw["kl"], value_loss=vf, values=vp)
        made.append(_save_case(out, case["name"], dump, control, "returns", openrlhf_hparams(args), v2))
    return made


# ------------------------------------------------------------------------------------------------ TRL


def make_trl(out: Path, v2: bool) -> list[dict[str, Any]]:
    from validate_trl_preset import CASES, build_trainer

    from refppo.capture.adapters import trace_ppo_step, trl_hparams

    made = []
    for case in ("ragged", "ragged_k3_epoch2"):
        spec = CASES[case]
        trainer, conf = build_trainer(spec)
        dump = trace_ppo_step(trainer, epoch=int(spec["capture_epoch"]))
        control = dict(dump, token_rewards=_corrupt(dump["token_rewards"], dump["response_mask"]))
        made.append(_save_case(out, f"trl_{case}", dump, control, "token_rewards", trl_hparams(conf), v2))
    return made


MAKERS = {"verl": make_verl, "openrlhf": make_openrlhf, "trl": make_trl}
