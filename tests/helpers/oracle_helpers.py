"""Small dumps for the oracle tests (B <= 8, T <= 16), with junk in the padding.

The outputs of a "refppo" dump come from the pipeline (``reference_outputs``: the code the oracle
checks with); those of a "naive" dump (:func:`naive_outputs`) from the naive twins, token by token
(:func:`refppo.pipeline.naive.rollout_quantities_naive` on the ``refppo.core.*_naive`` steps, the
update's losses by ``clipped_policy_loss_naive``, ``value_loss_naive``, ...), so a dump that matches
is not the checking code agreeing with itself. The injected bugs are written here *independently*,
from their definition, with plain loops over Python floats — never from the oracle's own bug
re-enactments — so a test can tell a wrong diagnosis.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from refppo.agg_conventions import ClipfracAgg
from refppo.conventions import KLPlacement, LossAgg, PolicyLoss
from refppo.core.aggregate import Prompts, prompt_mean_naive
from refppo.core.approx_kl import approx_kl_k1_clamped_naive
from refppo.core.cispo import cispo_policy_loss_naive
from refppo.core.clipfrac import clipfrac_row_mean_naive
from refppo.core.gspo import gspo_policy_loss_naive
from refppo.core.kl import token_kl_naive
from refppo.core.objective import entropy_bonus_naive, kl_loss_naive, total_loss_naive
from refppo.core.policy import clipped_policy_loss_naive
from refppo.core.rollout_correction import is_weights_naive, rejection_mask_naive
from refppo.core.rollout_losses import Norms, PolicyClip, corrected_policy_loss_naive
from refppo.core.value import value_loss_naive
from refppo.dump.write import write_dump
from refppo.oracle.check.recompute import reference_outputs
from refppo.oracle.check.settings import Setup, build_setup, parse_value
from refppo.oracle.presets.registry import resolve_preset
from refppo.pipeline.step import rollout_quantities_naive

HP: dict[str, float] = {
    "gamma": 0.99,
    "lam": 0.9,
    "kl_coef": 0.1,
    "cliprange": 0.2,
    "cliprange_value": 0.2,
    "vf_coef": 0.1,
    "ent_coef": 0.01,
}


def make_inputs(
    B: int = 6, T: int = 12, seed: int = 0, *, lengths: list[int] | None = None, lp_noise: float = 0.3
) -> dict[str, Tensor]:
    """Random right-padded inputs; padded positions hold junk (large values, NaN in log-probs)."""
    g = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = [int(x) for x in torch.randint(2, T, (B,), generator=g)]
        lengths[0] = T  # one full row (no room for a slot after it)
    pos = torch.arange(T).expand(B, T)
    mask = pos < torch.tensor(lengths).unsqueeze(1)

    def rnd(scale: float = 1.0) -> Tensor:
        return torch.randn(B, T, generator=g, dtype=torch.float64) * scale

    old_lp = -rnd().abs() - 0.5
    out = {
        "response_mask": mask.to(torch.uint8),
        "old_logprobs": old_lp,
        "ref_logprobs": old_lp + rnd(0.3),
        "logprobs": old_lp + rnd(lp_noise),
        "old_values": rnd(),
        "values": rnd(),
        "entropy": rnd().abs(),
        "scores": torch.randn(B, generator=g, dtype=torch.float64) * 3.0,
    }
    junk = torch.where(mask, torch.zeros((), dtype=torch.float64), torch.full((), 7.5, dtype=torch.float64))
    for k in ("old_values", "values", "entropy"):
        out[k] = torch.where(mask, out[k], junk)
    for k in ("old_logprobs", "ref_logprobs", "logprobs"):
        out[k] = torch.where(mask, out[k], torch.full((), 1.0, dtype=torch.float64))  # TRL's sentinel
    return out


def setup_for(
    preset: str | None = None, conv: dict[str, Any] | None = None, hp: dict[str, Any] | None = None
) -> Setup:
    pc, ph = resolve_preset(preset, (conv or {}).get("kl_estimator")) if preset else (None, None)
    sidecar = {k: parse_value(k, v) for k, v in {**HP, **(hp or {})}.items()}
    overrides = {k: parse_value(k, v) for k, v in (conv or {}).items()}
    return build_setup(preset_conv=pc, preset_hp=ph, sidecar=sidecar, overrides=overrides)


def refppo_dump(
    inputs: dict[str, Tensor],
    setup: Setup,
    dtype: torch.dtype = torch.float64,
    keep: tuple[str, ...] | None = None,
) -> dict[str, Tensor]:
    outs = reference_outputs(inputs, setup, dtype=dtype)
    if keep is not None:
        outs = {k: v for k, v in outs.items() if k in keep}
    ins = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in inputs.items()}
    return {**ins, **outs}


def naive_outputs(
    inputs: dict[str, Tensor], setup: Setup, dtype: torch.dtype = torch.float64
) -> dict[str, Tensor]:
    """Every output key of a correct step on ``inputs`` under ``setup``, from the naive twins (the
    same keys as ``reference_outputs``: the rollout's four, and the update's scalars where the
    inputs they need are given; ``kl_loss`` only with ``kl_in=loss`` or ``both``), cast to ``dtype``.

    ``kl`` is the estimate of ``old_logprobs`` vs ``ref_logprobs`` whatever ``kl_in`` (the dump's
    ``kl``); the scores pass the oracle's score map ``clip((s + score_bias)·score_scale, ±score_clip)``;
    ``approx_kl`` is the trainer's logged metric of ``approx_kl`` convention, restated here
    (``k2_all_positions``: ``½·Σ_valid (l − l_old)² / (B·T)``). Conventions the naive twins lack
    (``group_kl=to_go``, ``advantage=reinforce++``) raise ConventionError: never another path.
    """
    conv, hp = setup.conv, setup.hp
    f = conv.get  # the flat keys
    t = {k: (v.to(torch.float64) if v.is_floating_point() else v) for k, v in inputs.items()}
    mask = t["response_mask"].bool()
    clamps = {"log_ratio_clamp": f("kl_log_ratio_clamp"), "value_clamp": f("kl_value_clamp")}
    rq = rollout_quantities_naive(
        scores=t["scores"],  # the naive walk's first stage is the score map (map_scores_naive)
        old_logprobs=t["old_logprobs"],
        ref_logprobs=t["ref_logprobs"],
        old_values=t.get("old_values", torch.zeros_like(t["old_logprobs"])),
        mask=mask,
        hp=hp,
        conv=conv,
        group_index=t.get("group_index"),
        bootstrap_values=t.get("bootstrap_values"),
        truncated=t.get("truncated"),
    )
    out: dict[str, Tensor | float] = {
        "kl": token_kl_naive(t["old_logprobs"], t["ref_logprobs"], mask, f("kl_estimator"), **clamps),
        "token_rewards": rq.token_rewards,
        "advantages": rq.advantages,
        "returns": rq.returns,
    }
    if "logprobs" not in t and "values" not in t:  # no update-stage inputs: the rollout's four
        return {k: v.to(dtype) for k, v in out.items() if isinstance(v, Tensor)}
    norm = {} if hp.horizon is None else {"horizon": hp.horizon}
    critic = "values" in t and "old_values" in t
    if critic:
        vf = value_loss_naive(
            t["values"], t["old_values"], rq.returns, rq.value_mask if f("vf_mask") == "value" else mask,
            clip=hp.cliprange_value, kind=f("value_loss"), clip_form=f("value_clip_form"),
            agg=f("loss_agg") if f("value_loss_agg") is None else f("value_loss_agg"), **norm,
        )  # fmt: skip
        out.update(vf_loss=vf.loss, vf_clipfrac=vf.clipfrac)
    ent = None
    if "entropy" in t:
        agg = f("loss_agg") if f("entropy_agg") is None else f("entropy_agg")
        if agg is LossAgg.PROMPT_MEAN:  # the prompts of group_index (refppo.core.aggregate)
            ent = out["entropy_loss"] = float(
                prompt_mean_naive(t["entropy"], mask, Prompts(t["group_index"]))
            )
        else:
            ent = out["entropy_loss"] = float(entropy_bonus_naive(t["entropy"], mask, agg, **norm))
    if "logprobs" not in t:
        return {k: torch.as_tensor(v, dtype=torch.float64).to(dtype) for k, v in out.items()}
    lp, old = t["logprobs"], t["old_logprobs"]
    prompt_mean = f("loss_agg") is LossAgg.PROMPT_MEAN  # ℓ summed here, then by prompt below
    pagg = LossAgg.TOKEN_SUM if prompt_mean else f("loss_agg")
    if f("policy_loss") is PolicyLoss.GSPO:
        pg = gspo_policy_loss_naive(
            lp, old, rq.advantages, mask, clip_low=hp.cliprange, clip_high=hp.cliprange_high,
            agg=pagg, log_ratio_max=f("log_ratio_clamp"), **norm,
        )  # fmt: skip
    else:
        pg = clipped_policy_loss_naive(
            lp, old, rq.advantages, mask, clip_low=hp.cliprange, clip_high=hp.cliprange_high,
            dual_clip=f("dual_clip"), agg=pagg, log_ratio_clamp=f("log_ratio_clamp"), **norm,
        )  # fmt: skip
    if f("policy_loss") is PolicyLoss.CISPO:  # the core's CISPO twin, times w' when corrected
        pg = _cispo_naive(t, rq.advantages, mask, setup)
    elif (
        conv.rollout.on or conv.gate.on
    ):  # ℓ_t ← w'_t·ℓ_t: the core's corrected surrogate on the naive weights
        pg = _corrected_naive(t, rq.advantages, mask, setup)
    pg_loss, pg_clipfrac = pg.loss, pg.clipfrac
    if prompt_mean:
        per_token = torch.tensor(pg.per_token, dtype=torch.float64)
        pg_loss = float(prompt_mean_naive(per_token, mask, Prompts(t["group_index"])))
    if f("clipfrac_agg") is ClipfracAgg.ROW_MEAN:  # oat's clip fraction: a mean of row means
        pg_clipfrac = clipfrac_row_mean_naive(
            lp, old, rq.advantages, mask, clip_low=hp.cliprange, clip_high=hp.cliprange_high,
            log_ratio_clamp=f("log_ratio_clamp"),
        )  # fmt: skip
    out.update(
        pg_loss=pg_loss,
        pg_clipfrac=pg_clipfrac,
        approx_kl=_approx_kl_metric(f("approx_kl"), pg.approx_kl, t, f("log_ratio_clamp")),
    )
    kll = None
    if f("kl_in") in (KLPlacement.LOSS, KLPlacement.BOTH):
        agg = f("loss_agg") if f("kl_loss_agg") is None else f("kl_loss_agg")
        kll = out["kl_loss"] = float(
            kl_loss_naive(lp, t["ref_logprobs"], mask, f("kl_estimator"), agg, **clamps, **norm)
        )
    if critic or "old_values" not in t:
        vf_loss = float(out["vf_loss"]) if critic else None
        out["loss"] = total_loss_naive(
            pg_loss, vf_loss, ent, kll, vf_coef=hp.vf_coef, ent_coef=hp.ent_coef,
            kl_coef=hp.kl_coef if f("kl_in") in (KLPlacement.LOSS, KLPlacement.BOTH) else 0.0,
        )  # fmt: skip
    return {k: torch.as_tensor(v, dtype=torch.float64).to(dtype) for k, v in out.items()}


def _weights_naive(t: dict[str, Tensor], mask: Tensor, setup: Setup) -> Tensor:
    """``w'``: :func:`is_weights_naive` of ``(old_logprobs, rollout_logprobs)`` (1 without
    ``rollout_is``), 0 where the gate's :func:`rejection_mask_naive` rejects (``rollout_rs``)."""
    rc, g = setup.conv.rollout, setup.conv.gate
    w = [[1.0 if ok else 0.0 for ok in row] for row in mask.tolist()]
    if rc.on:
        w, _, _ = is_weights_naive(
            t["old_logprobs"], t["rollout_logprobs"], mask, level=rc.level or "token", agg=rc.agg,
            mode=rc.mode, low=rc.low, high=rc.high,
        )  # fmt: skip
    if g.on and (g.low is not None or g.high is not None):
        keep = rejection_mask_naive(
            t["old_logprobs"], t["rollout_logprobs"], mask, stat=g.stat, order=g.order,
            level=g.level or "token", reduce=g.reduce, low=g.low, high=g.high,
        )  # fmt: skip
        w = [[v if k else 0.0 for v, k in zip(wr, kr, strict=True)] for wr, kr in zip(w, keep, strict=True)]
    return torch.tensor(w, dtype=torch.float64)


