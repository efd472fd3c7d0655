"""verl 0.9.1 GSPO steps from its own functions (``verl-openrlhf`` venv; nothing from refppo).

Each case is one PPO step as :func:`peers.makers.verl_openrlhf.make_verl` makes it (verl
``verl/trainer/ppo/core_algos.py``: ``kl_penalty``, ``compute_gae_advantage_return``,
``compute_value_loss``, ``agg_loss``; restated: ``ray_trainer.apply_kl_penalty`` and the loss sum of
``verl/workers/utils/losses.py::ppo_loss``) with the policy loss of verl's ``policy_loss.loss_mode:
gspo``: ``get_policy_loss_fn("gspo")``, i.e. ``compute_policy_loss_gspo``, with a real
``verl.workers.config.ActorConfig`` (``clip_ratio_low``/``clip_ratio_high``; its log sequence ratio
clamped at 10, hard-coded; no dual clip). The case's ``--set`` is ``policy_loss=gspo dual_clip=none
log_ratio_clamp=10`` on top of ``--preset verl`` (whose vanilla loss has ``c = 3`` and κ = 20); the
control flips ``policy_loss`` back to ``vanilla``. In the third case the log-ratio of the first row
with a negative advantage is offset by +11 on its valid tokens, so its sequence log-ratio passes 10
and verl's clamp binds: its control is ``log_ratio_clamp=none``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from peers.makers.common import HP, inputs, install_stubs, mount, save
from peers.makers.verl_step import critic, entropy, kl_loss, policy_terms, reward_kl

# (estimator, kl_in, loss_agg_mode, clip_low, clip_high, entropy_coeff, one row's log-ratio offset)
CASES: list[tuple[str, str, str, float, float | None, float, float]] = [
    ("k1", "reward", "token-mean", 0.2, None, 0.0, 0.0),
    ("k3", "loss", "seq-mean-token-mean", 0.2, 0.28, 0.01, 0.0),
    ("k2", "reward", "seq-mean-token-mean", 0.2, None, 0.0, 11.0),
]
SET = {"policy_loss": "gspo", "dual_clip": "none", "log_ratio_clamp": 10.0}
"""The ``--set`` keys of every case on top of ``--preset verl``."""


def _config(actor_config: Any, lo: float, hi: float | None) -> Any:
    """A real ``verl.workers.config.ActorConfig`` with the clip ranges (as ``tools/peers gspo``)."""
    return actor_config(
        strategy="fsdp", clip_ratio=lo, clip_ratio_low=lo, clip_ratio_high=hi if hi is not None else lo,
        ppo_micro_batch_size_per_gpu=1, rollout_n=1,
    )  # fmt: skip


def make(out: Path) -> list[str]:
    import torch

    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
    install_stubs()
    mount("verl")
    from verl.trainer.ppo import core_algos as ca  # type: ignore[import-not-found]  # side venv only
    from verl.workers.config import ActorConfig  # type: ignore[import-not-found]  # side venv only

    gspo = ca.get_policy_loss_fn("gspo")
    made = []
    for i, (est, kl_in, agg, lo, hi, ent, offset) in enumerate(CASES):
        x = inputs(300 + i)
        m = x["response_mask"]
        kl, rewards = reward_kl(ca, x, est, kl_in)
        adv, ret = ca.compute_gae_advantage_return(rewards, x["old_values"], m, HP["gamma"], HP["lam"])
        if offset:  # the first row with a negative advantage: its unclipped branch reads the clamp
            b = int(((adv < 0) & (m > 0)).any(dim=1).nonzero()[0])
            x["logprobs"][b] = torch.where(m[b] > 0, x["logprobs"][b] + offset, x["logprobs"][b])
        cfg = _config(ActorConfig, lo, hi)
        pg, metrics = gspo(x["old_logprobs"], x["logprobs"], adv, m, loss_agg_mode=agg, config=cfg)
        ent_term = entropy(ca, x, agg)
        dump: dict[str, Any] = dict(x)
        loss = kl_loss(ca, x, est, kl_in, agg, dump, pg - ent * ent_term)
        dump.update(kl=kl, token_rewards=rewards, advantages=adv, returns=ret, **policy_terms(pg, metrics))
        dump.update(critic(ca, x, ret, agg), entropy_loss=ent_term.detach(), loss=loss.detach())
        hp = dict(HP, cliprange=lo, ent_coef=ent)
        if hi is not None:
            hp["cliprange_high"] = hi
        conv = {"kl_estimator": est, "kl_in": kl_in, "loss_agg": agg, **SET}
        name = f"verl_gspo_{est}_{kl_in}_{agg}" + (f"_hi{hi}" if hi else "") + ("_clamped" if offset else "")
        control = {"log_ratio_clamp": "none"} if offset else {"policy_loss": "vanilla"}
        made.append(save(out, name, dump, hp, conv, control))
    return made
