#!/usr/bin/env python3
"""Run the peers' OWN critic-free advantage estimators on grouped batches and compare with refppo.

Not part of CI (by hand; ``tests/peers/test_validate_group_estimators.py`` runs it when the peer
venvs exist). Two halves, two interpreters, as ``tools/validate_agg_modes.py``; the import stubs
are those of ``tools/peer_makers/common.py`` (``install_stubs``, ``mount``), imported, not copied:

1. ``--peer-half IN OUT`` (a peers' venv, ``/work/shared/peers/README.md``) loads the batch
   (``torch.load(weights_only=True)``), calls each peer function and saves the results.
2. Without it (refppo's interpreter) it writes the batch, runs half 1 with each ``--peers-python``
   and prints, per comparison, the max abs error over valid tokens against refppo's
   ``refppo.core.group`` with the named parameters (and, for the keys of ``VIA_PRESET``, through
   ``refppo.pipeline.rollout.critic_free_advantages`` under the preset variant; both in
   ``tools/validate_group_estimators_refppo.py``, refppo's half); exit 1 on a mismatch
   (> 1e-6, float64 inputs; OpenRLHF whitens in float32, so 1e-6 relative there too).

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

import argparse
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

from validate_group_estimators_refppo import (
    BETA,
    CONTRASTS,
    GAMMA,
    SETTINGS,
    VIA_PRESET,
    preset_result,
    refppo_result,
)

REPO = Path(__file__).resolve().parent.parent
B, T, JUNK = 16, 12, 7.5
SIZES = (4, 3, 2, 1, 4, 2)
PEER_ENVS = ("/work/peervenv/verl-openrlhf/bin/python", "/work/peervenv/skyrl-areal/bin/python")

# ------------------------------------------------------------------------------------------------
# Half 1: runs in a peers' environment (no refppo import).
# ------------------------------------------------------------------------------------------------


def _stubs() -> types.ModuleType:
    """``tools/peer_makers/common.py``, imported for its import stubs and ``mount`` (no refppo import)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peer_makers import common

    return common


def _verl(x: dict[str, Any], site: str, out: dict[str, Any]) -> None:
    _stubs().mount("verl", site)
    from verl.trainer.ppo import core_algos as ca  # type: ignore[import-not-found]  # peers venv only

    tl, m, idx = x["score_tokens"], x["mask"], x["index"].numpy()
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


def _skyrl(x: dict[str, Any], site: str, out: dict[str, Any]) -> None:
    pm = _stubs()
    pm.mount("skyrl_train", site)
    pm.mount("skyrl_train.utils", site)
    from skyrl_train.utils import ppo_utils as pu  # type: ignore[import-not-found]  # peers venv only

    tl, m, idx = x["score_tokens"], x["mask"], x["index"].numpy()
    out["skyrl.grpo"] = pu.compute_grpo_outcome_advantage(tl.clone(), m, idx, epsilon=1e-6)[0]
    out["skyrl.grpo_nostd"] = pu.compute_grpo_outcome_advantage(tl.clone(), m, idx, grpo_norm_by_std=False)[0]
    out["skyrl.rloo"] = pu.compute_rloo_outcome_advantage(tl.clone(), m, idx)[0]
    out["skyrl.rpp"] = pu.compute_reinforce_plus_plus_outcome_advantage(x["token_rewards"], m, GAMMA)[0]


def _openrlhf(x: dict[str, Any], site: str, out: dict[str, Any]) -> None:
    import torch

    pm = _stubs()
    for n in (
        "openrlhf",
        "openrlhf.models",
        "openrlhf.utils",
        "openrlhf.trainer",
        "openrlhf.trainer.ppo_utils",
    ):
        pm.mount(n, site)
    # experience_maker imports RayActorGroup (the Ray launcher, which pulls in every model): not called.
    launcher = types.ModuleType("openrlhf.trainer.ray.launcher")
    setattr(launcher, "RayActorGroup", object)  # noqa: B010  (a bare module: mypy knows no attributes)
    sys.modules["openrlhf.trainer.ray"] = types.ModuleType("openrlhf.trainer.ray")
    sys.modules["openrlhf.trainer.ray.launcher"] = launcher
    from openrlhf.trainer.ppo_utils.experience_maker import (  # type: ignore[import-not-found]  # peers venv only
        RemoteExperienceMaker,
    )

    perm, n_per = x["o_perm"].tolist(), 4
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
        adv = types.SimpleNamespace(
            estimator=est, gamma=GAMMA if est == "reinforce" else 1.0, lambd=1.0, no_std_norm=False
        )
        args = types.SimpleNamespace(
            reward=types.SimpleNamespace(clip_range=None),
            rollout=types.SimpleNamespace(n_samples_per_prompt=n_per),
            algo=types.SimpleNamespace(advantage=adv),
        )
        me = types.SimpleNamespace(
            strategy=types.SimpleNamespace(args=args),
            kl_ctl=types.SimpleNamespace(value=BETA),
            advantage_estimator=est,
        )
        me.get_cumulative_returns = types.MethodType(RemoteExperienceMaker.get_cumulative_returns, me)
        exps = []
        for part in (perm[:7], perm[7:]):  # two experiences; ``index`` = original (prompt-sorted) rows
            rows = torch.tensor(part)
            exps.append(
                types.SimpleNamespace(
                    rewards=x["o_scores"][rows].clone(), index=part, kl=x["o_kl"][rows].clone(),
                    action_mask=x["h_mask" if holes else "o_mask"][rows].clone(), info={}, values=None,
                )
            )  # fmt: skip
        RemoteExperienceMaker.compute_advantages_and_returns(me, exps)
        got = torch.empty(B, T, dtype=torch.float64)
        for part, e in zip((perm[:7], perm[7:]), exps, strict=True):
            got[torch.tensor(part)] = e.advantages.double()
        out["openrlhf.reinforce_holes" if holes else f"openrlhf.{est}"] = got


