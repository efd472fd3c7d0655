"""TRL 1.12.0's logged ``approxkl`` from its own ``PPOTrainer.train`` (the ``trl`` venv).

``python tools/peers/makers/trl_approx_kl.py OUT`` (the venv's python; ``PYTHONPATH`` = the repo and
``tools``) writes ``OUT/trl_approx_kl.safetensors`` and its sidecar: case ``ragged_k3_epoch2`` of
:mod:`peers.makers.trl_ppo` (right-padded rows of different lengths, captured in the second PPO
epoch, so ``l ≠ l_old``). TRL's ``approxkl = 0.5 * ((new_logprobs − mb_logprobs) ** 2).mean()`` is
an unmasked mean over all ``B·T`` positions of the frame (``INVALID_LOGPROB`` on the padding of
both, so ``d = 0`` there): refppo's ``approx_kl=k2_all_positions``
(``trl/experimental/ppo/ppo_trainer.py::PPOTrainer.train``).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the package ``peers``

CASE = "ragged_k3_epoch2"


def make(out: Path) -> list[str]:
    """The one dump of the module docstring (written with refppo's ``write_dump``, as trl_ppo)."""
    from peers.makers import trl_ppo
    from refppo.dump.write import write_dump

    tensors, side, _facts = trl_ppo.run_trl(CASE, trl_ppo.CASES[CASE])
    name = "trl_approx_kl"
    write_dump(out / f"{name}.safetensors", tensors, hparams=side["hparams"], convention=side["convention"])
    return [name]


if __name__ == "__main__":
    print(make(Path(sys.argv[1])))
