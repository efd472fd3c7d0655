"""trinity-rft 0.6.0's OWN PPO functions as refppo dumps (the ``trinity`` side venv; no refppo import).

What runs (unmodified, from the installed wheel), in the order of trinity's verl trainer:

- ``trinity/trainer/verl/utils.py::to_data_proto`` on ``trinity.common.experience.Experience``
  objects (prompt + response tokens, ``reward``, ``logprobs``, ``action_mask``): the verl
  ``DataProto`` with ``token_level_scores`` (the score at ``cumsum(attention_mask).argmax``, the
  response's last token) and ``response_mask``;
- the KL penalty ``trinity/algorithm/kl_fn/kl_fn.py::KLFn.apply_kl_penalty_to_reward`` of the case's
  ``kl_penalty_fn`` (``none``: ``DummyKLFn``; ``k3``: ``K3Fn``, unclamped; ``low_var_kl``:
  ``LowVarKLFn``, verl's clamps) on ``old_log_probs`` vs ``ref_log_prob``;
- ``trinity/algorithm/advantage_fn/ppo_advantage.py::PPOAdvantageFn`` (GAE over every position with
  the critic's values as given, ``returns = A + V``, ``masked_whiten`` over ``response_mask``);
- ``trinity/algorithm/policy_loss_fn/ppo_policy_loss.py::PPOPolicyLossFn`` (``pg_loss``,
  ``pg_clipfrac``, ``ppo_kl``) and, with ``kl_loss_fn`` on, ``KLFn.calculate_kl_loss`` of the current
  log-probs (``kl_loss`` is the unscaled aggregate it logs), summed as ``TrinityPolicyLoss`` sums them
  (``trinity/trainer/verl/losses.py``: ``pg_loss + kl_coef·kl_loss``; no entropy term at the default
  ``entropy_coef = 0``); ``grad_logprobs`` by autograd through those calls.

The critic is verl's own worker (its value loss is verl 0.9.1's ``compute_value_loss``, validated by
the verl makers): these dumps carry ``old_values`` for GAE and no value update (``separate_critic``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from peers.makers.common import inputs, install_stubs, mount, save

CASES: dict[str, dict[str, Any]] = {
    # trinity's PPO defaults (algorithm.py::PPOAlgorithm.default_config): no KL in the reward,
    # kl_loss_fn k2; kl_coef raised from 0.001 so the KL loss shows
    "default_k2_loss": {"penalty": "none", "kl_loss": "k2", "agg": "token-mean", "lo": 0.2, "hi": 0.2,
                        "set": {}, "control": {"gae_padding": "masked"}},
    "k3_reward_seqmean": {"penalty": "k3", "kl_loss": "none", "agg": "seq-mean-token-mean", "lo": 0.2,
                          "hi": 0.28, "spread": 3.0, "set": {"kl_in": "reward", "kl_estimator": "k3",
                                              "loss_agg": "seq-mean-token-mean"},
                          "control": {"dual_clip": None}},
    "low_var_kl_reward": {"penalty": "low_var_kl", "kl_loss": "none", "agg": "token-mean", "lo": 0.1,
                          "hi": 0.1, "set": {"kl_in": "reward", "kl_estimator": "k3",
                                             "kl_log_ratio_clamp": [-20.0, 20.0], "kl_value_clamp": 10.0},
                          "control": {"score_at": "after_last_valid"}},
}  # fmt: skip
HP = {"gamma": 0.99, "lam": 0.95, "kl_coef": 0.1, "cliprange_value": 0.5, "vf_coef": 0.0, "ent_coef": 0.0}


def _load() -> dict[str, Any]:
    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
    install_stubs()
    mount("verl")
    import verl  # type: ignore[import-not-found]  # trinity venv only
    from verl.protocol import DataProto  # type: ignore[import-not-found]

    verl.DataProto = DataProto  # ``from verl import DataProto`` without verl's package __init__
    mount("trinity")
    for pkg in ("trinity.algorithm", "trinity.trainer", "trinity.trainer.verl"):
        mount(pkg)
    from trinity.algorithm.advantage_fn.ppo_advantage import PPOAdvantageFn  # type: ignore[import-not-found]
    from trinity.algorithm.kl_fn import kl_fn  # type: ignore[import-not-found]
    from trinity.algorithm.policy_loss_fn.ppo_policy_loss import PPOPolicyLossFn  # type: ignore[import-not-found]
    from trinity.common.experience import Experience  # type: ignore[import-not-found]
    from trinity.trainer.verl.utils import to_data_proto  # type: ignore[import-not-found]

    kls = {"none": kl_fn.DummyKLFn, "k1": kl_fn.K1Fn, "k2": kl_fn.K2Fn, "k3": kl_fn.K3Fn,
           "low_var_kl": kl_fn.LowVarKLFn}  # fmt: skip
    return {
        "adv": PPOAdvantageFn,
        "kl": kls,
        "pg": PPOPolicyLossFn,
        "exp": Experience,
        "proto": to_data_proto,
    }


def _proto(t: dict[str, Any], x: dict[str, Any]) -> Any:
    """trinity's own DataProto of the batch (``to_data_proto``), the rollout tensors added."""
    import logging

    import torch

    m = x["response_mask"].bool()
    exps = []
    for i in range(m.shape[0]):
        n = int(m[i].sum())
        tokens = torch.cat([torch.tensor([1, 2, 3]), torch.arange(n) % 7 + 4])
        lp = x["old_logprobs"][i, :n].float()
        ones = torch.ones(n, dtype=torch.bool)
        exp = t["exp"](
            tokens=tokens, prompt_length=3, reward=float(x["scores"][i]), logprobs=lp, action_mask=ones
        )
        exps.append(exp)
    proto = t["proto"](exps, pad_token_id=0, model=None, logger=logging.getLogger("trinity"))
    T = proto.batch["responses"].shape[1]
    assert m.shape[1] == T, (T, m.shape)
    proto.batch["old_log_probs"] = x["old_logprobs"].float()
    proto.batch["ref_log_prob"] = x["ref_logprobs"].float()
    proto.batch["values"] = x["old_values"].float()
    return proto


