"""OpenRLHF 0.11.2 containers for ``tools/peers adapters`` (see :mod:`peers.makers.adapters`)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

from peers.makers.adapters import corrupt, save_case
from peers.makers.common import inputs, install_stubs, mount

OPENRLHF_CASES: list[dict[str, Any]] = [
    {"name": "openrlhf_k1_reward_token-mean", "est": "k1", "use_loss": False, "agg": "token-mean"},
    {
        "name": "openrlhf_k3_loss_seq_dual",
        "est": "k3",
        "use_loss": True,
        "agg": "seq-mean-token-mean",
        "eps": (0.2, 0.28),
        "dual": 3.0,
        "ent": 0.01,
    },
    # Experience.rollout_log_probs (vLLM's) and PolicyLoss's IS correction (token, clip to [0.5, 1.5])
    {
        "name": "openrlhf_k1_reward_token-mean_is_clip",
        "est": "k1",
        "use_loss": False,
        "agg": "token-mean",
        "is": ("clip", (0.5, 1.5)),
    },
]


def _ns(**kw: Any) -> types.SimpleNamespace:
    return types.SimpleNamespace(**kw)


def _openrlhf_import() -> dict[str, Any]:
    install_stubs()
    for n in ("openrlhf", "openrlhf.models", "openrlhf.trainer", "openrlhf.trainer.ppo_utils"):
        mount(n)
    for n in ("openrlhf.trainer.ray", "openrlhf.utils"):
        mount(n)
    launcher = types.ModuleType("openrlhf.trainer.ray.launcher")
    launcher.RayActorGroup = object  # type: ignore[attr-defined]  # stand-in; never used
    sys.modules[launcher.__name__] = launcher
    from openrlhf.models import loss  # type: ignore[import-not-found]  # side venv only
    from openrlhf.models.utils import compute_approx_kl  # type: ignore[import-not-found]
    from openrlhf.trainer.ppo_utils.experience import Experience  # type: ignore[import-not-found]
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker  # type: ignore[import-not-found]

    return dict(loss=loss, kl=compute_approx_kl, Experience=Experience, Maker=RemoteExperienceMaker)


def make(out: Path, v2: bool) -> list[dict[str, Any]]:
    """Each case of :data:`OPENRLHF_CASES` as an adapter dump with its control (``returns``
    corrupted); returns the records of :func:`peers.makers.adapters.save_case`."""
    import torch

    from refppo.capture.adapters.openrlhf import from_openrlhf, openrlhf_hparams

    o = _openrlhf_import()
    made = []
    for i, case in enumerate(OPENRLHF_CASES):
        x = inputs(400 + i, dtype=torch.float32)  # OpenRLHF whitens in float32 (``.float()``)
        args = _args(case)
        exp, kl = _experience(o, args, x, case)
        kw = _update(o, exp, x, case)
        kw.update(
            kl=None if case["use_loss"] else kl, ref_logprobs=None if case["use_loss"] else x["ref_logprobs"]
        )
        dump = from_openrlhf(exp, **kw)
        exp.returns = corrupt(exp.returns, exp.action_mask)
        control = from_openrlhf(
            exp,
            ref_logprobs=kw["ref_logprobs"],
            kl=kw["kl"],
            value_loss=kw["value_loss"],
            values=kw["values"],
        )
        controls = [(control, "returns")]
        if "is" in case:  # behaviour := proximal (every weight 1): the loss must move
            controls.append(({**dump, "rollout_logprobs": dump["old_logprobs"].clone()}, "pg_loss"))
        made.append(save_case(out, case["name"], dump, controls, openrlhf_hparams(args), v2))
    return made


def _args(case: dict[str, Any]) -> types.SimpleNamespace:
    """The ``args`` of OpenRLHF's strategy for ``case`` (GAE, the case's KL, clip, aggregation)."""
    return _ns(
        algo=_ns(
            advantage=_ns(estimator="gae", gamma=0.99, lambd=0.95, no_std_norm=False, **_is_args(case)),
            kl=_ns(estimator=case["est"], use_loss=case["use_loss"], init_coef=0.05),
        ),
        actor=_ns(
            eps_clip_low_high=case.get("eps", (0.2, 0.2)),
            dual_clip=case.get("dual"),
            entropy_coef=case.get("ent", 0.0),
            loss_agg_mode=case["agg"],
        ),
        critic=_ns(value_clip=0.5),
        rollout=_ns(n_samples_per_prompt=1),
        reward=_ns(clip_range=(-10.0, 10.0), overlong_buffer_len=None, stop_properly_penalty_coef=None),
    )


def _is_args(case: dict[str, Any]) -> dict[str, Any]:
    """``args.algo.advantage``'s IS-correction keys (``ppo_actor.py`` passes them to ``PolicyLoss``)."""
    if "is" not in case:
        return {"is_correction_level": "off"}
    mode, bounds = case["is"]
    return {
        "is_correction_level": "token",
        "is_correction_mode": mode,
        "is_correction_gating": "ratio",
        "is_correction_threshold": list(bounds),
    }


