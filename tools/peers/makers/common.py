"""Shared by the dump makers (run in the peers' interpreters; nothing from refppo is imported).

The import stand-ins are :mod:`peers.stubs` (re-exported here for the makers).

- :func:`inputs`: a random right-padded batch with junk on the padding.
- :func:`save`: one dump (``NAME.pt``), its sidecar (``NAME.pt.json``: hyperparameters) and the
  ``--set`` keys that reproduce it (``NAME.set.json``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from peers.stubs import install_stubs, mount

__all__ = ["HP", "behaviour_inputs", "inputs", "install_stubs", "mount", "save"]

HP: dict[str, float] = {
    "gamma": 0.99,
    "lam": 0.95,
    "kl_coef": 0.05,
    "cliprange": 0.2,
    "cliprange_value": 0.5,
    "vf_coef": 0.0,
    "ent_coef": 0.0,
}
"""Hyperparameters shared by every maker's sidecar (a maker may add its own keys)."""


def inputs(seed: int, B: int = 8, T: int = 16, dtype: Any = None, full_row: bool = True) -> dict[str, Any]:
    """Random right-padded inputs, junk (7.5) on padding. ``full_row``: row 0 has no padding."""
    import torch

    dt = dtype or torch.float64
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[1] = 1
    if full_row:
        lengths[0] = T
    else:
        lengths = torch.clamp(lengths, max=T - 1)
    mask = (torch.arange(T).expand(B, T) < lengths.unsqueeze(1)).to(dt)
    old = -torch.rand(B, T, generator=g, dtype=dt) * 3.0 - 0.1
    junk = torch.full((B, T), 7.5, dtype=dt)

    def pad(x: Any) -> Any:
        return torch.where(mask.bool(), x, junk)

    return {
        "response_mask": mask,
        "old_logprobs": pad(old),
        "ref_logprobs": pad(old + 0.4 * torch.randn(B, T, generator=g, dtype=dt)),
        "logprobs": pad(old + 0.6 * torch.randn(B, T, generator=g, dtype=dt)),
        "old_values": pad(torch.randn(B, T, generator=g, dtype=dt)),
        "values": pad(torch.randn(B, T, generator=g, dtype=dt)),
        "entropy": pad(torch.rand(B, T, generator=g, dtype=dt) * 2.0),
        "scores": 4.0 * torch.randn(B, generator=g, dtype=dt),
    }


def save(
    out: Path,
    name: str,
    dump: dict[str, Any],
    hp: dict[str, Any],
    conv: dict[str, Any],
    control: dict[str, Any] | None = None,
) -> str:
    """Write ``name``'s dump, sidecar (``hp``) and the ``--set`` keys (``conv``); returns ``name``.

    ``control``: ``--set`` keys that flip the option this case exercises; the validator checks that
    the dump then does NOT match (the option is load-bearing, the match is not vacuous).
    """
    import torch

    torch.save({k: v.detach().contiguous() for k, v in dump.items()}, out / f"{name}.pt")
    (out / f"{name}.pt.json").write_text(json.dumps(hp))
    (out / f"{name}.set.json").write_text(json.dumps(conv))
    if control:
        (out / f"{name}.control.json").write_text(json.dumps(control))
    return name


def behaviour_inputs(seed: int, beh_seed: int) -> dict[str, Any]:
    """:func:`inputs` plus ``rollout_logprobs = l^prox − 0.6·N(0, 1)`` (7.5 on padding)."""
    import torch

    x = inputs(seed)
    m = x["response_mask"]
    g = torch.Generator().manual_seed(beh_seed)
    beh = x["old_logprobs"] - 0.6 * torch.randn(m.shape, generator=g, dtype=m.dtype)
    x["rollout_logprobs"] = torch.where(m.bool(), beh, torch.full_like(beh, 7.5))
    return x
