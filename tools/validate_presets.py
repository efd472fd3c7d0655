#!/usr/bin/env python3
"""Show that the ``verl`` and ``openrlhf`` presets reproduce the peers' OWN code. Not part of CI.

Two halves, two interpreters:

1. ``--make OUTDIR`` runs in a separate "peers" virtual environment holding verl 0.9.1 and
   OpenRLHF 0.11.2 (installed ``--no-deps``, plus torch==2.13.0 and the few small modules their
   loss/advantage modules import). It draws random right-padded inputs (junk in the padding) and
   computes every quantity with the peers' functions, then writes one ``.pt`` dump + sidecar per case.
   It imports nothing from refppo.
2. Without ``--make`` (run with refppo's own interpreter) it starts half 1 with ``--peers-python``
   (default ``$REFPPO_PEERS_PYTHON`` or ``/tmp/peers-venv/bin/python``) and runs the oracle
   (``refppo diff --preset <peer> --json``) on each dump, printing the max errors per quantity.

Peer functions called (as of verl 0.9.1 / OpenRLHF 0.11.2):

- verl ``verl/trainer/ppo/core_algos.py``: ``kl_penalty``, ``compute_gae_advantage_return`` (GAE +
  masked whitening), ``compute_policy_loss_vanilla``, ``compute_value_loss``, ``agg_loss``. The reward
  assembly of ``ray_trainer.apply_kl_penalty`` (``scores − β·KL·mask``) is one line restated here,
  because the real function wants a ``DataProto`` batch.
- OpenRLHF ``openrlhf/models/utils.py``: ``compute_approx_kl``, ``compute_reward``;
  ``openrlhf/trainer/ppo_utils/experience_maker.py``: ``get_advantages_and_returns`` (a method that
  does not use ``self``); ``openrlhf/models/loss.py``: ``PolicyLoss``, ``ValueLoss`` (built as
  ``trainer/ray/ppo_critic.py`` builds it, ``ValueLoss(value_clip)``: token-level whatever the
  actor's ``loss_agg_mode``, which the preset's ``value_loss_agg=token-mean`` expresses). The batch-level
  whitening of ``compute_advantages_and_returns`` (masked mean, population variance,
  ``clamp(var, 1e-8).rsqrt()``) is restated, because the real method wants a list of ``Experience``.

Import workarounds (nothing from them is called): the packages' ``__init__`` files pull in Ray actors,
vLLM, DeepSpeed and PEFT, so the package directories are mounted as bare namespace modules, and
``deepspeed`` plus ``openrlhf.trainer.ray.launcher`` are replaced by empty stand-in modules.

Exit codes: 0 every case matches (or the peers are not installed: a SKIPPED message), 1 a mismatch.
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

REPO = Path(__file__).resolve().parent.parent
HP: dict[str, float] = {
    "gamma": 0.99,
    "lam": 0.95,
    "kl_coef": 0.05,
    "cliprange": 0.2,
    "cliprange_value": 0.5,
    "vf_coef": 0.0,
    "ent_coef": 0.0,
}


# ------------------------------------------------------------------------------------------------
# Half 1: runs in the peers' environment.
# ------------------------------------------------------------------------------------------------


def _mount(name: str, site: str) -> None:
    mod = types.ModuleType(name)
    mod.__path__ = [os.path.join(site, *name.split("."))]
    sys.modules[name] = mod


def _inputs(seed: int, B: int = 8, T: int = 16) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T).expand(B, T) < lengths.unsqueeze(1)).to(torch.float64)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3.0 - 0.1
    junk = torch.full((B, T), 7.5, dtype=torch.float64)

    def pad(x: Any) -> Any:
        return torch.where(mask.bool(), x, junk)

    return {
        "response_mask": mask,
        "old_logprobs": pad(old),
        "ref_logprobs": pad(old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)),
        "logprobs": pad(old + 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64)),
        "old_values": pad(torch.randn(B, T, generator=g, dtype=torch.float64)),
        "values": pad(torch.randn(B, T, generator=g, dtype=torch.float64)),
        "scores": 4.0 * torch.randn(B, generator=g, dtype=torch.float64),
    }


class _VerlActorConfig:
    """The few attributes ``compute_policy_loss_vanilla`` reads from verl's ``ActorConfig``."""

    def __init__(self, clip: float) -> None:
        self.clip_ratio = clip
        self.clip_ratio_low = None
        self.clip_ratio_high = None
        self.global_batch_info: dict[str, Any] = {}

    def get(self, key: str, default: Any) -> Any:
        return {"clip_ratio_c": 3.0}.get(key, default)


