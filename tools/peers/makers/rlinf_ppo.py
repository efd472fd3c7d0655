"""RLinf 0.3.0's OWN reasoning PPO functions as refppo dumps (the ``rlinf`` side venv; no refppo import).

What runs (unmodified, from the installed wheel), in the order of RLinf's Megatron reasoning workers
(``rlinf/workers/megatron_worker.py``, ``workers/actor/megatron_actor_worker.py``,
``workers/critic/megatron_critic_worker.py``):

- ``rlinf/algorithms/utils.py::preprocess_reasoning_advantages_inputs`` (the token rewards: the
  score at the frame's last slot; dumped as ``token_rewards``) and
  ``rlinf/algorithms/registry.py::calculate_adv_and_returns`` with ``adv_type`` ``gae``
  (``compute_gae_advantages_and_returns``: the critic's values with a zero appended,
  ``normalize_advantages=False`` as the worker passes it) or ``grpo`` (``compute_grpo_advantages``);
- ``rlinf/utils/distributed.py::masked_normalization`` when the case normalises
  (``unbiased=True`` as the Megatron worker calls it, or the default population variance as the
  FSDP actor calls it);
- ``rlinf/algorithms/registry.py::policy_loss`` (``loss_type: actor`` →
  ``losses.py::compute_ppo_actor_loss``) with ``rlinf/utils/utils.py::get_loss_agg_func``, plus the
  actor worker's KL loss ``kl_beta · loss_agg_func(kl_penalty(curr, ref, type), mask)``;
  ``grad_logprobs`` by autograd through those calls;
- ``losses.py::compute_ppo_critic_loss`` with ``huber_delta=10000`` as the critic worker calls it.

Glue restated (the real caller is a Megatron forward): the critic's old values are zeroed on the
padding (``megatron_critic_worker.py``: ``output * mask``); ``Tensor.cuda`` is the identity on this
CPU interpreter (``masked_normalization`` moves its input to the GPU).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from peers.makers.common import inputs, install_stubs, mount, save

GROUP = 4
"""``algorithm.group_size``: rows ``4g .. 4g+3`` are group ``g``."""

CASES: dict[str, dict[str, Any]] = {
    # the GAE path with a critic, Megatron's normalisation, the k3 (low_var_kl) KL loss
    "gae_k3_loss": {"adv": "gae", "norm": "megatron", "agg": "token-mean", "lo": 0.2, "hi": 0.28,
                    "kl": "low_var_kl", "kl_beta": 0.1, "set": {"cliprange_high": 0.28},
                    "control": {"score_at": "last_valid"}},
    # ratios spread so that the dual clip and a log-ratio clamp of ±1.5 (e^1.5 > 3) bind; seq-mean-token-sum
    "gae_dual_clip_clamp": {"adv": "gae", "norm": "megatron", "agg": "seq-mean-token-sum", "lo": 0.2,
                            "hi": 0.2, "kl": None, "kl_beta": 0.0, "spread": 3.0, "clamp": 1.5,
                            "set": {"loss_agg": "seq-mean-token-sum", "log_ratio_clamp": 1.5},
                            "control": {"dual_clip": None}},
    # GRPO as the reasoning recipes run it, the FSDP actor's normalisation (population variance)
    "grpo_fsdp_norm_seqmean": {"adv": "grpo", "norm": "fsdp", "agg": "seq-mean-token-mean", "lo": 0.2,
                               "hi": 0.2, "kl": "k2", "kl_beta": 0.05,
                               "set": {"advantage": "grpo", "whiten_advantages": "masked",
                                       "whiten_variance": "population", "loss_agg": "seq-mean-token-mean",
                                       "kl_estimator": "k2"},
                               "control": {"whiten_variance": "unbiased"}},
    # GRPO without normalisation (the variant's default): the group std is load-bearing
    "grpo_plain": {"adv": "grpo", "norm": None, "agg": "token-mean", "lo": 0.2, "hi": 0.2, "kl": None,
                   "kl_beta": 0.0, "set": {"advantage": "grpo"}, "control": {"group_std": "population"}},
}  # fmt: skip
HP = {"gamma": 0.99, "lam": 0.95, "kl_coef": 0.0, "cliprange_value": 0.3, "vf_coef": 0.0, "ent_coef": 0.0}


def _load() -> dict[str, Any]:
    """RLinf's algorithm modules with its scheduler (Ray workers) and Megatron stubbed."""
    import torch

    install_stubs(extra=("megatron", "rlinf.scheduler", "omegaconf"))
    for pkg in ("rlinf", "rlinf.utils", "rlinf.algorithms"):
        mount(pkg)
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]  # CPU stand-in
    # importing advantages and losses registers their functions
    from rlinf.algorithms import advantages, losses, registry, utils  # type: ignore[import-not-found]  # noqa: F401
    from rlinf.utils.distributed import masked_normalization  # type: ignore[import-not-found]
    from rlinf.utils.utils import get_loss_agg_func  # type: ignore[import-not-found]

    return {
        "adv": registry.calculate_adv_and_returns,
        "pre": utils.preprocess_reasoning_advantages_inputs,
        "pg": registry.policy_loss,
        "kl": utils.kl_penalty,
        "vf": losses.compute_ppo_critic_loss,
        "norm": masked_normalization,
        "agg": get_loss_agg_func,
    }


