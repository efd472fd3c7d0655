"""An AReaL 1.0.4 step whose critic clip fraction hangs on a rounding tie (``skyrl-areal`` venv).

``python tools/peers/makers/areal_value_ties.py OUT`` (the side venv's python, ``PYTHONPATH=tools``)
writes ``OUT/areal_value_ties.pt`` and its sidecar: AReaL's own
``areal/trainer/ppo/actor.py::PPOActor._compute_advantages`` and
``areal/utils/functional/functional.py::ppo_actor_loss_fn`` / ``ppo_critic_loss_fn`` (through
:mod:`peers.makers.areal_frame`) on a float32 batch of 16 rows × 16 tokens with ``eps_clip`` 0.5
for the critic (seed 907). Inside the clip range AReaL's ``V_old + clamp(V − V_old, ±ε_v)`` lands
one rounding step off ``V`` on some tokens, and its ``clip_mask`` (a strict ``>`` of
``½(V^clip − R)²`` and ``½(V − R)²``) then reads how the two squares rounded: on this batch one
such token is counted with AReaL's returns and not with refppo's (one rounding step apart), so
``vf_clipfrac`` is 63/149 in the dump and 62/149 in the reference. Nothing from refppo is imported.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the package ``peers``

from peers.makers.areal import HP
from peers.makers.areal_frame import advantages, areal_fns, rolled_batch, step_dump
from peers.makers.common import inputs, save

SEED, B, T, EPS_V = 907, 16, 16, 0.5


def make(out: Path) -> list[str]:
    """The one dump of the module docstring (``k1`` KL in the reward, no ``adv_norm``)."""
    import torch

    fns = areal_fns()
    x = inputs(SEED, B=B, T=T, dtype=torch.float32, full_row=False)
    hp = dict(HP, cliprange_value=EPS_V)
    batch = rolled_batch(x, x["response_mask"])
    res = advantages(fns, batch, hp, "k1", None, hp["whiten_eps"], (0.0, 1.0, 20.0))
    dump = step_dump(fns, x, res, hp, "k1", None, None)
    control = {"value_clip_form": "around_old"}
    return [save(out, "areal_value_ties", dump, hp, {"kl_estimator": "k1"}, control)]


if __name__ == "__main__":
    print(make(Path(sys.argv[1])))