def _make_verl(out: Path, site: str) -> list[str]:
    import torch

    _mount("verl", site)
    from verl.trainer.ppo import core_algos as ca  # type: ignore[import-not-found]  # peers venv only

    made = []
    cases = [
        ("k1", "kl", "token-mean"),
        ("k3", "low_var_kl", "seq-mean-token-mean"),
        ("k2", "mse", "seq-mean-token-sum"),
    ]
    for i, (ours, theirs, agg) in enumerate(cases):
        x = _inputs(100 + i)
        m = x["response_mask"]
        kl = ca.kl_penalty(x["old_logprobs"], x["ref_logprobs"], kl_penalty=theirs)
        last = (m.sum(dim=1) - 1).long()
        scores_tok = torch.zeros_like(m)
        scores_tok[torch.arange(m.shape[0]), last] = x["scores"]
        rewards = scores_tok - HP["kl_coef"] * kl * m  # ray_trainer.apply_kl_penalty, restated
        adv, ret = ca.compute_gae_advantage_return(rewards, x["old_values"], m, HP["gamma"], HP["lam"])
        pg, metrics = ca.compute_policy_loss_vanilla(
            x["old_logprobs"],
            x["logprobs"],
            adv,
            m,
            loss_agg_mode=agg,
            config=_VerlActorConfig(HP["cliprange"]),
        )
        vf, vf_clipfrac = ca.compute_value_loss(
            x["values"], ret, x["old_values"], m, cliprange_value=HP["cliprange_value"], loss_agg_mode=agg
        )
        dump = dict(x)
        dump.update(
            kl=kl,
            token_rewards=rewards,
            advantages=adv,
            returns=ret,
            pg_loss=pg.detach(),
            pg_clipfrac=torch.tensor(metrics["actor/pg_clipfrac"], dtype=torch.float64),
            approx_kl=torch.tensor(metrics["actor/ppo_kl"], dtype=torch.float64),
            vf_loss=vf.detach(),
            vf_clipfrac=torch.as_tensor(vf_clipfrac, dtype=torch.float64),
            loss=pg.detach(),
        )
        name = f"verl_{ours}_{agg}"
        _save(out, name, dump, {"kl_estimator": ours, "loss_agg": agg})
        made.append(name)
    return made


def _make_openrlhf(out: Path, site: str) -> list[str]:

    for n in ("openrlhf", "openrlhf.models", "openrlhf.trainer", "openrlhf.trainer.ppo_utils"):
        _mount(n, site)
    for n in ("openrlhf.trainer.ray", "openrlhf.utils"):
        _mount(n, site)
    sys.modules["deepspeed"] = types.ModuleType("deepspeed")
    launcher = types.ModuleType("openrlhf.trainer.ray.launcher")
    launcher.RayActorGroup = object  # type: ignore[attr-defined]  # stand-in; never used
    sys.modules[launcher.__name__] = launcher
    from openrlhf.models.loss import PolicyLoss, ValueLoss  # type: ignore[import-not-found]  # peers venv only
    from openrlhf.models.utils import (  # type: ignore[import-not-found]  # peers venv only
        compute_approx_kl,
        compute_reward,
    )
    from openrlhf.trainer.ppo_utils.experience_maker import (  # type: ignore[import-not-found]  # peers venv only
        RemoteExperienceMaker,
    )

    made = []
    for i, (est, token_level) in enumerate([("k1", True), ("k3", False), ("k2", True)]):
        x = _inputs(200 + i)
        m = x["response_mask"]
        kl = compute_approx_kl(x["old_logprobs"], x["ref_logprobs"], kl_estimator=est)
        rewards = compute_reward(
            x["scores"], HP["kl_coef"], kl, action_mask=m, reward_clip_range=(-10.0, 10.0)
        )
        adv_raw, ret = RemoteExperienceMaker.get_advantages_and_returns(
            None, x["old_values"], rewards, m, HP["gamma"], HP["lam"]
        )
        n = m.sum()
        mean = (adv_raw * m).sum() / n  # compute_advantages_and_returns, restated
        var = ((adv_raw - mean).pow(2) * m).sum() / n
        adv = (adv_raw - mean) * var.clamp(min=1e-8).rsqrt()
        pg, clip_ratio, ppo_kl, _, _ = PolicyLoss(
            HP["cliprange"], HP["cliprange"], token_level_loss=token_level
        )(x["logprobs"], x["old_logprobs"], adv, action_mask=m)
        vl = ValueLoss(HP["cliprange_value"])  # as trainer/ray/ppo_critic.py builds it: always token-level
        vf = vl(x["values"], x["old_values"], ret, action_mask=m)
        dump = dict(x)
        dump.update(
            kl=kl,
            token_rewards=rewards,
            advantages=adv,
            returns=ret,
            pg_loss=pg.detach(),
            pg_clipfrac=clip_ratio.detach(),
            approx_kl=ppo_kl.detach(),
            vf_loss=(vf[0] if isinstance(vf, tuple) else vf).detach(),
        )
        agg = "token-mean" if token_level else "seq-mean-token-mean"
        name = f"openrlhf_{est}_{agg}"
        _save(out, name, dump, {"kl_estimator": est, "loss_agg": agg})
        made.append(name)
    return made


