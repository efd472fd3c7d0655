"""verl 0.9.1 steps with the KL in the reward and a KL loss both on (``verl-openrlhf`` venv;
nothing from refppo).

verl's two switches are independent: ``algorithm.use_kl_in_reward`` subtracts ``β·KL`` of the
rollout from the token rewards (``verl/trainer/ppo/ray_trainer.py::apply_kl_penalty``, restated as
:func:`peers.makers.verl_step.reward_kl` does: the real one wants a ``DataProto``), and
``actor.use_kl_loss`` adds ``kl_loss_coef·agg(KL(π_θ‖π_ref))`` of the current log-probs to the
actor loss (``verl/workers/utils/losses.py::ppo_loss``; ``verl/trainer/ppo/utils.py::
need_reference_policy`` reads ``use_kl_in_reward or use_kl_loss``). Each case turns both on with
``kl_ctrl.kl_coef = kl_loss_coef = β`` and ``kl_penalty = kl_loss_type`` (refppo's ``kl_in=both``:
one β, one estimator); the rest is verl's own ``core_algos`` (``kl_penalty``,
``compute_gae_advantage_return``, ``compute_policy_loss_vanilla``, ``compute_value_loss``,
``agg_loss``) as :func:`peers.makers.verl_openrlhf.make_verl` runs it. Controls: ``kl_in=reward``
(no KL loss) and ``kl_in=loss`` (no KL in the rewards).

:data:`SEPARATE` cases set the two apart, as verl's config lets a user: the reward's
``kl_ctrl.kl_coef = HP["kl_coef"]`` (0.05) and ``kl_penalty``, the loss's ``kl_loss_coef`` and
``kl_loss_type`` (refppo's ``kl_loss_coef`` and ``kl_loss_estimator``; the preset gives the loss
estimator its own clamps, ``kl_penalty_forward``'s for ``low_var_kl``). ``far_ref`` puts the reference
25 nats below the policy on three tokens of row 0, so ``low_var_kl``'s clamps (log-ratio to
[−20, 20], the estimate to 10) bind there. Control: one β and one estimator (the keys unset).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the package ``peers``

from peers.makers.common import HP, inputs, install_stubs, mount, save
from peers.makers.verl_step import VERL_KL, VerlActorConfig, critic, entropy, kl_loss, policy_terms, reward_kl

# (estimator, loss_agg_mode, clip_low, clip_high, clip_ratio_c, entropy_coeff, control kl_in)
CASES: list[tuple[str, str, float, float | None, float, float, str]] = [
    ("k3", "token-mean", 0.2, 0.28, 3.0, 0.01, "reward"),
    ("k1", "seq-mean-token-mean", 0.2, None, 3.0, 0.0, "loss"),
    ("k2", "token-mean", 0.2, None, 3.0, 0.0, "reward"),
]


# (reward estimator, loss estimator, loss β, loss_agg_mode, far_ref)
SEPARATE: list[tuple[str, str, float, str, bool]] = [
    ("k1", "k3", 0.1, "token-mean", False),
    ("k1", "k3", 0.1, "seq-mean-token-mean", True),
    ("k3", "k2", 0.02, "token-mean", False),
]


def make(out: Path) -> list[str]:
    """One dump per case of :data:`CASES` and :data:`SEPARATE` (module docstring)."""
    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
    install_stubs()
    mount("verl")
    from verl.trainer.ppo import core_algos as ca  # type: ignore[import-not-found]  # side venv only

    made = []
    for i, (est, agg, lo, hi, c, ent, control) in enumerate(CASES):
        x = inputs(960 + i)
        kl, rewards = reward_kl(ca, x, est, "reward")  # use_kl_in_reward
        adv, ret = ca.compute_gae_advantage_return(
            rewards, x["old_values"], x["response_mask"], HP["gamma"], HP["lam"]
        )
        pg, metrics = ca.compute_policy_loss_vanilla(
            x["old_logprobs"], x["logprobs"], adv, x["response_mask"], loss_agg_mode=agg,
            config=VerlActorConfig(lo, lo, hi, c),
        )  # fmt: skip
        ent_term = entropy(ca, x, agg)
        dump: dict[str, Any] = dict(x)
        loss = kl_loss(ca, x, est, "loss", agg, dump, pg - ent * ent_term)  # use_kl_loss
        dump.update(kl=kl, token_rewards=rewards, advantages=adv, returns=ret, **policy_terms(pg, metrics))
        dump.update(critic(ca, x, ret, agg), entropy_loss=ent_term.detach(), loss=loss.detach())
        hp = dict(HP, cliprange=lo, ent_coef=ent)
        if hi is not None:
            hp["cliprange_high"] = hi
        conv = {"kl_estimator": est, "kl_in": "both", "loss_agg": agg, "dual_clip": c}
        made.append(save(out, f"verl_kl_both_{est}_{agg}", dump, hp, conv, {"kl_in": control}))
    for i, case in enumerate(SEPARATE):
        made.append(_separate(ca, out, 970 + i, *case))
    return made


def _separate(ca: Any, out: Path, seed: int, e_r: str, e_l: str, beta_l: float, agg: str, far: bool) -> str:
    """One :data:`SEPARATE` case: ``use_kl_in_reward`` under ``(kl_coef, kl_penalty) = (0.05, e_r)``,
    ``use_kl_loss`` under ``(kl_loss_coef, kl_loss_type) = (beta_l, e_l)``; the rest as :func:`make`."""
    x = inputs(seed)
    if far:
        x["ref_logprobs"][0, :3] = x["logprobs"][0, :3] - 25.0
    kl, rewards = reward_kl(ca, x, e_r, "reward")  # β_r = HP["kl_coef"]
    adv, ret = ca.compute_gae_advantage_return(
        rewards, x["old_values"], x["response_mask"], HP["gamma"], HP["lam"]
    )
    pg, metrics = ca.compute_policy_loss_vanilla(
        x["old_logprobs"], x["logprobs"], adv, x["response_mask"], loss_agg_mode=agg,
        config=VerlActorConfig(0.2, 0.2, None, 3.0),
    )  # fmt: skip
    kld = ca.kl_penalty(x["logprobs"], x["ref_logprobs"], kl_penalty=VERL_KL[e_l])  # actor.kl_loss_type
    term = ca.agg_loss(loss_mat=kld, loss_mask=x["response_mask"], loss_agg_mode=agg)
    dump: dict[str, Any] = dict(x)
    dump.update(kl=kl, token_rewards=rewards, advantages=adv, returns=ret, **policy_terms(pg, metrics))
    dump.update(critic(ca, x, ret, agg), entropy_loss=entropy(ca, x, agg).detach())
    dump.update(kl_loss=term.detach(), loss=(pg + beta_l * term).detach())  # ppo_loss: + kl_loss_coef·kl_loss
    hp = dict(HP, cliprange=0.2, ent_coef=0.0, kl_loss_coef=beta_l)
    conv = {"kl_estimator": e_r, "kl_in": "both", "loss_agg": agg, "dual_clip": 3.0, "kl_loss_estimator": e_l}
    control = {"kl_loss_estimator": None, "kl_loss_coef": None}
    return save(out, f"verl_kl_sep_{e_r}_{e_l}_{agg}{'_far' if far else ''}", dump, hp, conv, control)


if __name__ == "__main__":
    print(make(Path(sys.argv[1])))
