"""AReaL 1.0.4 critic-free dumps: ``reward_norm`` with a group mean (run with the ``skyrl-areal`` venv).

The std at ``std_level`` ``group`` or ``batch`` (the latter: ``_compute_std`` of ``x`` around each
row's group mean, over the whole batch: refppo ``group_std_level=batch-centred``).

AReaL's GRPO family is its PPO actor without a critic: ``PPOActorConfig.reward_norm`` (a
``NormConfig`` with ``mean_level``/``std_level`` ``group``, ``group_size`` = the samples per prompt,
``mean_leave1out``, ``std_unbiased``, ``eps``) normalises the scalar scores per group, then
``_compute_advantages`` runs its GAE over zero values (no ``values`` in the batch) with γ = λ = 1,
so each token's advantage is the row's normalised score plus the return-to-go of ``−kl_ctl·KL``.

Called: ``areal/trainer/ppo/actor.py::PPOActor._compute_advantages`` on a stand-in ``self`` (as
``peers/makers/areal.py``, same one-token-prompt frame) with ``reward_norm`` =
``areal/utils/data.py::Normalization(NormConfig(...))`` and optionally ``adv_norm``;
``KLEstimator``; ``areal/utils/functional/functional.py::ppo_actor_loss_fn``. AReaL's groups are
contiguous blocks of ``group_size`` rows (``Normalization.__call__``): ``group_index`` =
``arange(B) // group_size``. float32 (AReaL's GAE stack). Nothing from refppo is imported.

:func:`make_no_reference`: every case with ``kl_ctl = 0`` and no ``ref_logp`` in the batch
(``_compute_advantages`` then takes zeros for it), dumps without ``ref_logprobs``/``kl``.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

from peers.makers.common import HP as COMMON_HP
from peers.makers.common import inputs, install_stubs, mount, save

B, T = 12, 10
Made = tuple[str, dict[str, Any], dict[str, Any], dict[str, Any], Any]
"""``(name, dump, hp, --set, control)``: the arguments of ``save``."""
HP: dict[str, float] = {**COMMON_HP, "gamma": 1.0, "lam": 1.0, "whiten_eps": 1e-5}

# (name, reward_norm (mean_level, std_level, leave1out, unbiased), group_size, adv_norm, kl_ctl,
#  kl_estimator, reward (bias, scale, clip), equal-score group, --set keys, control)
CASES: list[tuple[Any, ...]] = [
    ("grpo_k1", ("group", "group", False, True), 4, None, 0.05, "k1", (0.0, 1.0, 20.0), False,
     {"advantage": "grpo"}, {"group_kl": "fold"}),
    ("grpo_population_advnorm_k3", ("group", "group", False, False), 4, ("batch", "batch"), 0.05, "k3",
     (0.0, 1.0, 20.0), False,
     {"advantage": "grpo", "group_std": "population", "whiten_advantages": "masked"},
     {"group_std": "unbiased"}),
    ("grpo_equal_scores_n3", ("group", "group", False, True), 3, None, 0.05, "k2", (0.0, 1.0, 20.0), True,
     {"advantage": "grpo"}, {"advantage": "dr-grpo"}),
    ("dr_grpo", ("group", None, False, True), 4, None, 0.05, "k1", (0.0, 1.0, 20.0), False,
     {"advantage": "dr-grpo"}, {"advantage": "grpo"}),
    ("rloo_leave1out", ("group", None, True, True), 4, None, 0.05, "k1", (0.0, 1.0, 20.0), False,
     {"advantage": "rloo"}, {"advantage": "dr-grpo"}),
    ("grpo_reward_scale_clip", ("group", "group", False, True), 4, None, 0.05, "k1", (0.0, 2.0, 0.9), False,
     {"advantage": "grpo", "score_scale": 2.0, "score_clip": 0.9}, {"score_clip": 20.0}),
    ("grpo_group_size1", ("group", "group", False, True), 1, None, 0.05, "k1", (0.0, 1.0, 20.0), False,
     {"advantage": "grpo"}, {"group_singleton": "score"}),
    ("rloo_group_size1", ("group", None, True, True), 1, None, 0.05, "k1", (0.0, 1.0, 20.0), False,
     {"advantage": "rloo"}, {"group_singleton": "zero"}),
    # std_level batch under mean_level group: the std of x − (the row's group mean) over the batch
    ("grpo_std_batch", ("group", "batch", False, True), 4, None, 0.05, "k1", (0.0, 1.0, 20.0), False,
     {"advantage": "grpo", "group_std_level": "batch-centred"}, {"group_std_level": "batch"}),
    ("grpo_std_batch_population_n3", ("group", "batch", False, False), 3, None, 0.05, "k3",
     (0.0, 1.0, 20.0), True,
     {"advantage": "grpo", "group_std_level": "batch-centred", "group_std": "population"},
     {"group_std_level": "group"}),
]  # fmt: skip


def _frame(x: dict[str, Any]) -> dict[str, Any]:
    """AReaL's input frame (prompt token at 0, response token j at j + 1; see peers/makers/areal.py)."""
    import torch

    m = x["response_mask"]
    W = T + 2
    attn = torch.zeros(B, W, dtype=torch.long)
    attn[:, : 1 + T] = torch.cat([torch.ones(B, 1, dtype=torch.long), m.long()], dim=1)
    loss_mask_in = torch.zeros(B, W, dtype=torch.float32)
    loss_mask_in[:, 1 : 1 + T] = m
    junk = torch.full((B, W), 7.5, dtype=torch.float32)
    logprobs_in = junk.clone()
    logprobs_in[:, 1 : 1 + T] = x["old_logprobs"]
    ref_rolled = junk.clone()
    ref_rolled[:, :T] = x["ref_logprobs"]
    return {
        "input_ids": torch.ones(B, W, dtype=torch.long),
        "attention_mask": attn,
        "loss_mask": loss_mask_in,
        "logprobs": logprobs_in,
        "ref_logp": ref_rolled,
        "rewards": x["scores"].clone(),
    }  # no "values": _compute_advantages uses zeros (critic-free)