def _advantages(t: dict[str, Any], spec: dict[str, Any], x: dict[str, Any], old_v: Any) -> dict[str, Any]:
    """Token rewards, advantages (and returns) as RLinf's worker computes them."""
    m = x["response_mask"].bool()
    kw = {"task_type": "reasoning", "adv_type": spec["adv"], "rewards": x["scores"], "loss_mask": m,
          "group_size": GROUP, "gamma": HP["gamma"], "gae_lambda": HP["lam"], "normalize_advantages": False,
          "kl_beta": 0.0, "kl_penalty_type": "low_var_kl", "logprob": x["old_logprobs"],
          "ref_logprob": x["ref_logprobs"]}  # fmt: skip
    out: dict[str, Any] = {}
    if spec["adv"] == "gae":
        kw["values"] = old_v
        out["token_rewards"] = t["pre"](**{**kw, "values": None})["rewards"].transpose(0, 1)
    adv, ret = t["adv"](**kw)
    if spec["norm"] == "megatron":  # workers/megatron_worker.py: unbiased=True
        adv = t["norm"](adv, m, unbiased=True)
    elif spec["norm"] == "fsdp":  # workers/actor/fsdp_actor_worker.py: the defaults (population)
        adv = t["norm"](adv, m)
    out["advantages"] = adv
    if ret is not None:
        out["returns"] = ret
    return out