def _save(out: Path, name: str, dump: dict[str, Any], conv: dict[str, Any]) -> None:
    import torch

    torch.save({k: v.detach().contiguous() for k, v in dump.items()}, out / f"{name}.pt")
    (out / f"{name}.pt.json").write_text(json.dumps(HP))
    (out / f"{name}.set.json").write_text(json.dumps(conv))


def make(out: Path) -> int:
    site = next(p for p in sys.path if p.endswith("site-packages"))
    status: dict[str, Any] = {}
    for peer, fn in (("verl", _make_verl), ("openrlhf", _make_openrlhf)):
        try:
            status[peer] = {"made": fn(out, site)}
        except Exception as exc:  # report why a peer cannot be imported/run, then go on
            status[peer] = {"skipped": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
    (out / "status.json").write_text(json.dumps(status, indent=2))
    return 0


# ------------------------------------------------------------------------------------------------
# Half 2: runs with refppo's interpreter.
# ------------------------------------------------------------------------------------------------


def validate(peers_python: str, keep: Path | None) -> int:
    if not Path(peers_python).exists():
        print(f"SKIPPED: no peers interpreter at {peers_python} (see this script's docstring to set one up)")
        return 0
    sys.path.insert(0, str(REPO))
    import contextlib
    import io

    from refppo.oracle.cli import main as diff_main

    with tempfile.TemporaryDirectory() as tmp:
        out = keep or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            [peers_python, str(Path(__file__).resolve()), "--make", str(out)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        status_file = out / "status.json"
        if proc.returncode != 0 or not status_file.exists():
            tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
            print(f"SKIPPED: the peers interpreter could not run the dump maker ({tail})")
            return 0
        status = json.loads(status_file.read_text())
        failures = 0
        for peer, st in status.items():
            if "skipped" in st:
                print(f"{peer}: SKIPPED ({st['skipped']})")
                continue
            for name in st["made"]:
                conv = json.loads((out / f"{name}.set.json").read_text())
                argv = [str(out / f"{name}.pt"), "--preset", peer, "--json"]
                for k, v in conv.items():
                    argv += ["--set", f"{k}={v}"]
                buf = io.StringIO()
                with contextlib.redirect_stdout(buf):
                    rc = diff_main(argv)
                rep = json.loads(buf.getvalue())
                worst = max((q["max_abs_err"] for q in rep["quantities"].values()), default=0.0)
                verdict = "MATCH" if rc == 0 else f"MISMATCH at {rep['first_divergence']}"
                n = len(rep["quantities"])
                print(f"{peer:<9} {name:<36} {verdict}  ({n} quantities, max abs err {worst:.2e})")
                for q, r in rep["quantities"].items():
                    print(f"    {q:<14} max_abs_err={r['max_abs_err']:.3e} tol={r['tol']:.1e} ok={r['ok']}")
                if rc != 0:
                    failures += 1
                    for d in rep["diagnosis"]:
                        print(f"    ! {d}")
        return 1 if failures else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument(
        "--make", metavar="OUTDIR", help="(internal) write the peers' dumps; run by the peers python"
    )
    ap.add_argument(
        "--peers-python",
        default=os.environ.get("REFPPO_PEERS_PYTHON", "/tmp/peers-venv/bin/python"),
        help="interpreter of the peers' virtual environment",
    )
    ap.add_argument("--keep", metavar="DIR", help="keep the dumps in DIR")
    args = ap.parse_args()
    if args.make:
        return make(Path(args.make))
    return validate(args.peers_python, Path(args.keep) if args.keep else None)


if __name__ == "__main__":
    raise SystemExit(main())
