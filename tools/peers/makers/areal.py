"""AReaL 1.0.4 dumps from its own functions (run with the ``skyrl-areal`` venv's python).

Called: ``areal/trainer/ppo/actor.py::PPOActor._compute_advantages`` (score bias/scale/clip, the KL
reward, the score slot, GAE, ``adv_norm``) on a stand-in ``self`` holding the attributes its
``__init__`` sets; ``areal/utils/data.py::KLEstimator`` and ``Normalization``;
``areal/utils/functional/functional.py::ppo_actor_loss_fn`` and ``ppo_critic_loss_fn``.

AReaL works on prompt + response sequences whose log-probs are shifted by one (``torch.roll``). The
batch here has a one-token prompt and width ``T + 2``, so in AReaL's rolled frame the response sits
at positions ``0..L−1`` and every row keeps at least one padded slot (no row is "truncated": AReaL
bootstraps a truncated row from a value beyond the response, which a response-only dump lacks).
AReaL asserts float32 in its critic loss, so the dumps are float32.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

from peers.makers import holes
from peers.makers.common import HP as COMMON_HP
from peers.makers.common import inputs, install_stubs, mount, save

HP: dict[str, float] = {**COMMON_HP, "whiten_eps": 1e-5}

# (name, kl_estimator, adv_norm (mean_level, std_level, unbiased) or None, reward (bias, scale, clip),
#  eps_clip_higher, c_clip); the second case uses NormConfig.eps = 0.1 (EPS_CASES) so that σ + eps and
#  sqrt(σ² + eps) differ beyond float32 rounding.
CASES: list[tuple[str, str, Any, tuple[float, float, float], float | None, float | None]] = [
    ("default_k1", "k1", None, (0.0, 1.0, 20.0), None, None),
    ("k3_advnorm_asym_dualclip", "k3", ("batch", "batch", True), (0.0, 1.0, 20.0), 0.28, 3.0),
    ("k2_center_reward_affine", "k2", ("batch", None, True), (0.5, 2.0, 5.0), None, None),
    ("k1_scale_population_c2", "k1", (None, "batch", False), (-0.3, 0.5, 20.0), None, 2.0),
    ("k3_advnorm_population", "k3", ("batch", "batch", False), (0.0, 1.0, 3.0), 0.3, None),
]


EPS_CASES: dict[str, float] = {"k3_advnorm_asym_dualclip": 0.1}
CONTROLS: dict[str, dict[str, Any]] = {
    # flipping the option each case exercises must break the match
    "default_k1": {"approx_kl": "k1"},
    "k3_advnorm_asym_dualclip": {"whiten_eps_at": "variance"},
    "k2_center_reward_affine": {"score_bias": 0.0},
    "k1_scale_population_c2": {"whiten_advantages": "masked"},
    "k3_advnorm_population": {"whiten_variance": "unbiased"},
}


def _norm_key(norm: Any) -> dict[str, Any]:
    if norm is None:
        return {"whiten_advantages": "none"}
    mean_level, std_level, unbiased = norm
    kind = "masked" if mean_level and std_level else ("center" if mean_level else "scale")
    return {"whiten_advantages": kind, "whiten_variance": "unbiased" if unbiased else "population"}


def make(out: Path) -> list[str]:
    import torch

    install_stubs(extra=("areal.infra", "areal.experimental", "transformers"))
    mount("areal")
    mount("areal.trainer")
    from areal.api.cli_args import NormConfig  # type: ignore[import-not-found]  # side venv only
    from areal.trainer.ppo.actor import PPOActor  # type: ignore[import-not-found]  # side venv only
    from areal.utils.data import KLEstimator, Normalization  # type: ignore[import-not-found]  # side venv
    from areal.utils.functional import (  # type: ignore[import-not-found]  # side venv only
        ppo_actor_loss_fn,
        ppo_critic_loss_fn,
    )

    made = []
    for i, (name, est, norm, (bias, scale, rclip), eps_hi, c_clip) in enumerate(CASES):
        x = inputs(500 + i, dtype=torch.float32, full_row=False)
        m = x["response_mask"]
        B, T = m.shape
        W = T + 2
        mb = m.bool()
        # Input frame: prompt token at 0, response token j at j + 1; rolled frame: response j at j.
        attn = torch.zeros(B, W, dtype=torch.long)
        attn[:, : 1 + T] = torch.cat([torch.ones(B, 1, dtype=torch.long), m.long()], dim=1)
        loss_mask_in = torch.zeros(B, W, dtype=torch.float32)
        loss_mask_in[:, 1 : 1 + T] = m
        junk = torch.full((B, W), 7.5, dtype=torch.float32)
        logprobs_in = junk.clone()
        logprobs_in[:, 1 : 1 + T] = x["old_logprobs"]
        ref_rolled = junk.clone()
        ref_rolled[:, :T] = x["ref_logprobs"]
        values_rolled = junk.clone()
        values_rolled[:, :T] = x["old_values"]
        data: dict[str, Any] = {
            "input_ids": torch.ones(B, W, dtype=torch.long),
            "attention_mask": attn,
            "loss_mask": loss_mask_in,
            "logprobs": logprobs_in,
            "ref_logp": ref_rolled.clone(),
            "values": values_rolled,
            "rewards": x["scores"].clone(),
        }
        cfg = types.SimpleNamespace(
            overlong_reward_penalty=False, use_decoupled_loss=False, recompute_logprob=False
        )
        adv_norm = None
        eps = EPS_CASES.get(name, HP["whiten_eps"])
        if norm is not None:
            adv_norm = Normalization(
                NormConfig(mean_level=norm[0], std_level=norm[1], std_unbiased=norm[2], eps=eps)
            )
        actor = types.SimpleNamespace(
            config=cfg,
            reward_bias=bias,
            reward_scaling=scale,
            reward_clip=rclip,
            reward_norm=None,
            kl_ctl=HP["kl_coef"],
            kl_estimator=KLEstimator(est),
            adv_norm=adv_norm,
            discount=HP["gamma"],
            gae_lambda=HP["lam"],
            mask_no_eos_with_zero=False,
        )
        res = PPOActor._compute_advantages(actor, data)
        adv = res["advantages"][:, :T]
        ret = res["returns"][:, :T]
        rewards = res["tot_rewards"][:, :T]
        kl = KLEstimator(est)(x["old_logprobs"] * m, x["ref_logprobs"] * m)
        pg, st = ppo_actor_loss_fn(
            logprobs=x["logprobs"],
            proximal_logprobs=x["old_logprobs"],
            old_logprobs=x["old_logprobs"],
            advantages=adv,
            eps_clip=HP["cliprange"],
            loss_mask=mb,
            eps_clip_higher=eps_hi,
            c_clip=c_clip,
        )
        vf, vst = ppo_critic_loss_fn(x["values"], x["old_values"], ret, HP["cliprange_value"], loss_mask=mb)
        n = mb.sum().to(torch.float32)
        dump: dict[str, Any] = {k: v for k, v in x.items() if k != "entropy"}
        dump.update(
            kl=kl,
            token_rewards=rewards,
            advantages=adv,
            returns=ret,
            pg_loss=pg.detach(),
            pg_clipfrac=st["clip_mask"].sum().to(torch.float32) / n,
            approx_kl=torch.where(mb, st["approx_kl"], 0.0).sum() / n,
            vf_loss=vf.detach(),
            vf_clipfrac=vst["clip_mask"].sum().to(torch.float32) / n,
            loss=pg.detach(),
        )
        hp = dict(HP, whiten_eps=eps)
        if eps_hi is not None:
            hp["cliprange_high"] = eps_hi
        conv: dict[str, Any] = {
            "kl_estimator": est,
            "score_bias": bias,
            "score_scale": scale,
            "score_clip": rclip,
        }
        conv.update(_norm_key(norm))
        if c_clip is not None:
            conv["dual_clip"] = c_clip
        made.append(save(out, f"areal_{name}", dump, hp, conv, CONTROLS[name]))
    fns = {
        "NormConfig": NormConfig,
        "PPOActor": PPOActor,
        "KLEstimator": KLEstimator,
        "Normalization": Normalization,
        "ppo_actor_loss_fn": ppo_actor_loss_fn,
        "ppo_critic_loss_fn": ppo_critic_loss_fn,
    }
    return made + holes.areal_cases(fns, out, HP)
