"""The peers' OWN aggregation and value-clip code on one batch vs refppo.

``tools/peers agg_modes`` (by hand). A ``batch`` request of :mod:`peers.harness`:

1. The peer's half (``verl-openrlhf``: verl 0.9.1 + OpenRLHF 0.11.2; ``skyrl-areal``: SkyRL-train
   0.3.1 + AReaL 1.0.4) calls every peer function below on the batch and returns the results. It
   imports nothing from refppo.
2. refppo's half compares them with refppo's ``aggregate_loss`` / ``value_loss``: one case per
   peer result with its max abs error (a case fails above ``1e-6·max(1, |value|)``; the clip
   fractions must be equal exactly).

What is compared (the peers' functions as of the versions above):

- ``seq-mean-token-sum-norm`` and the other modes: verl ``verl/trainer/ppo/core_algos.py::agg_loss``
  (whole batch; and split into two micro-batches with the global ``global_batch_size`` /
  ``batch_num_tokens``, summed; and with ``loss_scale_factor = 24``), SkyRL-train
  ``skyrl_train/utils/ppo_utils.py::reduce_loss`` (``token_mean``, ``sequence_mean``,
  ``seq_mean_token_sum_norm`` with ``max_seq_len`` = T and 24), against
  ``refppo.core.aggregate.aggregate_loss`` with the matching mode, ``seq_count`` and ``horizon``.
- ``value_clip_form``: a float32 batch where ``V − V_old`` rounds (``V`` and ``V_old`` of different
  signs, ``R`` near ``V``). verl ``core_algos.py::compute_value_loss`` (``vf_loss``, ``vf_clipfrac``)
  against ``value_clip_form=around_old``; OpenRLHF ``openrlhf/models/loss.py::ValueLoss`` (loss),
  SkyRL-train ``ppo_utils.py::ppo_critic_loss`` (loss aggregated ``seq-mean-token-mean``, clip
  fraction) and AReaL ``areal/utils/functional/functional.py::ppo_critic_loss_fn`` (loss,
  ``clip_mask``) against ``delta``; the clip fractions must be equal exactly, and the line also
  shows how many tokens the other form would count differently.

- where verl's score goes when a multi-turn response ENDS with tool-output tokens: verl's agent loop
  puts the score on the last token of the response (``agent_loop.py``: ``rm_scores[-1] =
  reward_score``), a masked token then, and ``core_algos.py::compute_gae_advantage_return`` never
  reads a reward at a masked position, so the score is lost. A dump cannot show this (its mask
  ends at the last valid token). One row ``m = [1, 1, 1, 0, 0]``, V = 0, γ = λ = 1, score 1 on the
  trailing tool token (verl: advantages ``[0, 0, 0]``) or on the last valid token (``[1, 1, 1]``;
  ``masked_whiten`` replaced by the identity: the raw advantages), against
  ``refppo.core.gae.gae(holes=skip)`` on the same rewards; control: the two placements differ.

Import workarounds (nothing from them is called): :mod:`peers.stubs`, with ``transformers``,
``loguru``, ``jaxtyping`` and ``omegaconf`` served inert where the venv lacks them (AReaL's and
SkyRL's module-level imports); the packages are mounted as bare modules.
"""

from __future__ import annotations

import os
import types
from typing import Any

from peers.checks import err
from peers.harness import Case, Control, Report, Unit, parser, root_of, run_venvs, selected, workdir
from peers.stubs import mount

B, T, H_CUSTOM, EPS_V = 8, 16, 24.0, 0.2
VENVS: dict[str, dict[str, Unit]] = {
    "verl-openrlhf": {
        "verl": Unit("verl", "peers.agg_modes:peer_verl"),
        "openrlhf": Unit("openrlhf", "peers.agg_modes:peer_openrlhf"),
    },
    "skyrl-areal": {
        "skyrl": Unit("skyrl-train", "peers.agg_modes:peer_skyrl"),
        "areal": Unit("areal", "peers.agg_modes:peer_areal"),
    },
}
"""Side venv → unit → (distribution, peer-side function)."""

