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
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the package ``peers``

from peers.makers.common import HP, inputs, install_stubs, mount, save
from peers.makers.verl_step import VerlActorConfig, critic, entropy, kl_loss, policy_terms, reward_kl

# (estimator, loss_agg_mode, clip_low, clip_high, clip_ratio_c, entropy_coeff, control kl_in)
CASES: list[tuple[str, str, float, float | None, float, float, str]] = [
    ("k3", "token-mean", 0.2, 0.28, 3.0, 0.01, "reward"),
    ("k1", "seq-mean-token-mean", 0.2, None, 3.0, 0.0, "loss"),
    ("k2", "token-mean", 0.2, None, 3.0, 0.0, "reward"),
]


def make(out: Path) -> list[str]:
    """One dump per case of :data:`CASES` (module docstring)."""
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
    return made


if __name__ == "__main__":
    print(make(Path(sys.argv[1])))
