"""Multi-turn dumps (``response_mask`` with interior holes) from the peers' own GAE code.

A multi-turn row is ``assistant turn, tool output, assistant turn, …``: the tool-output tokens are
real tokens (they have log-probs and critic values) that the losses mask out. :func:`inputs_holes`
draws such rows: random spans inside each row become holes (mask 0, real values kept), the padding
after the last valid token holds junk, and every row ends with an assistant token (its last valid
token is the end of the response, where each peer puts the score).

Each peer's hole handling, by its own functions (run in its side venv; nothing from refppo):

- verl 0.9.1 ``core_algos.compute_gae_advantage_return`` on the holed ``response_mask`` (the
  multi-turn agent loop zeroes tool-output tokens in ``response_mask``): skips the holes.
- OpenRLHF 0.11.2 ``RemoteExperienceMaker.get_advantages_and_returns`` on the holed
  ``action_mask`` (agent mode, ``samples_generator.py``: ``action_mask[start:end] = 1`` per action
  range): zeroes ``V`` and ``r`` on the holes and recurses through them.
- SkyRL-train 0.3.1 ``ppo_utils.compute_gae_advantage_return`` on the right-padded
  ``response_mask`` (``trainer.py::compute_advantages_and_returns`` passes ``data["response_mask"]``;
  the holes are in ``loss_mask`` only): through the holes, whitened over the envelope; the KL,
  policy and value losses use ``loss_mask`` (``apply_reward_kl_penalty``, ``worker.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peers.makers.areal_frame import Norm, advantages, rolled_batch, step_dump
from peers.makers.common import HP, inputs, save
from peers.makers.openrlhf_step import shaped_gae
from peers.makers.verl_step import critic, policy_terms, reward_kl


def inputs_holes(seed: int, B: int = 8, T: int = 20, dtype: Any = None, full: bool = False) -> dict[str, Any]:
    """:func:`inputs` with interior holes: 1–3 spans of 1–4 tokens per row (real values kept there).

    ``full``: no right padding (every row's last token is valid), so that only the holes differ
    between the GAE conventions whatever ``gae_padding`` says.
    """
    import torch

    x = inputs(seed, B=B, T=T, dtype=dtype)
    g = torch.Generator().manual_seed(10_000 + seed)
    m0 = x["response_mask"] != 0
    shape, dt = tuple(m0.shape), x["old_values"].dtype
    fill = {  # tool-output tokens are real tokens: finite log-probs, values and entropies there
        "old_logprobs": -torch.rand(shape, generator=g, dtype=dt) * 3.0 - 0.1,
        "ref_logprobs": -torch.rand(shape, generator=g, dtype=dt) * 3.0 - 0.1,
        "logprobs": -torch.rand(shape, generator=g, dtype=dt) * 3.0 - 0.1,
        "old_values": torch.randn(shape, generator=g, dtype=dt),
        "values": torch.randn(shape, generator=g, dtype=dt),
        "entropy": torch.rand(shape, generator=g, dtype=dt) * 2.0,
    }
    if full:
        x.update({k: torch.where(m0, x[k], v) for k, v in fill.items()})
        m0 = torch.ones_like(m0)
    m = m0.clone()
    for b, L in enumerate(m0.sum(dim=1).tolist()):
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            if L < 3:
                break
            start = int(torch.randint(0, L - 2, (1,), generator=g))  # never the last token
            width = int(torch.randint(1, 5, (1,), generator=g))
            m[b, start : min(start + width, L - 1)] = False
    hole = m0 & ~m
    out = dict(x)
    out.update({k: torch.where(hole, v, x[k]) for k, v in fill.items()})
    out["response_mask"] = m.to(x["response_mask"].dtype)
    return out


def _last_valid(m: Any) -> Any:
    import torch

    T = m.shape[1]
    return torch.where(m != 0, torch.arange(T), -1).amax(dim=1)


def verl_cases(ca: Any, out: Path, policy_cfg: Any) -> list[str]:
    """verl multi-turn: GAE + whitening + losses over the holed ``response_mask`` (``ca``: core_algos)."""
    made = []
    for i, agg in enumerate(("token-mean", "seq-mean-token-mean")):
        x = inputs_holes(700 + i)
        m = x["response_mask"]
        # naive reward manager: score at valid_response_length − 1 (attention mask: the envelope end)
        kl, rewards = reward_kl(ca, x, "k1", "reward", last=_last_valid(m))
        adv, ret = ca.compute_gae_advantage_return(rewards, x["old_values"], m, HP["gamma"], HP["lam"])
        pg, metrics = ca.compute_policy_loss_vanilla(
            x["old_logprobs"], x["logprobs"], adv, m, loss_agg_mode=agg, config=policy_cfg
        )
        dump: dict[str, Any] = dict(x)
        dump.update(kl=kl, token_rewards=rewards, advantages=adv, returns=ret, **policy_terms(pg, metrics))
        dump.update(critic(ca, x, ret, agg), loss=pg.detach())
        conv = {"kl_estimator": "k1", "kl_in": "reward", "loss_agg": agg, "dual_clip": 3.0}
        made.append(save(out, f"verl_holes_{agg}", dump, dict(HP), conv, {"gae_holes": "zero"}))
    return made


def openrlhf_cases(fns: dict[str, Any], out: Path) -> list[str]:
    """OpenRLHF agent mode: ``compute_reward`` + GAE + whitening + losses over the holed ``action_mask``."""
    made = []
    for i, token_level in enumerate((True, False)):
        x = inputs_holes(800 + i)
        m = x["response_mask"]
        kl, rewards, adv, ret = shaped_gae(fns, x, "k1", HP["kl_coef"])
        pg, clip_ratio, ppo_kl, _, _ = fns["PolicyLoss"](0.2, 0.2, token_level_loss=token_level)(
            x["logprobs"], x["old_logprobs"], adv, action_mask=m
        )
        vf = fns["ValueLoss"](HP["cliprange_value"])(x["values"], x["old_values"], ret, action_mask=m)
        dump: dict[str, Any] = dict(x)
        dump.update(
            kl=kl,
            token_rewards=rewards,
            advantages=adv,
            returns=ret,
            pg_loss=pg.detach(),
            pg_clipfrac=clip_ratio.detach(),
            approx_kl=ppo_kl.detach(),
            vf_loss=(vf[0] if isinstance(vf, tuple) else vf).detach(),
            loss=pg.detach(),
        )
        agg = "token-mean" if token_level else "seq-mean-token-mean"
        conv = {"kl_estimator": "k1", "kl_in": "reward", "loss_agg": agg}
        made.append(save(out, f"openrlhf_holes_{agg}", dump, dict(HP), conv, {"gae_holes": "skip"}))
    return made


def skyrl_cases(pu: Any, out: Path, cfg_for: Any) -> list[str]:
    """SkyRL multi-turn: GAE on ``response_mask`` (no holes), KL and losses on ``loss_mask`` (holes)."""
    import torch

    made = []
    cases: list[tuple[str, bool, dict[str, Any]]] = [
        # full rows: only the holes tell the GAE conventions apart (gae_padding is moot)
        ("token_mean", True, {"gae_padding": "masked", "gae_holes": "skip"}),
        ("sequence_mean", False, {"whiten_holes": "exclude"}),
    ]
    for i, (red, full, control) in enumerate(cases):
        x = inputs_holes(900 + i, dtype=torch.float32, full=full)
        lm = x["response_mask"]  # the dump's mask is SkyRL's loss_mask
        B, T = lm.shape
        last = _last_valid(lm)
        rm = (torch.arange(T) <= last.unsqueeze(1)).to(lm.dtype)  # response_mask: right-padded
        kl = pu.compute_approx_kl(x["old_logprobs"], x["ref_logprobs"], loss_mask=lm, kl_estimator_type="k1")
        rewards = torch.zeros_like(lm)
        rewards[torch.arange(B), last] = x["scores"]  # the generator's reward at the last assistant token
        rewards = rewards - kl * max(0.0, HP["kl_coef"])  # apply_reward_kl_penalty, restated
        adv, ret = pu.compute_gae_advantage_return(
            token_level_rewards=rewards,
            values=x["old_values"],
            response_mask=rm,
            gamma=HP["gamma"],
            lambd=HP["lam"],
        )
        cfg = cfg_for(red, T)
        pg, clip_ratio = pu.ppo_policy_loss(x["logprobs"], x["old_logprobs"], adv, cfg, loss_mask=lm)
        vf, vf_clipfrac = pu.ppo_critic_loss(x["values"], x["old_values"], ret, cfg, loss_mask=lm)
        dump: dict[str, Any] = dict(x)
        dump.update(
            kl=kl,
            token_rewards=rewards,
            advantages=adv,
            returns=ret,
            pg_loss=pg.detach(),
            pg_clipfrac=torch.tensor(clip_ratio, dtype=lm.dtype),
            vf_loss=vf.detach(),
            vf_clipfrac=torch.tensor(vf_clipfrac, dtype=lm.dtype),
            loss=pg.detach(),
        )
        agg = {"token_mean": "token-mean", "sequence_mean": "seq-mean-token-mean"}[red]
        conv = {"kl_estimator": "k1", "kl_in": "reward", "loss_agg": agg}
        made.append(save(out, f"skyrl_holes_{red}", dump, dict(HP), conv, control))
    return made


def areal_cases(fns: dict[str, Any], out: Path, hp: dict[str, float]) -> list[str]:
    """AReaL multi-turn: ``PPOActor._compute_advantages`` with the holes in ``loss_mask`` and the
    attention mask over every token of the response (tool outputs included), as its agent workflows
    build them. Frame and calls as in :mod:`peers.makers.areal_frame` (``fns``: its :func:`areal_fns`)."""
    import torch

    made = []
    norms: tuple[Norm, Norm] = (None, ("batch", "batch", True))
    for i, norm in enumerate(norms):
        x = inputs_holes(950 + i, dtype=torch.float32)
        m = x["response_mask"]
        env = torch.arange(m.shape[1]) <= _last_valid(m).unsqueeze(1)  # the response, tool outputs included
        res = advantages(fns, rolled_batch(x, env), hp, "k1", norm, hp["whiten_eps"], (0.0, 1.0, 20.0))
        dump = step_dump(fns, x, res, hp, "k1")
        conv: dict[str, Any] = {
            "kl_estimator": "k1",
            "whiten_advantages": "none" if norm is None else "masked",
        }
        name = "areal_holes_" + ("plain" if norm is None else "advnorm")
        made.append(save(out, name, dump, dict(hp), conv, {"gae_holes": "zero"}))
    return made
