#!/usr/bin/env python3
"""Run the peers' OWN aggregation and value-clip code on one batch and compare refppo with it.

Not part of CI (by hand, like ``tools/validate_presets.py``). Two halves, two interpreters:

1. ``--peer-half IN OUT`` runs in a peers' virtual environment (``/work/shared/peers/README.md``:
   verl 0.9.1 + OpenRLHF 0.11.2 in one, SkyRL-train 0.3.1 + AReaL 1.0.4 in another). It loads the
   batch ``IN`` (plain tensors, ``torch.load(weights_only=True)``), calls every peer function it can
   import and writes the results to ``OUT``. It imports nothing from refppo.
2. Without ``--peer-half`` (refppo's interpreter) it writes the batch, runs half 1 with each
   ``--peers-python`` and compares with refppo's ``aggregate_loss`` / ``value_loss``, printing one
   line per comparison with the max abs error (exit 1 on a mismatch).

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

Import workarounds (nothing from them is called): package ``__init__`` files pull in Ray, vLLM,
DeepSpeed and more, so the packages are mounted as bare namespace modules and the listed heavy
names are served as inert modules (``ray.remote`` is the identity, ``ray.is_initialized()`` False).
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
B, T, H_CUSTOM, EPS_V = 8, 16, 24.0, 0.2
PEER_ENVS = ("/work/peervenv/verl-openrlhf/bin/python", "/work/peervenv/skyrl-areal/bin/python")

# ------------------------------------------------------------------------------------------------
# Half 1: runs in a peers' environment (no refppo import).
# ------------------------------------------------------------------------------------------------

_INERT = (
    "ray", "vllm", "sglang", "flash_attn", "deepspeed", "peft", "accelerate", "wandb", "tensorboard",
    "datasets", "torchdata", "hydra", "fastapi", "uvicorn", "aiohttp", "httpx", "requests", "tenacity",
    "einops", "flask", "PIL", "numba", "polars", "s3fs", "uvloop", "func_timeout", "debugpy",
    "hf_transfer", "skyrl_gym",
)  # fmt: skip


class _Inert(types.ModuleType):
    """A module whose every attribute is a harmless stand-in (never called by the code we run)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "remote" or name == "njit" or name == "jit":
            return lambda *a, **k: a[0] if a and callable(a[0]) and not k else (lambda f: f)
        if name == "is_initialized":
            return lambda: False
        return type(name, (), {"__init__": lambda self, *a, **k: None})


_INERT_IF_ABSENT = ("transformers", "loguru", "jaxtyping", "omegaconf")
"""Served inert only where the venv lacks them (AReaL's and SkyRL's module-level imports)."""


class _InertFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self) -> None:
        import importlib.util

        absent = [n for n in _INERT_IF_ABSENT if importlib.util.find_spec(n) is None]
        self.names = frozenset((*_INERT, *absent))

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> Any:
        mod = _Inert(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module: Any) -> None:
        return None


def _mount(name: str, site: str) -> None:
    mod = types.ModuleType(name)
    mod.__path__ = [os.path.join(site, *name.split("."))]
    sys.modules[name] = mod


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "absent"


def _verl(x: dict[str, Any], site: str, out: dict[str, Any]) -> None:
    import torch

    _mount("verl", site)
    from verl.trainer.ppo import core_algos as ca  # type: ignore[import-not-found]  # peers venv only

    lm, m = x["loss_mat"], x["mask"]
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


def _openrlhf(x: dict[str, Any], site: str, out: dict[str, Any]) -> None:
    for n in ("openrlhf", "openrlhf.models", "openrlhf.utils"):
        _mount(n, site)
    from openrlhf.models.loss import ValueLoss  # type: ignore[import-not-found]  # peers venv only

    out["openrlhf.value.vf_loss"] = ValueLoss(EPS_V)(x["v"], x["v_old"], x["ret"], action_mask=x["vmask"])


def _skyrl(x: dict[str, Any], site: str, out: dict[str, Any]) -> None:
    import torch

    _mount("skyrl_train", site)
    _mount("skyrl_train.utils", site)
    from skyrl_train.utils import ppo_utils as pu  # type: ignore[import-not-found]  # peers venv only

    lm, m = x["loss_mat"], x["mask"]
    out["skyrl.agg.token-mean"] = pu.reduce_loss(lm, m, "token_mean")
    out["skyrl.agg.seq-mean-token-mean"] = pu.reduce_loss(lm, m, "sequence_mean")
    out["skyrl.agg.seq-mean-token-sum-norm"] = pu.reduce_loss(lm, m, "seq_mean_token_sum_norm", max_seq_len=T)
    out["skyrl.agg_h24.seq-mean-token-sum-norm"] = pu.reduce_loss(
        lm, m, "seq_mean_token_sum_norm", max_seq_len=int(H_CUSTOM)
    )
    cfg = types.SimpleNamespace(value_clip=EPS_V)
    loss, clipfrac = pu.ppo_critic_loss(x["v"], x["v_old"], x["ret"], cfg, loss_mask=x["vmask"])
    out["skyrl.value.vf_loss"], out["skyrl.value.vf_clipfrac"] = loss, torch.as_tensor(clipfrac)


