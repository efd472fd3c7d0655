"""OpenRLHF 0.11.2 dumps whose policy term carries its vLLM IS correction (``verl-openrlhf`` venv).

``openrlhf/models/loss.py::PolicyLoss`` with ``is_correction_level="token"``,
``is_correction_mode`` ``clip`` / ``mask`` and ``is_correction_threshold=[lo, hi]``, called with
``rollout_log_probs``; the KL, the shaped reward, GAE and the batch whitening as
:func:`peers.makers.verl_openrlhf._openrlhf_step` computes them (OpenRLHF's own functions, the
whitening restated). Behaviour log-probs ``l^prox − 0.6·N(0, 1)``. Each case's ``--set`` names the
whole correction; its control flips the mode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peers.makers.common import HP, behaviour_inputs, save
from peers.makers.openrlhf_step import openrlhf_fns, shaped_gae

# (is_correction_mode, threshold)
CASES: list[tuple[str, tuple[float, float]]] = [
    ("clip", (0.5, 1.5)),
    ("mask", (0.5, 2.0)),
    ("clip", (0.5, 1.7)),
]


def corrected_step(
    fns: dict[str, Any], x: dict[str, Any], mode: str, lo: float, hi: float, old: Any = None,
    level: str = "token",
) -> dict[str, Any]:  # fmt: skip
    """One OpenRLHF step's dump: its KL, shaped reward and GAE, ``PolicyLoss`` with the IS correction
    at ``level`` (``mode``, ``[lo, hi]``) given ``old`` as its ``old_log_probs`` (None: the
    trainer's ``old_logprobs``), its value loss and entropy; ``loss`` = ``pg_loss``."""
    from openrlhf.models.loss import PolicyLoss  # type: ignore[import-not-found]  # side venv only

    m = x["response_mask"]
    kl, rewards, adv, ret = shaped_gae(fns, x, "k1", HP["kl_coef"])
    fn = PolicyLoss(
        clip_eps_low=0.2, clip_eps_high=0.2, token_level_loss=True, is_correction_level=level,
        is_correction_mode=mode, is_correction_threshold=[lo, hi],
    )  # fmt: skip
    pg, clip_ratio, ppo_kl, _, _ = fn(
        x["logprobs"], x["old_logprobs"] if old is None else old, adv, action_mask=m,
        rollout_log_probs=x["rollout_logprobs"],
    )  # fmt: skip
    vf = fns["ValueLoss"](HP["cliprange_value"])(x["values"], x["old_values"], ret, action_mask=m)
    entropy = fns["aggregate_loss"](x["entropy"], m)
    dump: dict[str, Any] = dict(x)
    dump.update(
        kl=kl, token_rewards=rewards, advantages=adv, returns=ret, pg_loss=pg.detach(),
        pg_clipfrac=clip_ratio.detach(), approx_kl=ppo_kl.detach(),
        vf_loss=(vf[0] if isinstance(vf, tuple) else vf).detach(), entropy_loss=entropy.detach(),
        loss=pg.detach(),
    )  # fmt: skip
    return dump


BASE_CONV: dict[str, Any] = {"kl_estimator": "k1", "kl_in": "reward", "loss_agg": "token-mean"}
"""The rest of the step's convention (OpenRLHF's k1 KL in the reward, token-level loss)."""


def make(out: Path) -> list[str]:
    fns = openrlhf_fns()
    made = []
    for i, (mode, (lo, hi)) in enumerate(CASES):
        dump = corrected_step(fns, behaviour_inputs(500 + i, 600 + i), mode, lo, hi)
        rmode = "truncate" if mode == "clip" else "mask"
        conv = {
            **BASE_CONV, "rollout_is": "token", "rollout_is_mode": rmode, "rollout_is_low": lo,
            "rollout_is_high": hi,
        }  # fmt: skip
        control = {"rollout_is_mode": "mask" if rmode == "truncate" else "truncate"}
        name = f"openrlhf_correction_token_{mode}_{lo}_{hi}"
        made.append(save(out, name, dump, dict(HP, cliprange=0.2, ent_coef=0.0), conv, control))
    return made
