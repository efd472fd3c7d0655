"""The peers' OWN critic-free advantage estimators on grouped batches vs refppo.

``tools/peers group_estimators`` (``tests/peers/test_validate_group_estimators.py`` runs it when the
side venvs exist). A ``batch`` request of :mod:`peers.harness`:

1. The peer's half (``verl-openrlhf``: verl and OpenRLHF; ``skyrl-areal``: SkyRL-train; import
   stand-ins of :mod:`peers.stubs`) calls each peer function on the batch and returns the results.
2. refppo's half: one case per peer result, the max abs error over valid tokens against refppo's
   ``refppo.core.group`` with the named parameters (and, for the keys of ``VIA_PRESET``, through
   ``refppo.pipeline.rollout.critic_free_advantages`` under the preset variant; both in
   :mod:`peers.group_estimators_ref`); a case fails above 1e-6 relative (float64 inputs; OpenRLHF
   whitens in float32, so 1e-6 relative there too). Its control (``CONTRASTS``: one parameter
   flipped) must differ from the peer.

Batch (float64, B = 16, T = 12, right-padded, seed 0): groups of sizes 4, 3, 2, 1, 4, 2 with rows
interleaved (verl/SkyRL: any order, a singleton group, and a group whose 0/1 scores are all equal);
for OpenRLHF (fixed ``n_samples_per_prompt = 4``) four groups of 4, split into two experiences with
permuted ``index``. Token rewards for REINFORCE++: the score at the last valid token plus
``−β·KL_t`` (β = 0.05), junk 7.5 on padding. verl sums ``token_level_rewards`` over the whole row,
so its group inputs carry 0 (not junk) on padding; OpenRLHF's ``kl`` carries junk 7.5 on padding.

Peer functions (versions printed at run time): verl 0.9.1 ``verl/trainer/ppo/core_algos.py``
``compute_grpo_outcome_advantage`` (``norm_adv_by_std_in_grpo`` True/False),
``compute_grpo_vectorized_outcome_advantage``, ``compute_rloo_outcome_advantage``,
``compute_rloo_vectorized_outcome_advantage``,
``compute_reinforce_plus_plus_baseline_outcome_advantage``,
``compute_reinforce_plus_plus_outcome_advantage``, ``compute_opo_outcome_advantage``,
``compute_gpg_outcome_advantage`` (two groups' scores set to 0, so ``α = B/#{s ≠ 0}`` binds),
``compute_grpo_passk_outcome_advantage`` (the group of one merged into another: verl raises on it),
``compute_gdpo_outcome_advantage`` (one reward component: GRPO then ``masked_whiten``), and
REINFORCE++ on a mask with interior holes (``gae_holes=skip``); OpenRLHF 0.11.2
``openrlhf/trainer/ppo_utils/experience_maker.py::RemoteExperienceMaker.compute_advantages_and_returns``
(``group_norm``, ``dr_grpo``, ``rloo``, ``reinforce_baseline``, ``reinforce``, ``flash_reinforce``,
and ``reinforce`` on a holed ``action_mask``, ``gae_holes=zero``; called unbound on a stand-in
``self``); SkyRL-train 0.3.1 ``skyrl_train/utils/ppo_utils.py``
``compute_grpo_outcome_advantage``, ``compute_rloo_outcome_advantage``,
``compute_reinforce_plus_plus_outcome_advantage``.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

from peers.checks import err
from peers.group_estimators_ref import (
    BETA,
    CONTRASTS,
    GAMMA,
    SETTINGS,
    VIA_PRESET,
    preset_result,
    refppo_result,
)
from peers.harness import Case, Control, Report, Unit, parser, root_of, run_venvs, selected, workdir
from peers.stubs import mount

B, T, JUNK = 16, 12, 7.5
SIZES = (4, 3, 2, 1, 4, 2)
TOL = 1e-6
VENVS: dict[str, dict[str, Unit]] = {
    "verl-openrlhf": {
        "verl": Unit("verl", "peers.group_estimators:peer_verl"),
        "openrlhf": Unit("openrlhf", "peers.group_estimators:peer_openrlhf"),
    },
    "skyrl-areal": {"skyrl": Unit("skyrl-train", "peers.group_estimators:peer_skyrl")},
}
"""Side venv → unit → (distribution, peer-side function)."""

# ------------------------------------------------------------------------------------------------
# The peer's half (side venvs; no refppo import).
# ------------------------------------------------------------------------------------------------


def peer_setup() -> None:
    from peers.stubs import install_stubs

    install_stubs()
    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")


def peer_verl(x: dict[str, Any]) -> dict[str, Any]:
    mount("verl")
    from verl.trainer.ppo import core_algos as ca  # type: ignore[import-not-found]  # peers venv only

    tl, m, idx = x["score_tokens"], x["mask"], x["index"].numpy()
    out: dict[str, Any] = {}
    out["verl.grpo"] = ca.compute_grpo_outcome_advantage(tl.clone(), m, idx, epsilon=1e-6)[0]
    out["verl.grpo_nostd"] = ca.compute_grpo_outcome_advantage(
        tl.clone(), m, idx, norm_adv_by_std_in_grpo=False
    )[0]
    out["verl.grpo_vectorized"] = ca.compute_grpo_vectorized_outcome_advantage(tl.clone(), m, idx)[0]
    out["verl.rloo"] = ca.compute_rloo_outcome_advantage(tl.clone(), m, idx)[0]
    out["verl.rloo_vectorized"] = ca.compute_rloo_vectorized_outcome_advantage(tl.clone(), m, idx)[0]
    out["verl.rpp_baseline"] = ca.compute_reinforce_plus_plus_baseline_outcome_advantage(tl.clone(), m, idx)[
        0
    ]
    cfg = types.SimpleNamespace(gamma=GAMMA)
    out["verl.rpp"] = ca.compute_reinforce_plus_plus_outcome_advantage(x["token_rewards"], m, config=cfg)[0]
    out["verl.opo"] = ca.compute_opo_outcome_advantage(tl.clone(), m, idx)[0]
    out["verl.gpg"] = ca.compute_gpg_outcome_advantage(x["score_tokens_z"].clone(), m, idx)[0]
    passk_cfg = {"norm_adv_by_std_in_grpo": True}  # AlgoConfig.get
    idx_ns = x["index_ns"].numpy()
    out["verl.grpo_passk"] = ca.compute_grpo_passk_outcome_advantage(tl.clone(), m, idx_ns, config=passk_cfg)[
        0
    ]
    out["verl.gdpo"] = ca.compute_gdpo_outcome_advantage(tl.clone(), m, idx, epsilon=1e-6)[0]
    hm = x["h_mask"]
    out["verl.rpp_holes"] = ca.compute_reinforce_plus_plus_outcome_advantage(
        x["token_rewards"], hm, config=cfg
    )[0]
    return out


def peer_skyrl(x: dict[str, Any]) -> dict[str, Any]:
    mount("skyrl_train")
    mount("skyrl_train.utils")
    from skyrl_train.utils import ppo_utils as pu  # type: ignore[import-not-found]  # peers venv only

    tl, m, idx = x["score_tokens"], x["mask"], x["index"].numpy()
    out: dict[str, Any] = {}
    out["skyrl.grpo"] = pu.compute_grpo_outcome_advantage(tl.clone(), m, idx, epsilon=1e-6)[0]
    out["skyrl.grpo_nostd"] = pu.compute_grpo_outcome_advantage(tl.clone(), m, idx, grpo_norm_by_std=False)[0]
    out["skyrl.rloo"] = pu.compute_rloo_outcome_advantage(tl.clone(), m, idx)[0]
    out["skyrl.rpp"] = pu.compute_reinforce_plus_plus_outcome_advantage(x["token_rewards"], m, GAMMA)[0]
    return out


def peer_openrlhf(x: dict[str, Any]) -> dict[str, Any]:
    """OpenRLHF's ``compute_advantages_and_returns`` per estimator, on two experiences with permuted
    ``index``; each result reassembled in the original row order."""
    import torch

    maker = _openrlhf_maker_class()
    perm = x["o_perm"].tolist()
    out: dict[str, Any] = {}
    for est in (
        "group_norm",
        "dr_grpo",
        "rloo",
        "reinforce_baseline",
        "reinforce",
        "flash_reinforce",
        "holes",
    ):
        holes = est == "holes"
        est = "reinforce" if holes else est
        exps = []
        for part in (perm[:7], perm[7:]):  # two experiences; ``index`` = original (prompt-sorted) rows
            rows = torch.tensor(part)
            exps.append(
                types.SimpleNamespace(
                    rewards=x["o_scores"][rows].clone(), index=part, kl=x["o_kl"][rows].clone(),
                    action_mask=x["h_mask" if holes else "o_mask"][rows].clone(), info={}, values=None,
                )
            )  # fmt: skip
        maker.compute_advantages_and_returns(_openrlhf_self(maker, est), exps)
        got = torch.empty(B, T, dtype=torch.float64)
        for part, e in zip((perm[:7], perm[7:]), exps, strict=True):
            got[torch.tensor(part)] = e.advantages.double()
        out["openrlhf.reinforce_holes" if holes else f"openrlhf.{est}"] = got
    return out


def _openrlhf_maker_class() -> Any:
    """OpenRLHF's ``RemoteExperienceMaker``, imported from its own files (the Ray launcher stubbed)."""
    for n in (
        "openrlhf",
        "openrlhf.models",
        "openrlhf.utils",
        "openrlhf.trainer",
        "openrlhf.trainer.ppo_utils",
    ):
        mount(n)
    # experience_maker imports RayActorGroup (the Ray launcher, which pulls in every model): not called.
    launcher = types.ModuleType("openrlhf.trainer.ray.launcher")
    setattr(launcher, "RayActorGroup", object)  # noqa: B010  (a bare module: mypy knows no attributes)
    sys.modules["openrlhf.trainer.ray"] = types.ModuleType("openrlhf.trainer.ray")
    sys.modules["openrlhf.trainer.ray.launcher"] = launcher
    from openrlhf.trainer.ppo_utils.experience_maker import (  # type: ignore[import-not-found]  # peers venv only
        RemoteExperienceMaker,
    )

    return RemoteExperienceMaker