def make(out: Path) -> list[str]:
    """Run AReaL's own ``PPOActor._compute_advantages`` and ``ppo_actor_loss_fn`` on every case of
    :data:`CASES`; save each dump with its ``--set`` and control. Returns the dump names."""
    install_stubs(extra=("areal.infra", "areal.experimental", "transformers"))
    mount("areal")
    mount("areal.trainer")
    return [save(out, *_case(i, case)) for i, case in enumerate(CASES)]


def make_no_reference(out: Path) -> list[str]:
    """Every case of :data:`CASES` at β = 0 without a reference (module doc)."""
    install_stubs(extra=("areal.infra", "areal.experimental", "transformers"))
    mount("areal")
    mount("areal.trainer")
    return [save(out, *_case(i, case, no_reference=True)) for i, case in enumerate(CASES)]


def _case(i: int, case: tuple[Any, ...], no_reference: bool = False) -> Made:
    """One case of :data:`CASES` (seed ``800 + i``): ``(name, dump, hp, --set, control)`` for ``save``."""
    import torch
    from areal.api.cli_args import NormConfig  # type: ignore[import-not-found]  # side venv only
    from areal.trainer.ppo.actor import PPOActor  # type: ignore[import-not-found]  # side venv only
    from areal.utils.data import KLEstimator, Normalization  # type: ignore[import-not-found]  # side venv
    from areal.utils.functional import ppo_actor_loss_fn  # type: ignore[import-not-found]  # side venv

    name, rnorm, n, anorm, kl_ctl, est, (bias, scale, rclip), equal, conv, control = case
    kl_ctl = 0.0 if no_reference else kl_ctl
    x = inputs(800 + i, B=B, T=T, dtype=torch.float32, full_row=False)
    for k in ("old_values", "values", "entropy"):
        x.pop(k)
    x["scores"] = x["scores"] / 4.0
    if equal:
        x["scores"][:n] = 1.0  # σ = 0 in the first group
    x["group_index"] = torch.arange(B, dtype=torch.int64) // n
    m = x["response_mask"]
    mb = m.bool()
    mean_level, std_level, leave1out, unbiased = rnorm
    reward_norm = Normalization(
        NormConfig(
            mean_level=mean_level, std_level=std_level, mean_leave1out=leave1out,
            std_unbiased=unbiased, group_size=n, eps=HP["whiten_eps"],
        )
    )  # fmt: skip
    adv_norm = None
    if anorm is not None:
        adv_norm = Normalization(NormConfig(mean_level=anorm[0], std_level=anorm[1], eps=HP["whiten_eps"]))
    actor = types.SimpleNamespace(
        config=types.SimpleNamespace(
            overlong_reward_penalty=False, use_decoupled_loss=False, recompute_logprob=False
        ),
        reward_bias=bias, reward_scaling=scale, reward_clip=rclip, reward_norm=reward_norm,
        kl_ctl=kl_ctl, kl_estimator=KLEstimator(est), adv_norm=adv_norm,
        discount=HP["gamma"], gae_lambda=HP["lam"], mask_no_eos_with_zero=False,
    )  # fmt: skip
    frame = {k: v for k, v in _frame(x).items() if not (no_reference and k == "ref_logp")}
    res = PPOActor._compute_advantages(actor, frame)
    adv = res["advantages"][:, :T]
    kl = KLEstimator(est)(x["old_logprobs"] * m, x["ref_logprobs"] * m)
    pg, st = ppo_actor_loss_fn(
        logprobs=x["logprobs"], proximal_logprobs=x["old_logprobs"], old_logprobs=x["old_logprobs"],
        advantages=adv, eps_clip=HP["cliprange"], loss_mask=mb, eps_clip_higher=0.28, c_clip=None,
    )  # fmt: skip
    nt = mb.sum().to(torch.float32)
    dump: dict[str, Any] = dict(x)
    dump.update(
        kl=kl,
        advantages=adv,
        returns=res["returns"][:, :T],  # advantages + 0 values, before adv_norm: the raw ones
        pg_loss=pg.detach(),
        pg_clipfrac=st["clip_mask"].sum().to(torch.float32) / nt,
        approx_kl=torch.where(mb, st["approx_kl"], 0.0).sum() / nt,
        loss=pg.detach(),
    )
    if no_reference:
        return _noref(name, dump, conv, control)
    hp = dict(HP, kl_coef=kl_ctl, cliprange_high=0.28)
    return f"areal_grpo_{name}", dump, hp, {"kl_estimator": est, **conv}, control


def _noref(name: str, dump: dict[str, Any], conv: dict[str, Any], control: dict[str, Any]) -> Made:
    """A β = 0 case without a reference: no ``ref_logprobs``/``kl``, a sidecar of what is read, and a
    control that does not act through the KL only."""
    for k in ("ref_logprobs", "kl"):
        dump.pop(k)
    hp = {
        "kl_coef": 0.0,
        "cliprange": HP["cliprange"],
        "cliprange_high": 0.28,
        "whiten_eps": HP["whiten_eps"],
    }
    if set(control) & {"group_kl", "kl_in", "kl_estimator"}:
        control = {"advantage": "dr-grpo" if conv.get("advantage") == "grpo" else "grpo"}
    return f"areal_grpo_{name}_noref", dump, hp, conv, control