# ------------------------------------------------------------------------------------------------
# The peer's half (side venvs; no refppo import).
# ------------------------------------------------------------------------------------------------


def peer_setup() -> None:
    from peers.stubs import install_stubs

    install_stubs(if_absent=("transformers", "loguru", "jaxtyping", "omegaconf"))
    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")


def peer_verl(x: dict[str, Any]) -> dict[str, Any]:
    import torch

    mount("verl")
    from verl.trainer.ppo import core_algos as ca  # type: ignore[import-not-found]  # peers venv only

    lm, m = x["loss_mat"], x["mask"]
    out: dict[str, Any] = {}
    n_tok = m.sum()
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        out[f"verl.agg.{mode}"] = ca.agg_loss(lm, m, mode)
        halves = [slice(0, 3), slice(3, B)]
        out[f"verl.agg_micro.{mode}"] = sum(
            ca.agg_loss(lm[h], m[h], mode, batch_num_tokens=n_tok, global_batch_size=B) for h in halves
        )
    out["verl.agg_h24.seq-mean-token-sum-norm"] = ca.agg_loss(
        lm, m, "seq-mean-token-sum-norm", loss_scale_factor=int(H_CUSTOM)
    )
    vf_loss, vf_clipfrac = ca.compute_value_loss(
        x["v"], x["ret"], x["v_old"], x["vmask"], cliprange_value=EPS_V, loss_agg_mode="token-mean"
    )
    out["verl.value.vf_loss"], out["verl.value.vf_clipfrac"] = vf_loss, torch.as_tensor(vf_clipfrac)
    whiten, ca.verl_F.masked_whiten = ca.verl_F.masked_whiten, lambda a, m: a  # the raw advantages
    try:
        for where in ("trailing_tool", "last_valid"):
            adv, _ = ca.compute_gae_advantage_return(
                x[f"score_{where}"], x["score_v"], x["score_m"], 1.0, 1.0
            )
            out[f"verl.gae_score.{where}"] = adv[:, :3]
    finally:
        ca.verl_F.masked_whiten = whiten
    return out


def peer_openrlhf(x: dict[str, Any]) -> dict[str, Any]:
    for n in ("openrlhf", "openrlhf.models", "openrlhf.utils"):
        mount(n)
    from openrlhf.models.loss import ValueLoss  # type: ignore[import-not-found]  # peers venv only

    return {"openrlhf.value.vf_loss": ValueLoss(EPS_V)(x["v"], x["v_old"], x["ret"], action_mask=x["vmask"])}


def peer_skyrl(x: dict[str, Any]) -> dict[str, Any]:
    import torch

    mount("skyrl_train")
    mount("skyrl_train.utils")
    from skyrl_train.utils import ppo_utils as pu  # type: ignore[import-not-found]  # peers venv only

    lm, m = x["loss_mat"], x["mask"]
    out: dict[str, Any] = {}
    out["skyrl.agg.token-mean"] = pu.reduce_loss(lm, m, "token_mean")
    out["skyrl.agg.seq-mean-token-mean"] = pu.reduce_loss(lm, m, "sequence_mean")
    out["skyrl.agg.seq-mean-token-sum-norm"] = pu.reduce_loss(lm, m, "seq_mean_token_sum_norm", max_seq_len=T)
    out["skyrl.agg_h24.seq-mean-token-sum-norm"] = pu.reduce_loss(
        lm, m, "seq_mean_token_sum_norm", max_seq_len=int(H_CUSTOM)
    )
    cfg = types.SimpleNamespace(value_clip=EPS_V)
    loss, clipfrac = pu.ppo_critic_loss(x["v"], x["v_old"], x["ret"], cfg, loss_mask=x["vmask"])
    out["skyrl.value.vf_loss"], out["skyrl.value.vf_clipfrac"] = loss, torch.as_tensor(clipfrac)
    return out


