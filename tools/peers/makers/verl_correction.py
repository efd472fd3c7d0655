"""verl 0.9.1 dumps whose policy term carries its rollout correction (``verl-openrlhf`` venv).

verl (``verl/trainer/ppo/rollout_corr_helper.py::compute_rollout_correction_weights``: the weight
from the log-ratio ``old_log_prob − rollout_log_probs``; ``core_algos.py::compute_policy_loss_vanilla``
with ``rollout_is_weights``), the rest of the step as :func:`peers.makers.verl_openrlhf.make_verl`
(``kl_penalty``, GAE, the value loss, ``agg_loss``). The behaviour log-probs are ``l^prox − ε``,
``ε ~ 0.6·N(0, 1)``, so the weights straddle every bound. Each case's ``--set`` names the whole
correction; its control flips the mode. ``--detect`` (``tools/peers detect --only correction``)
must list the generating correction, the caps solved where they are not verl's named values.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from peers.makers.common import HP, behaviour_inputs, install_stubs, mount, save
from peers.makers.verl_step import VerlActorConfig

# (rollout_is, rollout_is_threshold, loss_agg_mode)
CASES: list[tuple[str, float | str, str]] = [
    ("token", 2.0, "token-mean"),
    ("token", 1.5, "token-mean"),
    ("token", 1.8, "seq-mean-token-mean"),
    ("sequence", "0.5_2.0", "token-mean"),
    ("token", "0.5_2.0", "seq-mean-token-mean"),
]


def _conv(level: str, thr: float | str) -> dict[str, Any]:
    if isinstance(thr, str):
        lo, hi = (float(v) for v in thr.split("_"))
        return {"rollout_is": level, "rollout_is_mode": "mask", "rollout_is_low": lo, "rollout_is_high": hi}
    return {
        "rollout_is": level,
        "rollout_is_mode": "truncate",
        "rollout_is_low": None,
        "rollout_is_high": thr,
    }


def verl_fns() -> tuple[Any, Any]:
    """verl 0.9.1's ``core_algos`` and ``rollout_corr_helper`` modules (stubs installed)."""
    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
    install_stubs()
    mount("verl")
    from verl.trainer.ppo import core_algos as ca  # type: ignore[import-not-found]  # side venv only
    from verl.trainer.ppo import rollout_corr_helper as rch  # side venv only

    return ca, rch


def rollout_part(ca: Any, x: dict[str, Any]) -> dict[str, Any]:
    """verl's KL (k1), the shaped token rewards and GAE: ``kl``, ``token_rewards``, ``advantages``,
    ``returns``."""
    import torch

    m = x["response_mask"]
    kl = ca.kl_penalty(x["old_logprobs"], x["ref_logprobs"], kl_penalty="kl")
    last = (m.sum(dim=1) - 1).long()
    rewards = torch.zeros_like(m)
    rewards[torch.arange(m.shape[0]), last] = x["scores"]
    rewards = rewards - HP["kl_coef"] * kl * m  # ray_trainer.apply_kl_penalty, restated
    adv, ret = ca.compute_gae_advantage_return(rewards, x["old_values"], m, HP["gamma"], HP["lam"])
    return {"kl": kl, "token_rewards": rewards, "advantages": adv, "returns": ret}


def log_ratio(x: dict[str, Any], num: str = "old_logprobs") -> Any:
    """``l^num − l^beh`` on valid tokens, 0 on padding (what verl's trainer passes)."""
    import torch

    m = x["response_mask"]
    return torch.where(m.bool(), x[num] - x["rollout_logprobs"], torch.zeros_like(m))


def step_dump(
    ca: Any, x: dict[str, Any], ro: dict[str, Any], pg: Any, metrics: Any, agg: str
) -> dict[str, Any]:
    """The dump of one verl step: ``x``, the rollout part ``ro``, the policy term ``pg`` (its
    ``metrics``), verl's value loss and entropy under ``agg``; ``loss`` = ``pg`` (β, ``vf_coef``,
    ``ent_coef`` 0)."""
    import torch

    m = x["response_mask"]
    vf, vf_clipfrac = ca.compute_value_loss(
        x["values"],
        ro["returns"],
        x["old_values"],
        m,
        cliprange_value=HP["cliprange_value"],
        loss_agg_mode=agg,
    )
    entropy = ca.agg_loss(loss_mat=x["entropy"], loss_mask=m, loss_agg_mode=agg)
    dump: dict[str, Any] = dict(x)
    dump.update(
        **ro, pg_loss=pg.detach(),
        pg_clipfrac=torch.tensor(metrics["actor/pg_clipfrac"], dtype=torch.float64),
        approx_kl=torch.tensor(metrics["actor/ppo_kl"], dtype=torch.float64),
        vf_loss=vf.detach(), vf_clipfrac=torch.as_tensor(vf_clipfrac, dtype=torch.float64),
        entropy_loss=entropy.detach(), loss=pg.detach(),
    )  # fmt: skip
    return dump


BASE_CONV: dict[str, Any] = {"kl_estimator": "k1", "kl_in": "reward", "dual_clip": 3.0}
"""The rest of the step's convention (verl's ``kl_penalty="kl"`` in the reward, ``clip_ratio_c`` 3)."""
ACTOR = VerlActorConfig(0.2, 0.2, None, 3.0)


def make(out: Path) -> list[str]:
    ca, rch = verl_fns()
    made = []
    for i, (level, thr, agg) in enumerate(CASES):
        x = behaviour_inputs(300 + i, 400 + i)
        m = x["response_mask"]
        ro = rollout_part(ca, x)
        w, _ = rch.compute_rollout_correction_weights(
            log_ratio(x), m, rollout_is=level, rollout_is_threshold=thr
        )
        pg, metrics = ca.compute_policy_loss_vanilla(
            x["old_logprobs"], x["logprobs"], ro["advantages"], m, loss_agg_mode=agg, config=ACTOR,
            rollout_is_weights=w,
        )  # fmt: skip
        dump = step_dump(ca, x, ro, pg, metrics, agg)
        conv = {
            "kl_estimator": "k1",
            "kl_in": "reward",
            "loss_agg": agg,
            "dual_clip": 3.0,
            **_conv(level, thr),
        }
        other = "mask" if conv["rollout_is_mode"] == "truncate" else "truncate"
        name = f"verl_correction_{level}_{thr}_{agg}"
        made.append(
            save(out, name, dump, dict(HP, cliprange=0.2, ent_coef=0.0), conv, {"rollout_is_mode": other})
        )
    return made