def _corrected_naive(t: dict[str, Tensor], adv: Tensor, mask: Tensor, setup: Setup) -> Any:
    """The policy term under ``rollout_is`` / ``rollout_rs``: :func:`_weights_naive` into
    :func:`corrected_policy_loss_naive` (rejected tokens count: ``zero``)."""
    conv, hp = setup.conv, setup.hp
    clip = PolicyClip(hp.cliprange, hp.cliprange_high, conv.policy.dual_clip, conv.policy.log_ratio_clamp)
    return corrected_policy_loss_naive(
        t["logprobs"], t["old_logprobs"], adv, mask, _weights_naive(t, mask, setup),
        clip=clip, norms=Norms(conv.agg.loss, horizon=hp.horizon),
    )  # fmt: skip


def _cispo_naive(t: dict[str, Tensor], adv: Tensor, mask: Tensor, setup: Setup) -> Any:
    """``policy_loss=cispo``: :func:`cispo_policy_loss_naive` with ``[1 − cliprange, 1 + cliprange_high]``
    and, under ``rollout_is`` / ``rollout_rs``, the naive weights of :func:`_weights_naive` as ``w'``."""
    conv, hp = setup.conv, setup.hp
    w = _weights_naive(t, mask, setup) if conv.rollout.on or conv.gate.on else None
    return cispo_policy_loss_naive(
        t["logprobs"], t["old_logprobs"], adv, mask, clip_low=hp.cliprange,
        clip_high=hp.cliprange if hp.cliprange_high is None else hp.cliprange_high,
        log_ratio_clamp=conv.policy.log_ratio_clamp, weight=w, norms=Norms(conv.agg.loss, horizon=hp.horizon),
    )  # fmt: skip


