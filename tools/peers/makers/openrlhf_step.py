"""The parts of one OpenRLHF 0.11.2 step that the OpenRLHF makers share (``verl-openrlhf`` venv;
nothing from refppo).

OpenRLHF: ``openrlhf/models/utils.py::compute_approx_kl``, ``compute_reward``;
``trainer/ppo_utils/experience_maker.py::get_advantages_and_returns`` (a method that does not use
``self``); ``models/loss.py::PolicyLoss``, ``ValueLoss``, ``aggregate_loss``. Restated (the real
method wants a list of ``Experience``): the batch whitening of ``compute_advantages_and_returns``
(masked mean, population variance, ``clamp(var, 1e-8).rsqrt()``). Used by
:mod:`peers.makers.verl_openrlhf`, :mod:`peers.makers.holes` and :mod:`peers.makers.openrlhf_correction`.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from peers.makers.common import HP, install_stubs, mount


def openrlhf_fns() -> dict[str, Any]:
    """OpenRLHF's ``compute_approx_kl``, ``compute_reward``, ``get_advantages_and_returns`` (as
    ``gae``), ``PolicyLoss``, ``ValueLoss``, ``aggregate_loss`` from its installed files (the Ray
    launcher stubbed)."""
    install_stubs()
    for n in ("openrlhf", "openrlhf.models", "openrlhf.trainer", "openrlhf.trainer.ppo_utils"):
        mount(n)
    for n in ("openrlhf.trainer.ray", "openrlhf.utils"):
        mount(n)
    launcher = types.ModuleType("openrlhf.trainer.ray.launcher")
    launcher.RayActorGroup = object  # type: ignore[attr-defined]  # stand-in; never used
    sys.modules[launcher.__name__] = launcher
    from openrlhf.models.loss import (  # type: ignore[import-not-found]  # side venv only
        PolicyLoss,
        ValueLoss,
        aggregate_loss,
    )
    from openrlhf.models.utils import (  # type: ignore[import-not-found]  # side venv only
        compute_approx_kl,
        compute_reward,
    )
    from openrlhf.trainer.ppo_utils.experience_maker import (  # type: ignore[import-not-found]  # side venv
        RemoteExperienceMaker,
    )

    return {
        "compute_approx_kl": compute_approx_kl,
        "compute_reward": compute_reward,
        "gae": RemoteExperienceMaker.get_advantages_and_returns,
        "PolicyLoss": PolicyLoss,
        "ValueLoss": ValueLoss,
        "aggregate_loss": aggregate_loss,
    }


def shaped_gae(fns: dict[str, Any], x: dict[str, Any], est: str, coef: float) -> tuple[Any, Any, Any, Any]:
    """``(kl, token_rewards, advantages, returns)``: OpenRLHF's KL of the rollout against the
    reference (estimator ``est``), ``compute_reward`` with β = ``coef`` and its reward clip ±10, GAE
    at ``HP``'s γ, λ, and the batch whitening (restated) of the advantages."""
    m = x["response_mask"]
    kl = fns["compute_approx_kl"](x["old_logprobs"], x["ref_logprobs"], kl_estimator=est)
    rewards = fns["compute_reward"](x["scores"], coef, kl, action_mask=m, reward_clip_range=(-10.0, 10.0))
    adv_raw, ret = fns["gae"](None, x["old_values"], rewards, m, HP["gamma"], HP["lam"])
    n = m.sum()
    mean = (adv_raw * m).sum() / n
    var = ((adv_raw - mean).pow(2) * m).sum() / n
    return kl, rewards, (adv_raw - mean) * var.clamp(min=1e-8).rsqrt(), ret
