"""AReaL 1.0.4 steps with truncated rows: GAE bootstrapped from the value after the last token
(``skyrl-areal`` venv).

``python tools/peers/makers/areal_bootstrap.py OUT`` (the side venv's python, ``PYTHONPATH=tools``)
writes ``OUT/areal_bootstrap_*.pt`` and their sidecars. AReaL's own
``areal/trainer/ppo/actor.py::PPOActor._compute_advantages`` (through
:mod:`peers.makers.areal_frame`) on a frame of one prompt token and ``W = T + 1`` positions: a row
with ``T`` response tokens fills the frame, so AReaL marks it ``seq_no_eos_mask`` (truncated) and
starts its GAE from ``nextvalues = values[:, W − 1]``, the critic's value of the state after the
last token. That value is dumped as ``bootstrap_values`` [B] (0 on the rows that ended, as AReaL's
``* seq_no_eos_mask``), and ``truncated`` [B] as AReaL's flag; then AReaL's
``ppo_actor_loss_fn`` / ``ppo_critic_loss_fn`` on its advantages and returns. float32 (AReaL's
critic loss asserts it). Nothing from refppo is imported.

Cases: ``flagged`` (the dump carries ``truncated``), ``implied`` (no ``truncated`` key: the rows
whose last position is valid are the truncated ones, AReaL's own test in the response frame),
``whitened`` (``adv_norm`` batch/batch on top). Control: ``gae_bootstrap=none``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the package ``peers``

from peers.makers.areal import HP
from peers.makers.areal_frame import Norm, advantages, areal_fns, step_dump
from peers.makers.common import inputs, save

B, T = 12, 16
CASES: list[tuple[str, int, bool, Norm]] = [
    ("flagged", 930, True, None),
    ("implied", 931, False, None),
    ("whitened", 932, True, ("batch", "batch", True)),
]
"""(name, seed, dump ``truncated``, ``adv_norm``)."""


def full_frame(x: dict[str, Any], boot: Any) -> dict[str, Any]:
    """AReaL's ``data`` [B, T + 1] for ``_compute_advantages``: the prompt token, then the response;
    rolled-frame ``values`` hold ``old_values`` at ``0..T−1`` and ``boot`` at ``T`` (junk 7.5 on
    padding, which AReaL never reads)."""
    import torch

    m = x["response_mask"]
    W = T + 1
    attn = torch.cat([torch.ones(B, 1, dtype=torch.long), m.long()], dim=1)
    loss_mask_in = torch.cat([torch.zeros(B, 1), m], dim=1).to(torch.float32)
    junk = torch.full((B, W), 7.5, dtype=torch.float32)
    logprobs_in, ref_rolled, values_rolled = junk.clone(), junk.clone(), junk.clone()
    logprobs_in[:, 1:] = x["old_logprobs"]
    ref_rolled[:, :T] = x["ref_logprobs"]
    values_rolled[:, :T] = x["old_values"]
    values_rolled[:, T] = boot
    return {
        "input_ids": torch.ones(B, W, dtype=torch.long),
        "attention_mask": attn,
        "loss_mask": loss_mask_in,
        "logprobs": logprobs_in,
        "ref_logp": ref_rolled,
        "values": values_rolled,
        "rewards": x["scores"].clone(),
    }


def make(out: Path) -> list[str]:
    """One dump per case of :data:`CASES` (module docstring); every batch has truncated rows and
    rows that ended."""
    import torch

    fns = areal_fns()
    made = []
    for name, seed, flagged, norm in CASES:
        x = inputs(seed, B=B, T=T, dtype=torch.float32, full_row=True)
        g = torch.Generator().manual_seed(seed + 1)
        x["response_mask"][2] = 1.0  # a second truncated row: row 0's tokens, perturbed
        for k in ("old_logprobs", "ref_logprobs", "logprobs", "old_values", "values", "entropy"):
            x[k][2] = x[k][0] - 0.1 * torch.rand(T, generator=g, dtype=torch.float32)
        m = x["response_mask"].bool()
        boot = 3.0 * torch.randn(B, generator=g, dtype=torch.float32)
        res = advantages(fns, full_frame(x, boot), HP, "k1", norm, HP["whiten_eps"], (0.0, 1.0, 20.0))
        dump = step_dump(fns, x, res, HP, "k1")
        cut = m[:, -1]
        assert bool(cut.any()) and not bool(cut.all())
        dump["bootstrap_values"] = torch.where(cut, boot, 0.0)
        if flagged:
            dump["truncated"] = cut
        conv: dict[str, Any] = {"kl_estimator": "k1", "gae_bootstrap": "truncated"}
        if norm is not None:
            conv["whiten_advantages"] = "masked"
        made.append(save(out, f"areal_bootstrap_{name}", dump, HP, conv, {"gae_bootstrap": "none"}))
    return made


if __name__ == "__main__":
    print(make(Path(sys.argv[1])))