def _approx_kl_metric(name: str, k1: float, t: dict[str, Tensor], kappa: float | None = None) -> float:
    """The logged ``approx_kl``: ``k1`` (mean of ``l_old − l`` over valid tokens), its negative
    (``neg_k1``, AReaL), ``k1_clamped`` (RLinf: ``k1`` of the log ratio clamped to ``±kappa``), or
    TRL's ``½·mean((l − l_old)²)`` over every position, padding as 0."""
    if name == "k1":
        return k1
    if name == "neg_k1":
        return -k1
    if name == "k1_clamped":
        return approx_kl_k1_clamped_naive(t["logprobs"], t["old_logprobs"], t["response_mask"], kappa)
    assert name == "k2_all_positions", name
    B, T = t["response_mask"].shape
    lp, old, m = rows(t["logprobs"]), rows(t["old_logprobs"]), t["response_mask"].bool().tolist()
    total = sum((lp[b][i] - old[b][i]) ** 2 for b in range(B) for i in range(T) if m[b][i])
    return 0.5 * total / (B * T)


def with_behaviour(x: dict[str, Tensor], scale: float = 0.6, seed: int = 17) -> dict[str, Tensor]:
    """``x`` plus behaviour log-probs ``l^prox − scale·N(0, 1)`` on valid tokens (1.0, junk, on
    padding): at ``scale`` 0.6 the weights ``exp(l^prox − l^beh)`` span ≈ 0.3..5, so a cap of 2 binds."""
    g = torch.Generator().manual_seed(seed)
    noise = scale * torch.randn(x["old_logprobs"].shape, generator=g, dtype=torch.float64)
    m = x["response_mask"].bool()
    beh = torch.where(m, x["old_logprobs"] - noise, torch.full((), 1.0, dtype=torch.float64))
    return {**x, "rollout_logprobs": beh}