def _experience(o: dict[str, Any], args: Any, x: dict[str, Any], case: dict[str, Any]) -> tuple[Any, Any]:
    """The ``Experience`` as ``make_experience`` leaves it, through the real
    ``compute_advantages_and_returns`` (stand-in ``self``); returns it and its ``kl``."""
    import functools

    import torch

    m = x["response_mask"].bool()
    # make_experience: KL of the experience-time log-probs, zero when the KL is a loss term
    kl = (
        torch.zeros_like(x["old_logprobs"])
        if case["use_loss"]
        else o["kl"](x["old_logprobs"], x["ref_logprobs"], kl_estimator=case["est"])
    )
    more = {}
    if "is" in case:  # vLLM's log-probs of the sampled tokens (junk on padding)
        g = torch.Generator().manual_seed(77)
        beh = x["old_logprobs"] - 0.6 * torch.randn(m.shape, generator=g, dtype=x["old_logprobs"].dtype)
        more["rollout_log_probs"] = torch.where(m, beh, torch.full_like(beh, 7.5))
    exp = o["Experience"](
        **more,
        action_mask=m,
        action_log_probs=x["old_logprobs"],
        values=x["old_values"],
        rewards=x["scores"],
        base_action_log_probs=x["ref_logprobs"] if case["use_loss"] else None,
        kl=kl,
        index=list(range(m.shape[0])),
    )
    maker = _ns(
        strategy=_ns(args=args),
        advantage_estimator="gae",
        kl_ctl=_ns(value=0.05),
        get_advantages_and_returns=functools.partial(o["Maker"].get_advantages_and_returns, None),
    )
    (exp,) = o["Maker"].compute_advantages_and_returns(maker, [exp])
    return exp, kl


def _update(o: dict[str, Any], exp: Any, x: dict[str, Any], case: dict[str, Any]) -> dict[str, Any]:
    """``PolicyLoss``/``ValueLoss``/``aggregate_loss`` on the experience, with ``backward`` on the
    ``[B, T]`` leaves; returns the adapter's keyword arguments (``kl``/``ref_logprobs`` aside)."""
    eps = case.get("eps", (0.2, 0.2))
    tl = case["agg"] == "token-mean"
    lp = x["logprobs"].clone().requires_grad_(True)
    vp = x["values"].clone().requires_grad_(True)
    adv_args = _is_args(case)
    is_kw = {k: v for k, v in adv_args.items() if k.startswith("is_")}
    pol = o["loss"].PolicyLoss(eps[0], eps[1], dual_clip=case.get("dual"), token_level_loss=tl, **is_kw)(
        lp, exp.action_log_probs, exp.advantages, action_mask=exp.action_mask,
        rollout_log_probs=exp.rollout_log_probs,
    )  # fmt: skip
    vf = o["loss"].ValueLoss(0.5)(vp, exp.values, exp.returns, action_mask=exp.action_mask)
    ent = o["loss"].aggregate_loss(x["entropy"], exp.action_mask)  # training_step: token level
    loss = pol[0] - ent * case.get("ent", 0.0)
    kl_loss = None
    if case["use_loss"]:
        kl_loss = o["loss"].aggregate_loss(
            o["kl"](lp, exp.base_action_log_probs, kl_estimator=case["est"]), exp.action_mask
        )
        loss = loss + kl_loss * 0.05
    loss.backward()
    vf.backward()
    return {
        "policy_loss": pol,
        "value_loss": vf,
        "logprobs": lp,
        "values": vp,
        "entropy": x["entropy"],
        "entropy_loss": ent,
        "kl_loss": kl_loss,
        "loss": loss,
    }