def run_case(t: dict[str, Any], seed: int, spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch

    x = inputs(seed, dtype=torch.float32)
    # ratios spread out (padding stays 7.5) so that the dual clip acts where the case needs it
    x["logprobs"] = x["old_logprobs"] + spec.get("spread", 1.0) * (x["logprobs"] - x["old_logprobs"])
    m = x["response_mask"]
    proto = _proto(t, x)
    assert torch.equal(proto.batch["response_mask"].float(), m)
    proto, _ = t["kl"][spec["penalty"]](kl_coef=HP["kl_coef"]).apply_kl_penalty_to_reward(proto)
    proto, _ = t["adv"](gamma=HP["gamma"], lam=HP["lam"])(proto)
    b = proto.batch
    pg_fn = t["pg"](clip_range_low=spec["lo"], clip_range_high=spec["hi"], loss_agg_mode=spec["agg"])
    lp = x["logprobs"].clone().requires_grad_(True)
    pg, metrics = pg_fn(
        logprob=lp, old_logprob=b["old_log_probs"], action_mask=m.bool(), advantages=b["advantages"]
    )
    loss = pg
    dump = {"response_mask": m, "old_logprobs": x["old_logprobs"], "ref_logprobs": x["ref_logprobs"],
            "old_values": x["old_values"], "values": x["values"], "scores": x["scores"],
            "logprobs": x["logprobs"],
            "token_rewards": b["token_level_rewards"], "advantages": b["advantages"], "returns": b["returns"],
            "pg_loss": pg, "pg_clipfrac": torch.tensor(metrics["pg_clipfrac"]),
            "approx_kl": torch.tensor(metrics["ppo_kl"])}  # fmt: skip
    if spec["kl_loss"] != "none":
        kfn = t["kl"][spec["kl_loss"]](kl_coef=HP["kl_coef"])
        scaled, km = kfn.calculate_kl_loss(lp, b["ref_log_prob"], m.bool(), spec["agg"])
        loss = loss + scaled
        dump["kl_loss"] = torch.tensor(km["kl_loss"])
    (g,) = torch.autograd.grad(loss, (lp,))
    dump.update(loss=loss, grad_logprobs=torch.where(m.bool(), g, torch.zeros_like(g)))
    sidecar = {**HP, "cliprange": spec["lo"], "cliprange_high": spec["hi"], "separate_critic": True,
               "world_size": 1, "micro_batches": 1}  # fmt: skip
    return dump, sidecar


def make(out: Path) -> list[str]:
    """Every case of :data:`CASES` as ``trinity_CASE.pt`` + sidecar + ``.set.json`` + ``.control.json``."""
    import torch

    torch.set_num_threads(1)
    t = _load()
    made = []
    for i, (case, spec) in enumerate(CASES.items()):
        dump, sidecar = run_case(t, 700 + i, spec)
        made.append(save(out, f"trinity_{case}", dump, sidecar, spec["set"], spec["control"]))
    return made
