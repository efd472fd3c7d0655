"""Small dumps for the oracle tests (B <= 8, T <= 16), with junk in the padding.

The outputs of a "refppo" dump come from the pipeline (``reference_outputs``); the injected bugs are
written here *independently*, from their definition, with plain loops over Python floats — never
from the oracle's own bug re-enactments — so a test can tell a wrong diagnosis.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from refppo.dump.write import write_dump
from refppo.oracle.check.recompute import reference_outputs
from refppo.oracle.check.settings import Setup, build_setup, parse_value
from refppo.oracle.presets.registry import resolve_preset

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