def _areal(x: dict[str, Any], site: str, out: dict[str, Any]) -> None:
    for n in (
        "areal",
        "areal.utils",
        "areal.utils.functional",
        "areal.api",
        "areal.infra",
        "areal.experimental",
    ):
        _mount(n, site)
    from areal.utils.functional.functional import (  # type: ignore[import-not-found]  # peers venv only
        ppo_critic_loss_fn,
    )

    m = x["vmask"].bool()
    loss, stat = ppo_critic_loss_fn(x["v"], x["v_old"], x["ret"], EPS_V, loss_mask=m)
    out["areal.value.vf_loss"] = loss
    out["areal.value.vf_clipfrac"] = stat["clip_mask"].sum().float() / m.sum().float()


def peer_half(inp: str, outp: str) -> int:
    import sysconfig

    import torch

    sys.meta_path.insert(0, _InertFinder())
    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
    site = sysconfig.get_paths()["purelib"]
    x = torch.load(inp, weights_only=True)
    out: dict[str, Any] = {}
    status: dict[str, str] = {}
    for name, dist, fn in (
        ("verl", "verl", _verl),
        ("openrlhf", "openrlhf", _openrlhf),
        ("skyrl", "skyrl-train", _skyrl),
        ("areal", "areal", _areal),
    ):
        ver = _version(dist)
        if ver == "absent":
            continue
        try:
            fn(x, site, out)
            status[name] = f"{dist} {ver}"
        except Exception as exc:  # report and go on: one peer failing to import is not fatal
            status[name] = f"{dist} {ver}: FAILED {type(exc).__name__}: {str(exc)[:200]}"
    torch.save({k: torch.as_tensor(v).detach() for k, v in out.items()}, outp)
    Path(outp + ".json").write_text(json.dumps(status))
    return 0


# ------------------------------------------------------------------------------------------------
# Half 2: refppo's side.
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
    return {
        "loss_mat": loss_mat,
        "mask": mask.to(torch.float64),
        "vmask": mask.to(f32),
        "v": torch.where(mask, v.to(f32), pad32),
        "v_old": torch.where(mask, v_old.to(f32), pad32),
        "ret": torch.where(mask, ret.to(f32), pad32),
    }


def _refppo(x: dict[str, Any]) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from refppo.core.aggregate import aggregate_loss
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
    return ref


def _pairs(peer: str, key: str) -> list[tuple[str, str]]:
    """(refppo key, label) pairs for one peer result key."""
    rest = key.split(".", 1)[1]
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


def validate(pythons: list[str]) -> int:
    import torch

    x = _batch()
    ref = _refppo(x)
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        inp = os.path.join(tmp, "batch.pt")
        torch.save(x, inp)
        for py in pythons:
            if not Path(py).exists():
                print(f"SKIPPED: no interpreter {py}")
                continue
            outp = os.path.join(tmp, "out.pt")
            proc = subprocess.run(
                [py, str(Path(__file__).resolve()), "--peer-half", inp, outp],
                capture_output=True,
                text=True,
                timeout=600,
            )
            if proc.returncode != 0:
                print(f"SKIPPED {py}: {' | '.join(proc.stderr.strip().splitlines()[-3:])}")
                continue
            print(f"{py}: {json.loads(Path(outp + '.json').read_text())}")
            got = torch.load(outp, weights_only=True)
            for key in sorted(got):
                peer = key.split(".")[0]
                for rkey, label in _pairs(peer, key):
                    err = float((got[key].double() - torch.as_tensor(ref[rkey]).double()).abs())
                    exact = "clipfrac" in key
                    if label == "pre-fix":
                        ratio = float(torch.as_tensor(ref[rkey])) / float(got[key])
                        print(f"  {key:<44} vs {rkey:<40} ratio {ratio:.4g} (the old form: B = {B} times)")
                        continue
                    if label == "other":
                        n = round(err * float(x["vmask"].sum()))
                        print(f"  {key:<44} vs {rkey:<40} differs by {n} token(s) (the other form)")
                        continue
                    ok = err == 0.0 if exact else err <= 1e-6 * max(1.0, abs(float(ref[rkey])))
                    failures += not ok
                    tag = "OK " if ok else "BAD"
                    print(f"  {tag} {key:<40} vs refppo {rkey:<40} max abs err {err:.2e} {label}")
    return 1 if failures else 0


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
