"""verl 0.9.1 steps with rollout rejection sampling (``rollout_rs``): the rejected tokens leave the
response mask of the whole step (``verl-openrlhf`` venv; nothing from refppo).

verl's trainer (``verl/trainer/ppo/ray_trainer.py``, the ``adv`` block of ``fit``) computes the
KL-shaped token rewards (``apply_kl_penalty``) on the original ``response_mask``, then
``rollout_corr_helper.py::compute_rollout_correction_and_add_to_batch`` writes the mask of
``compute_rollout_correction_and_rejection_mask`` (called here as installed) into
``batch["response_mask"]`` before ``compute_advantage``; GAE (``core_algos.py::
compute_gae_advantage_return``), the policy loss (``compute_policy_loss_vanilla``, its gradient by
autograd on a leaf copy of the current log-probs), the value loss and the entropy term
(``compute_value_loss``, ``agg_loss``) all read that reduced mask. The token rewards are restated as
in :mod:`peers.makers.verl_step` (``apply_kl_penalty`` wants a ``DataProto``). The dump holds the
ORIGINAL response mask and the behaviour log-probs ``l^prox − 0.6·N(0, 1)``: refppo must re-derive
the reduced mask (``rollout_rs_effect=drop_mask``); the control keeps the gate as a weight
(``rollout_rs_effect=weight``), which must not reproduce the dump.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peers.makers.common import HP, behaviour_inputs, save
from peers.makers.verl_correction import ACTOR, log_ratio, verl_fns
from peers.makers.verl_step import critic, entropy, policy_terms, reward_kl

# (name, rollout_rs, rollout_rs_threshold, rollout_is (token TIS at 2.0) or None, loss_agg_mode)
CASES: list[tuple[str, str, float | str, str | None, str]] = [
    ("token_k1", "token_k1", "0.6_1.6", None, "token-mean"),
    ("seq_mean_k3", "seq_mean_k3", 0.15, None, "seq-mean-token-mean"),
    ("seq_max_k2", "seq_max_k2", 0.8, None, "token-mean"),
    ("token_k2_tis", "token_k2", 0.12, "token", "seq-mean-token-mean"),
]

_LEVEL = {"token": "token", "seq": "sequence"}


def refppo_keys(rs: str, thr: float | str) -> dict[str, Any]:
    """The ``rollout_rs*`` keys of verl's option ``rs`` at threshold ``thr`` (restated here: the maker
    imports nothing from refppo): ``*_k1`` is a ratio band in ``behaviour`` order, ``k2``/``k3`` an
    upper bound; ``seq_sum``/``seq_mean``/``seq_max`` a sequence gate with that reduction."""
    parts = rs.split("_")
    stat = {"k1": "ratio", "k2": "k2", "k3": "k3"}[parts[-1]]
    out: dict[str, Any] = {
        "rollout_rs": _LEVEL[parts[0]],
        "rollout_rs_stat": stat,
        "rollout_rs_order": "behaviour",
    }
    if parts[0] == "seq":
        out["rollout_rs_reduce"] = parts[1]
    if stat == "ratio":
        lo, hi = (float(v) for v in str(thr).split("_")) if "_" in str(thr) else (1 / float(thr), float(thr))
        out.update(rollout_rs_low=lo, rollout_rs_high=hi)
    else:
        out.update(rollout_rs_low=None, rollout_rs_high=float(thr))
    return {**out, "rollout_rs_effect": "drop_mask"}


def _step(ca: Any, rch: Any, x: dict[str, Any], rs: str, thr: float | str, tis: str | None, agg: str) -> Any:
    import torch

    m = x["response_mask"]
    kl, rewards = reward_kl(ca, x, "k1", "reward")  # before the gate: the original mask
    _, m2, _ = rch.compute_rollout_correction_and_rejection_mask(
        old_log_prob=x["old_logprobs"], rollout_log_prob=x["rollout_logprobs"], response_mask=m,
        rollout_is=None, rollout_rs=rs, rollout_rs_threshold=thr,
    )  # fmt: skip
    assert 0 < m2.sum() < m.sum(), (rs, thr)  # the gate rejects some tokens, not all
    w = None
    if tis is not None:  # the IS weight of the original mask (compute_rollout_correction_weights)
        w, _ = rch.compute_rollout_correction_weights(
            log_ratio(x), m, rollout_is=tis, rollout_is_threshold=2.0
        )
    adv, ret = ca.compute_gae_advantage_return(rewards, x["old_values"], m2, HP["gamma"], HP["lam"])
    lp = x["logprobs"].clone().requires_grad_(True)
    pg, metrics = ca.compute_policy_loss_vanilla(
        x["old_logprobs"], lp, adv, m2, loss_agg_mode=agg, config=ACTOR, rollout_is_weights=w
    )
    (grad,) = torch.autograd.grad(pg, (lp,))
    x2 = dict(x, response_mask=m2)
    dump: dict[str, Any] = dict(x)
    dump.update(
        kl=kl, token_rewards=rewards, advantages=adv, returns=ret, **policy_terms(pg, metrics),
        **critic(ca, x2, ret, agg), entropy_loss=entropy(ca, x2, agg).detach(), loss=pg.detach(),
        grad_logprobs=torch.where(m.bool(), grad, 0.0), grad_values=torch.zeros_like(m),
    )  # fmt: skip
    return dump


def make(out: Path, v2: bool = True) -> list[str]:
    """One dump per case of :data:`CASES` (``v2``: with the gradients ``grad_logprobs``, ``grad_values``);
    returns their names."""
    ca, rch = verl_fns()
    made = []
    for i, (name, rs, thr, tis, agg) in enumerate(CASES):
        x = behaviour_inputs(700 + i, 800 + i)
        dump = _step(ca, rch, x, rs, thr, tis, agg)
        if not v2:
            del dump["grad_logprobs"], dump["grad_values"]
        conv: dict[str, Any] = {"kl_estimator": "k1", "kl_in": "reward", "loss_agg": agg, "dual_clip": 3.0}
        conv.update(refppo_keys(rs, thr))
        if tis is not None:
            conv.update(rollout_is=tis, rollout_is_mode="truncate", rollout_is_low=None, rollout_is_high=2.0)
        hp = dict(HP, cliprange=0.2, ent_coef=0.0, world_size=1, micro_batches=1)
        tag = "v2" if v2 else "v1"
        made.append(
            save(out, f"verl_rollout_rs_{name}_{tag}", dump, hp, conv, {"rollout_rs_effect": "weight"})
        )
    return made


def make_both(out: Path) -> list[str]:
    """The v1 (scalars) and v2 (with gradients) dumps of every case."""
    return make(out, v2=False) + make(out, v2=True)