def _openrlhf_self(maker: Any, est: str) -> types.SimpleNamespace:
    """A stand-in ``self`` for the unbound method: the ``args``, ``kl_ctl`` and estimator its
    ``__init__`` sets (``n_samples_per_prompt = 4``, γ only for ``reinforce``, KL coefficient β)."""
    adv = types.SimpleNamespace(
        estimator=est, gamma=GAMMA if est == "reinforce" else 1.0, lambd=1.0, no_std_norm=False
    )
    args = types.SimpleNamespace(
        reward=types.SimpleNamespace(clip_range=None),
        rollout=types.SimpleNamespace(n_samples_per_prompt=4),
        algo=types.SimpleNamespace(advantage=adv),
    )
    me = types.SimpleNamespace(
        strategy=types.SimpleNamespace(args=args),
        kl_ctl=types.SimpleNamespace(value=BETA),
        advantage_estimator=est,
    )
    me.get_cumulative_returns = types.MethodType(maker.get_cumulative_returns, me)
    return me


# ------------------------------------------------------------------------------------------------
# refppo's half.
# ------------------------------------------------------------------------------------------------


def make_batch(seed: int = 0) -> dict[str, Any]:
    """The grouped batch described in the module docstring (plain tensors only)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T).expand(B, T) < lengths.unsqueeze(1)
    ids = torch.tensor([k for k, n in enumerate(SIZES) for _ in range(n)])
    index = ids[torch.randperm(B, generator=g)] * 7 + 3  # interleaved, non-contiguous prompt ids
    scores = torch.randn(B, generator=g, dtype=f64)
    scores[index == 4 * 7 + 3] = 1.0  # the second group of 4: equal 0/1 scores (σ = 0)
    last = mask.sum(1) - 1
    onehot = torch.zeros(B, T, dtype=f64).scatter(1, last.unsqueeze(1), 1.0)
    kl = torch.rand(B, T, generator=g, dtype=f64)
    token_rewards = torch.where(mask, onehot * scores.unsqueeze(1) - BETA * kl, torch.tensor(JUNK, dtype=f64))
    o_scores = (torch.rand(B, generator=g, dtype=f64) < 0.5).to(f64) + 0.1 * torch.randn(
        B, generator=g, dtype=f64
    )
    o_scores[4:8] = 1.0  # one OpenRLHF group with equal scores
    # interior holes (tool tokens): never a row's first or last valid token
    punch = (
        (torch.rand(B, T, generator=g) < 0.3) & (torch.arange(T) > 0) & (torch.arange(T) < last.unsqueeze(1))
    )
    single = [k for k in torch.unique(index).tolist() if int((index == k).sum()) == 1]
    index_ns = torch.where(torch.isin(index, torch.tensor(single)), index[0], index)  # no group of one
    zeroed = torch.isin(index, index[:2])  # gpg's α = B/#{s ≠ 0}: two groups score 0
    return {
        "index_ns": index_ns,
        "score_tokens_z": torch.where(zeroed.unsqueeze(1), 0.0, onehot * scores.unsqueeze(1)),
        "h_mask": (mask & ~punch).to(f64),
        "mask": mask.to(f64),
        "index": index,
        "scores": scores,
        "score_tokens": onehot * scores.unsqueeze(1),
        "token_rewards": token_rewards,
        "o_scores": o_scores,
        "o_kl": torch.where(mask, kl, torch.tensor(JUNK, dtype=f64)),
        "o_mask": mask.to(f64),
        "o_perm": torch.randperm(B, generator=g),
    }


def compare(x: dict[str, Any], got: dict[str, Any], unit: str) -> list[Case]:
    """One case per peer result key: refppo's core (and the preset variant), its contrast."""
    import torch

    out = []
    for key in sorted(got):
        ref = refppo_result(key, x)
        peer = got[key].double()
        m = x["h_mask" if key.endswith("_holes") else "mask"].bool()  # OpenRLHF: junk on holes
        e, tol = err(peer, ref, m, rtol=TOL)
        errors = {"core": e}
        ok = e <= tol and bool(torch.isfinite(peer[m]).all())
        notes = ["refppo " + ", ".join(f"{k}={v}" for k, v in SETTINGS[key][1].items())]
        if key in VIA_PRESET:
            errors["preset"] = via = err(peer, preset_result(key, x), m)[0]
            ok = ok and via <= tol
            peer_name, est = VIA_PRESET[key]
            notes.append(f"through --preset {peer_name} --set advantage={est} (pipeline): {via:.2e}")
        controls = []
        if key in CONTRASTS:
            gap = err(peer, refppo_result(key, x, CONTRASTS[key]), m)[0]
            flip = ", ".join(f"{k}={v}" for k, v in CONTRASTS[key].items())
            controls.append(Control(flip, gap > tol, f"max abs err {gap:.2e}"))
        out.append(Case(unit, key, ok, errors, controls, {"settings": SETTINGS[key][1]}, notes))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser("group_estimators", __doc__, list(VENVS)).parse_args(argv)
    report = Report("group_estimators")
    x = make_batch()
    with workdir(args.keep) as work:
        runs = run_venvs(
            report,
            selected(args, VENVS),
            root_of(args),
            work,
            batch=x,
            setup="peers.group_estimators:peer_setup",
        )
        for unit, out, _ in runs:
            import torch

            got = torch.load(out / f"result-{unit}.pt", weights_only=True)
            for case in compare(x, got, unit):
                report.add(case)
    return report.finish(args.json_out)
