"""SkyRL 0.4.0's OWN PPO functions as refppo dumps (the ``skyrl04`` side venv; no refppo import).

Called, unmodified (``skyrl/backends/skyrl_train/utils/ppo_utils.py``): ``compute_approx_kl`` (the
reward KL and the KL loss), ``compute_gae_advantage_return`` (GAE over every position, then
``masked_whiten``), ``compute_grpo_outcome_advantage`` / ``compute_rloo_outcome_advantage``,
``apply_loss_reduction_to_advantages_minibatch`` (every ``loss_reduction``: the advantages scaled per
mini-batch), ``ppo_policy_loss`` (``regular`` / ``dual_clip``; ``reduce_loss`` sums ``loss·mask``),
``ppo_critic_loss``, ``masked_mean``. Restated (one line each; the real methods want Ray workers
and a ``TrainingInputBatch``): ``trainer.py::apply_reward_kl_penalty`` (``rewards − kl·coef``),
``postprocess_generator_output`` (the score on the last response token), ``_normalize_advantages``
(one mini-batch; ``prompt_boundaries`` the contiguous rows of each prompt) and the loss sum of
``workers/worker.py::_forward_backward_micro`` (``policy_loss·dp_size + (β·kl_loss −
ent_coef·entropy)·microbatch_weight``, ``kl_loss = masked_mean(kl, mask, dim=-1).mean()``,
``entropy = masked_mean(entropy, mask)``, ``microbatch_weight = len(micro-batch)/len(rank's rows)``),
DDP's mean of the ranks' gradients. ``grad_logprobs`` by autograd through those calls (v2).

Cases: :data:`CASES` (one rank, one micro-batch: scalars and gradient) and :func:`make_micro` (two
ranks × two micro-batches, gradient only, GRPO: 0.4.0's ``token_mean`` and, as the control that must
mismatch the preset, ``token_mean_legacy``, 0.3.1's per-micro-batch mean).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peers.makers.common import HP, inputs, save

GROUP = 4
"""Rows ``4g .. 4g+3`` are prompt ``g`` (contiguous, as SkyRL lays them out)."""
DUAL_C = 1.5
REDUCTION_TO_REFPPO = {
    "token_mean": "token-mean",
    "sequence_mean": "seq-mean-token-mean",
    "seq_mean_token_sum_norm": "seq-mean-token-sum-norm",
    "prompt_mean": "prompt-mean",
}

CASES: dict[str, dict[str, Any]] = {
    "default_k3_loss_token_mean": {"adv": "gae", "est": "k3", "kl_in": "loss", "red": "token_mean",
                                   "plt": "regular", "lo": 0.2, "hi": 0.2, "ent": 0.0,
                                   "control": {"kl_loss_agg": "token-mean"}},
    "k1_reward_sequence_mean": {"adv": "gae", "est": "k1", "kl_in": "reward", "red": "sequence_mean",
                                "plt": "regular", "lo": 0.2, "hi": 0.2, "ent": 0.0,
                                "control": {"loss_agg": "token-mean"}},
    "abs_reward_dual_clip_sum_norm": {"adv": "gae", "est": "abs", "kl_in": "reward",
                                      "red": "seq_mean_token_sum_norm", "plt": "dual_clip", "lo": 0.2,
                                      "hi": 0.28, "ent": 0.0, "control": {"dual_clip": None}},
    "k3_loss_seqmean_entropy": {"adv": "gae", "est": "k3", "kl_in": "loss", "red": "sequence_mean",
                                "plt": "regular", "lo": 0.1, "hi": 0.3, "ent": 0.01,
                                "control": {"entropy_agg": "seq-mean-token-mean"}},
    "grpo_k3_loss_prompt_mean": {"adv": "grpo", "est": "k3", "kl_in": "loss", "red": "prompt_mean",
                                 "plt": "regular", "lo": 0.2, "hi": 0.28, "ent": 0.0,
                                 "control": {"loss_agg": "token-mean"}},
    "rloo_k2_loss_token_mean": {"adv": "rloo", "est": "k2", "kl_in": "loss", "red": "token_mean",
                                "plt": "regular", "lo": 0.2, "hi": 0.2, "ent": 0.0,
                                "control": {"advantage": "grpo"}},
}  # fmt: skip


def _peer() -> Any:
    """``ppo_utils`` of SkyRL 0.4.0 (package ``__init__``s skipped; ray stubbed)."""
    from peers.makers.skyrl_prompt_mean import _peer as load

    return load()


def _config(red: str, plt: str, lo: float, hi: float, T: int) -> Any:
    """The ``AlgorithmConfig`` fields the losses read (an ``OmegaConf``; defaults as 0.4.0's)."""
    from omegaconf import OmegaConf  # type: ignore[import-not-found]  # side venv only

    return OmegaConf.create(
        {"policy_loss_type": plt, "loss_reduction": red, "eps_clip_low": lo, "eps_clip_high": hi,
         "clip_ratio_c": DUAL_C, "max_seq_len": T, "value_clip": HP["cliprange_value"],
         "off_policy_correction": {}}
    )  # fmt: skip


def _advantages(pu: Any, spec: dict[str, Any], x: dict[str, Any]) -> dict[str, Any]:
    """Token rewards (with the reward KL), advantages and returns as SkyRL's trainer makes them."""
    import numpy as np
    import torch

    m = x["response_mask"]
    B = m.shape[0]
    rewards = torch.zeros_like(m)
    rewards[torch.arange(B), (m.sum(dim=1) - 1).long()] = x["scores"]
    out: dict[str, Any] = {}
    if spec["kl_in"] == "reward":
        old, ref = x["old_logprobs"], x["ref_logprobs"]
        kl = pu.compute_approx_kl(old, ref, loss_mask=m, kl_estimator_type=spec["est"])
        rewards = rewards - kl * HP["kl_coef"]  # apply_reward_kl_penalty, restated
        out["kl"] = kl
    index = np.arange(B) // GROUP
    if spec["adv"] == "gae":
        adv, ret = pu.compute_gae_advantage_return(
            token_level_rewards=rewards, values=x["old_values"], response_mask=m, gamma=HP["gamma"],
            lambd=HP["lam"],
        )  # fmt: skip
        out.update(token_rewards=rewards, returns=ret)
    elif spec["adv"] == "grpo":
        adv, _ = pu.compute_grpo_outcome_advantage(token_level_rewards=rewards, response_mask=m, index=index)
    else:
        adv, _ = pu.compute_rloo_outcome_advantage(token_level_rewards=rewards, response_mask=m, index=index)
    out["advantages"] = adv
    return out


def _bounds(rows: list[int]) -> list[tuple[int, int]]:
    """``prompt_boundaries`` of ``rows`` (mini-batch-relative, contiguous prompts of :data:`GROUP`)."""
    starts = [i for i, r in enumerate(rows) if i == 0 or rows[i - 1] // GROUP != r // GROUP]
    return list(zip(starts, [*starts[1:], len(rows)], strict=True))


def run_case(pu: Any, seed: int, spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One mini-batch on one rank in one micro-batch: the dump's tensors and sidecar."""
    import torch

    x = inputs(seed, dtype=torch.float32)  # safe_exp_delta takes the ratio in float32
    m = x["response_mask"]
    B, T = m.shape
    got = _advantages(pu, spec, x)
    cfg = _config(spec["red"], spec["plt"], spec["lo"], spec["hi"], T)
    scaled = pu.apply_loss_reduction_to_advantages_minibatch(
        advantages=got["advantages"], loss_mask=m, loss_reduction=spec["red"], micro_batch_size=B,
        max_seq_len=T, prompt_boundaries=_bounds(list(range(B))),
    )  # fmt: skip
    lp = x["logprobs"].clone().requires_grad_(True)
    pg, met = pu.ppo_policy_loss(lp, x["old_logprobs"], scaled, cfg, loss_mask=m)
    entropy = pu.masked_mean(x["entropy"], m)
    loss = pg - spec["ent"] * entropy
    dump: dict[str, Any] = {**x, **got, "pg_loss": pg, "pg_clipfrac": torch.tensor(met["clip_ratio"])}
    if spec["kl_in"] == "loss":
        kll = pu.compute_approx_kl(lp, x["ref_logprobs"], loss_mask=m, kl_estimator_type=spec["est"])
        kl_loss = pu.masked_mean(kll, m, dim=-1).mean()
        loss = loss + HP["kl_coef"] * kl_loss
        dump["kl_loss"] = kl_loss
    if spec["ent"]:
        dump["entropy_loss"] = entropy
    (g,) = torch.autograd.grad(loss, (lp,))
    dump.update(loss=loss, grad_logprobs=torch.where(m.bool(), g, torch.zeros_like(g)))
    if spec["adv"] == "gae":
        vf, vf_clipfrac = pu.ppo_critic_loss(x["values"], x["old_values"], got["returns"], cfg, loss_mask=m)
        dump.update(vf_loss=vf, vf_clipfrac=torch.tensor(vf_clipfrac))
    else:
        dump = {k: v for k, v in dump.items() if k not in ("values", "old_values")}
        dump["group_index"] = torch.arange(B) // GROUP
    hp = {**HP, "cliprange": spec["lo"], "ent_coef": spec["ent"], "separate_critic": True, "world_size": 1,
          "micro_batches": 1}  # fmt: skip
    if spec["hi"] != spec["lo"]:
        hp["cliprange_high"] = spec["hi"]
    return dump, hp


def _setting(spec: dict[str, Any]) -> dict[str, Any]:
    """The case's ``--set`` keys over ``--preset skyrl04``."""
    conv: dict[str, Any] = {"kl_estimator": spec["est"], "kl_in": spec["kl_in"],
                            "loss_agg": REDUCTION_TO_REFPPO[spec["red"]]}  # fmt: skip
    if spec["adv"] != "gae":
        conv["advantage"] = spec["adv"]
    if spec["plt"] == "dual_clip":
        conv["dual_clip"] = DUAL_C
    return conv


RANK = [0, 0, 0, 0, 1, 1, 1, 1]
MICRO = [0, 0, 1, 1, 0, 0, 1, 1]
"""Row → rank and micro-batch (two rows per micro-batch, unequal token counts)."""
W = 2


def make_micro(pu: Any, out: Path, red: str) -> str:
    """GRPO with the k3 KL loss on two ranks × two micro-batches: the advantages scaled once for the
    mini-batch (``_normalize_advantages``), each micro-batch's ``policy_loss·W + β·kl_loss·mw``
    backward on its rank, the ranks' gradients averaged (DDP). Gradient only (no scalar)."""
    import torch

    spec = {"adv": "grpo", "est": "k3", "kl_in": "loss"}
    x = inputs(1450, dtype=torch.float32)
    m = x["response_mask"]
    B, T = m.shape
    got = _advantages(pu, spec, x)
    # the trainer scales the whole mini-batch; token_mean_legacy splits it into chunks of
    # micro_batch_size rows: [0, 1], [2, 3], [4, 5], [6, 7], the (rank, micro-batch) pairs below
    scaled = pu.apply_loss_reduction_to_advantages_minibatch(
        advantages=got["advantages"], loss_mask=m, loss_reduction=red, micro_batch_size=2, max_seq_len=T,
    )  # fmt: skip
    cfg = _config(red, "regular", 0.2, 0.2, T)
    g_lp = torch.zeros_like(x["logprobs"])
    for r in range(W):
        rank_rows = [b for b in range(B) if RANK[b] == r]
        for k in (0, 1):
            rows = torch.tensor([b for b in rank_rows if MICRO[b] == k])
            mb_scaled = scaled[rows]
            lp = x["logprobs"][rows].clone().requires_grad_(True)
            pg, _ = pu.ppo_policy_loss(lp, x["old_logprobs"][rows], mb_scaled, cfg, loss_mask=m[rows])
            kll = pu.compute_approx_kl(lp, x["ref_logprobs"][rows], loss_mask=m[rows], kl_estimator_type="k3")
            weight = len(rows) / len(rank_rows)
            loss = pg * W + HP["kl_coef"] * pu.masked_mean(kll, m[rows], dim=-1).mean() * weight
            (g,) = torch.autograd.grad(loss, (lp,))
            g_lp[rows] += g / W
    dump = {k: v for k, v in x.items() if k not in ("values", "old_values")}
    dump.update(got, grad_logprobs=torch.where(m.bool(), g_lp, torch.zeros_like(g_lp)))
    dump.update(group_index=torch.arange(B) // GROUP, rank=torch.tensor(RANK))
    dump["micro_batch"] = torch.tensor(MICRO)
    hp = {**HP, "cliprange": 0.2, "separate_critic": True, "world_size": W, "micro_batches": 2}
    conv = {"kl_estimator": "k3", "kl_in": "loss", "advantage": "grpo", "loss_agg": "token-mean"}
    return save(out, f"skyrl04_micro_{red}", dump, hp, conv, {"loss_agg": "seq-mean-token-mean"})


def make(out: Path) -> list[str]:
    """Every case of :data:`CASES` as ``skyrl04_CASE.pt`` + sidecar + ``.set.json`` + ``.control.json``,
    then the two micro-batch dumps of :func:`make_micro`."""
    import torch

    torch.set_num_threads(1)
    pu = _peer()
    made = []
    for i, (case, spec) in enumerate(CASES.items()):
        dump, hp = run_case(pu, 1400 + i, spec)
        made.append(save(out, f"skyrl04_{case}", dump, hp, _setting(spec), spec["control"]))
    return made + [make_micro(pu, out, red) for red in ("token_mean", "token_mean_legacy")]