def naive_dump(
    inputs: dict[str, Tensor],
    setup: Setup,
    dtype: torch.dtype = torch.float64,
    keep: tuple[str, ...] | None = None,
) -> dict[str, Tensor]:
    """:func:`refppo_dump` with the outputs of :func:`naive_outputs` (the naive twins)."""
    outs = naive_outputs(inputs, setup, dtype=dtype)
    if keep is not None:
        outs = {k: v for k, v in outs.items() if k in keep}
    ins = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in inputs.items()}
    return {**ins, **outs}


def save(
    tmp: Path, tensors: dict[str, Tensor], setup: Setup | None = None, name: str = "step.safetensors"
) -> Path:
    path = tmp / name
    hp = dict(HP) if setup is None else {k: v for k, v in setup.hparams_dict().items() if v is not None}
    write_dump(path, tensors, hparams=hp)
    return path


# ---- independent re-statements of known bugs (loops over Python floats) -----------------------


def rows(x: Tensor) -> list[list[float]]:
    out: list[list[float]] = x.to(torch.float64).tolist()
    return out


def lengths_of(mask: Tensor) -> list[int]:
    return [int(v) for v in mask.to(torch.int64).sum(dim=1)]


def gae_loop(
    r: list[float], v: list[float], n: int, gamma: float, lam: float, bootstrap: float
) -> list[float]:
    """Advantages of one row over its first n positions; ``bootstrap`` is the value after position n-1."""
    adv = [0.0] * n
    nxt_a, nxt_v = 0.0, bootstrap
    for t in range(n - 1, -1, -1):
        delta = r[t] + gamma * nxt_v - v[t]
        nxt_a = delta + gamma * lam * nxt_a
        adv[t] = nxt_a
        nxt_v = v[t]
    return adv


def whiten_list(xs: list[float], unbiased: bool = True, eps: float = 1e-8) -> tuple[float, float]:
    """(mean, 1/std) of a flat list."""
    n = len(xs)
    mu = sum(xs) / n
    var = sum((x - mu) ** 2 for x in xs) / (n - 1 if unbiased else n)
    return mu, 1.0 / math.sqrt(var + eps)