def peer_half(inp: str, outp: str) -> int:
    import sysconfig
    from importlib.metadata import PackageNotFoundError, version

    import torch

    pm = _stubs()
    pm.install_stubs()
    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
    site = sysconfig.get_paths()["purelib"]
    x = torch.load(inp, weights_only=True)
    out: dict[str, Any] = {}
    status: dict[str, str] = {}
    for name, dist, fn in (
        ("verl", "verl", _verl),
        ("openrlhf", "openrlhf", _openrlhf),
        ("skyrl", "skyrl-train", _skyrl),
    ):
        try:
            ver = version(dist)
        except PackageNotFoundError:
            continue
        try:
            fn(x, site, out)
            status[name] = f"{dist} {ver}"
        except Exception as exc:  # report and go on: one peer failing is not fatal to the others
            status[name] = f"{dist} {ver}: FAILED {type(exc).__name__}: {str(exc)[:300]}"
    torch.save({k: torch.as_tensor(v).detach() for k, v in out.items()}, outp)
    Path(outp + ".json").write_text(json.dumps(status))
    return 0


# ------------------------------------------------------------------------------------------------
# Half 2: refppo's side.
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


def validate(pythons: list[str]) -> int:
    import torch

    x = make_batch()
    m = x["mask"].bool()
    failures = compared = 0
    with tempfile.TemporaryDirectory() as tmp:
        inp = os.path.join(tmp, "batch.pt")
        torch.save(x, inp)
        for py in pythons:
            if not Path(py).exists():
                print(f"SKIPPED: no interpreter {py}")
                continue
            outp = os.path.join(tmp, "out.pt")
            cmd = [py, str(Path(__file__).resolve()), "--peer-half", inp, outp]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                print(f"FAILED {py}: {' | '.join(proc.stderr.strip().splitlines()[-3:])}")
                failures += 1
                continue
            status = json.loads(Path(outp + ".json").read_text())
            print(f"{py}: {status}")
            failures += sum("FAILED" in v for v in status.values())
            got = torch.load(outp, weights_only=True)
            for key in sorted(got):
                ref = refppo_result(key, x)
                peer = got[key].double()
                m = (
                    x["h_mask"].bool() if key.endswith("_holes") else x["mask"].bool()
                )  # OpenRLHF: junk on holes
                err = float((peer - ref).abs()[m].max())
                tol = 1e-6 * max(1.0, float(ref.abs().max()))
                ok = err <= tol and bool(torch.isfinite(peer[m]).all())
                failures += not ok
                compared += 1
                kw = ", ".join(f"{k}={v}" for k, v in SETTINGS[key][1].items())
                print(f"  {'OK ' if ok else 'BAD'} {key:<28} max abs err {err:.2e}  refppo {kw}")
                if key in VIA_PRESET:
                    via = float((peer - preset_result(key, x)).abs()[m].max())
                    failures += not via <= tol
                    compared += 1
                    peer_name, est = VIA_PRESET[key]
                    print(
                        f"      {'ok ' if via <= tol else 'BAD'} through --preset {peer_name} --set "
                        f"advantage={est} (pipeline): max abs err {via:.2e}"
                    )
                if key in CONTRASTS:
                    other = refppo_result(key, x, CONTRASTS[key])
                    gap = float((peer - other).abs()[m].max())
                    differs = gap > tol
                    failures += not differs
                    flip = ", ".join(f"{k}={v}" for k, v in CONTRASTS[key].items())
                    print(f"      {'ok ' if differs else 'BAD'} with {flip} instead: max abs err {gap:.2e}")
    print(f"{compared} comparisons, {failures} failure(s)")
    return 1 if failures or not compared else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--peer-half", nargs=2, metavar=("IN", "OUT"), help="(internal) run in a peers venv")
    ap.add_argument("--peers-python", action="append", help=f"peers interpreters (default {PEER_ENVS})")
    args = ap.parse_args()
    if args.peer_half:
        return peer_half(*args.peer_half)
    return validate(args.peers_python or list(PEER_ENVS))


if __name__ == "__main__":
    sys.exit(main())