def peer_areal(x: dict[str, Any]) -> dict[str, Any]:
    for n in (
        "areal",
        "areal.utils",
        "areal.utils.functional",
        "areal.api",
        "areal.infra",
        "areal.experimental",
    ):
        mount(n)
    from areal.utils.functional.functional import (  # type: ignore[import-not-found]  # peers venv only
        ppo_critic_loss_fn,
    )

    m = x["vmask"].bool()
    loss, stat = ppo_critic_loss_fn(x["v"], x["v_old"], x["ret"], EPS_V, loss_mask=m)
    return {
        "areal.value.vf_loss": loss,
        "areal.value.vf_clipfrac": stat["clip_mask"].sum().float() / m.sum().float(),
    }


# ------------------------------------------------------------------------------------------------
# refppo's half.
# ------------------------------------------------------------------------------------------------


def _batch() -> dict[str, Any]:
    """Ragged float64 losses with junk on padding; a float32 value batch where V − V_old rounds."""
    import torch

    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T).expand(B, T) < lengths.unsqueeze(1)
    junk = torch.full((B, T), 7.5, dtype=torch.float64)
    loss_mat = torch.where(mask, torch.randn(B, T, generator=g, dtype=torch.float64), junk)
    # value batch (float32): V_old in [0.05, 0.15], V = V_old − U(0.1, 0.25) (crosses 0, so V − V_old
    # rounds), R = V + U(−0.02, 0.02) (close to V, so a one-step change of V_clip shows in the squares)
    f64 = torch.float64  # drawn in float64, then rounded: so V − V_old is not exact in float32
    v_old = 0.05 + 0.1 * torch.rand(B, T, generator=g, dtype=f64)
    v = v_old - (0.1 + 0.15 * torch.rand(B, T, generator=g, dtype=f64))
    ret = v + 0.04 * (torch.rand(B, T, generator=g, dtype=f64) - 0.5)
    f32 = torch.float32
    pad32 = torch.full((B, T), 7.5, dtype=f32)
    score_m = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0]], dtype=f64)  # ends with two tool tokens
    trailing, last_valid = torch.zeros(1, 5, dtype=f64), torch.zeros(1, 5, dtype=f64)
    trailing[0, 4], last_valid[0, 2] = 1.0, 1.0
    return {
        "score_m": score_m,
        "score_v": torch.zeros(1, 5, dtype=f64),
        "score_trailing_tool": trailing,
        "score_last_valid": last_valid,
        "loss_mat": loss_mat,
        "mask": mask.to(torch.float64),
        "vmask": mask.to(f32),
        "v": torch.where(mask, v.to(f32), pad32),
        "v_old": torch.where(mask, v_old.to(f32), pad32),
        "ret": torch.where(mask, ret.to(f32), pad32),
    }


def _refppo(x: dict[str, Any]) -> dict[str, Any]:
    from refppo.core.aggregate import aggregate_loss
    from refppo.core.gae import gae
    from refppo.core.value import value_loss

    lm, m = x["loss_mat"], x["mask"].bool()
    ref: dict[str, Any] = {}
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        ref[f"agg.{mode}"] = aggregate_loss(lm, m, mode)
        ref[f"agg_micro.{mode}"] = sum(
            aggregate_loss(lm[h], m[h], mode, token_count=float(m.sum()), seq_count=float(B))
            for h in (slice(0, 3), slice(3, B))
        )
    ref["agg.pre-fix-sum-norm"] = (lm * m).sum() / T  # refppo <= 0.1.0's seq-mean-token-sum-norm
    ref["agg_h24.seq-mean-token-sum-norm"] = aggregate_loss(
        lm, m, "seq-mean-token-sum-norm", horizon=H_CUSTOM
    )
    vm = x["vmask"].bool()
    for form in ("around_old", "delta"):
        for agg in ("token-mean", "seq-mean-token-mean"):
            r = value_loss(x["v"], x["v_old"], x["ret"], vm, clip=EPS_V, agg=agg, clip_form=form)
            ref[f"value.{form}.{agg}.vf_loss"] = r.loss
            ref[f"value.{form}.vf_clipfrac"] = r.clipfrac
    for where in ("trailing_tool", "last_valid"):
        sm = x["score_m"].bool()
        adv, _ = gae(x[f"score_{where}"], x["score_v"], sm, gamma=1.0, lam=1.0, holes="skip")
        ref[f"gae_score.{where}"] = adv[:, :3]
    return ref