def run_case(t: dict[str, Any], seed: int, spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch

    x = inputs(seed, dtype=torch.float32)
    x["logprobs"] = x["old_logprobs"] + spec.get("spread", 1.0) * (x["logprobs"] - x["old_logprobs"])
    m = x["response_mask"]
    old_v = x["old_values"] * m  # the critic's forward: output * mask
    got = _advantages(t, spec, x, old_v)
    agg = t["agg"](spec["agg"])
    lp = x["logprobs"].clone().requires_grad_(True)
    c = spec.get("clamp")
    pg, met = t["pg"](
        task_type="reasoning", loss_type="actor", loss_agg_func=agg, logprobs=lp,
        old_logprobs=x["old_logprobs"],
        advantages=got["advantages"], clip_ratio_c=3.0, clip_ratio_low=spec["lo"], clip_ratio_high=spec["hi"],
        loss_mask=m.bool(), clip_log_ratio_min=None if c is None else -c, clip_log_ratio_max=c,
        fast_path_zero_loss_mask=True,
    )  # fmt: skip
    dump = {"response_mask": m, "old_logprobs": x["old_logprobs"], "ref_logprobs": x["ref_logprobs"],
            "scores": x["scores"], "logprobs": x["logprobs"], **got, "pg_loss": pg,
            "pg_clipfrac": met["actor/clip_fraction"], "approx_kl": met["actor/approx_kl"]}  # fmt: skip
    loss = pg
    if spec["kl"] is not None:
        kl_loss = agg(t["kl"](lp, x["ref_logprobs"], spec["kl"]), m.bool())
        loss = loss + spec["kl_beta"] * kl_loss
        dump["kl_loss"] = kl_loss
    (g,) = torch.autograd.grad(loss, (lp,))
    dump.update(loss=loss, grad_logprobs=torch.where(m.bool(), g, torch.zeros_like(g)))
    if spec["adv"] == "gae":
        vf, _ = t["vf"](values=x["values"], returns=got["returns"], prev_values=old_v,
                        value_clip=HP["cliprange_value"], huber_delta=10000, loss_mask=m.bool())  # fmt: skip
        dump.update(old_values=old_v, values=x["values"], vf_loss=vf)
    else:
        dump["group_index"] = torch.arange(m.shape[0]) // GROUP
    sidecar = {**HP, "kl_coef": spec["kl_beta"], "cliprange": spec["lo"], "cliprange_high": spec["hi"],
               "separate_critic": True, "world_size": 1, "micro_batches": 1}  # fmt: skip
    return dump, sidecar


def make(out: Path) -> list[str]:
    """Every case of :data:`CASES` as ``rlinf_CASE.pt`` + sidecar + ``.set.json`` + ``.control.json``."""
    import torch

    torch.set_num_threads(1)
    t = _load()
    made = []
    for i, (case, spec) in enumerate(CASES.items()):
        dump, sidecar = run_case(t, 900 + i, spec)
        if spec.get("clamp") is not None:
            # RLinf's approx_kl reads the CLAMPED log ratio (approx_kl=k1_clamped, the preset's):
            # the test checks that approx_kl=k1 (the unclamped mean) mismatches on this dump
            (out / f"rlinf_{case}.facts.json").write_text(json.dumps({"clamp": spec["clamp"]}))
        made.append(save(out, f"rlinf_{case}", dump, sidecar, spec["set"], spec["control"]))
    fsdp_kl(t, out)  # not a dump: the FSDP path's swapped KL arguments, for the test
    return made


def fsdp_kl(t: dict[str, Any], out: Path) -> str:
    """``kl_penalty`` as RLinf's FSDP actor calls it, ``kl_penalty(ref_logprobs, logprobs, type)``
    (``workers/actor/fsdp_actor_worker.py``), and as its Megatron actor does,
    ``kl_penalty(curr_logprobs, ref_logprobs, type)`` (``megatron_actor_worker.py``), for each type,
    on one batch with log-ratios up to ±25 (both clamps bind); written to ``rlinf_fsdp_kl.pt``
    (``fsdp_TYPE``, ``megatron_TYPE``, the inputs). Padding is left to the caller (masked there)."""
    import torch

    x = inputs(990, dtype=torch.float32)
    lp = x["ref_logprobs"] + 12.0 * (x["logprobs"] - x["ref_logprobs"])
    doc = {"logprobs": lp, "ref_logprobs": x["ref_logprobs"], "response_mask": x["response_mask"]}
    for kind in ("k1", "k2", "low_var_kl", "abs"):
        doc[f"fsdp_{kind}"] = t["kl"](x["ref_logprobs"], lp, kind)
        doc[f"megatron_{kind}"] = t["kl"](lp, x["ref_logprobs"], kind)
    torch.save({k: v.detach().contiguous() for k, v in doc.items()}, out / "rlinf_fsdp_kl.pt")
    return "rlinf_fsdp_kl"