def _pairs(peer: str, key: str) -> list[tuple[str, str]]:
    """(refppo key, label) pairs for one peer result key."""
    rest = key.split(".", 1)[1]
    if rest.startswith("gae_score."):
        return [(rest, "gae_holes=skip")]
    if rest == "agg.seq-mean-token-sum-norm":
        return [(rest, ""), ("agg.pre-fix-sum-norm", "pre-fix")]
    if rest.startswith(("agg.", "agg_micro.", "agg_h24.")):
        return [(rest, "")]
    form = "around_old" if peer == "verl" else "delta"
    other = "delta" if form == "around_old" else "around_old"
    if rest == "value.vf_clipfrac":
        return [
            (f"value.{form}.vf_clipfrac", f"value_clip_form={form}"),
            (f"value.{other}.vf_clipfrac", "other"),
        ]
    agg = "seq-mean-token-mean" if peer == "skyrl" else "token-mean"
    return [(f"value.{form}.{agg}.vf_loss", f"value_clip_form={form}, {agg}")]


def compare(x: dict[str, Any], ref: dict[str, Any], got: dict[str, Any], unit: str) -> list[Case]:
    """One case per (peer result, refppo key) pair of :func:`_pairs`; the ``pre-fix`` and
    ``other`` pairs are notes (what the other form would give), not cases."""
    out: list[Case] = []
    for key in sorted(got):
        notes = []
        for rkey, label in _pairs(unit, key):
            e = err(got[key], ref[rkey])[0]
            if label == "pre-fix":
                ratio = float(ref[rkey]) / float(got[key])
                notes.append(f"vs {rkey}: ratio {ratio:.4g} (the old form: B = {B} times)")
            elif label == "other":
                notes.append(
                    f"vs {rkey}: differs by {round(e * float(x['vmask'].sum()))} token(s) (the other form)"
                )
            else:
                exact = "clipfrac" in key
                ok = e == 0.0 if exact else e <= 1e-6 * max(1.0, float(ref[rkey].abs().max()))
                info = {"refppo": rkey, "label": label}
                controls = []
                if rkey == "gae_score.trailing_tool":  # the claim: the score is lost, not moved
                    gap = err(got[key], got[key.replace("trailing_tool", "last_valid")])[0]
                    controls.append(
                        Control("score on the last valid token", gap > 0.5, f"differs by {gap:.2g}")
                    )
                if rkey.startswith("gae_score."):
                    notes.append(f"verl's advantages of the valid tokens {got[key][0].tolist()}")
                case = Case(unit, key, ok, {"abs": e}, controls, info, [f"vs refppo {rkey} {label}".rstrip()])
                out.append(case)
        out[-1].notes.extend(notes)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser("agg_modes", __doc__, list(VENVS)).parse_args(argv)
    report = Report("agg_modes")
    x = _batch()
    ref = _refppo(x)
    with workdir(args.keep) as work:
        runs = run_venvs(
            report, selected(args, VENVS), root_of(args), work, batch=x, setup="peers.agg_modes:peer_setup"
        )
        for unit, out, _ in runs:
            import torch

            got = torch.load(out / f"result-{unit}.pt", weights_only=True)
            for case in compare(x, ref, got, unit):
                report.add(case)
    return report.finish(args.json_out)
