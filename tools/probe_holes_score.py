#!/usr/bin/env python3
"""Where verl 0.9.1's score goes when a multi-turn response ENDS with tool-output tokens (not CI).

Run with the ``verl-openrlhf`` side venv's python (``tools/build_peer_venvs.sh``)::

    /work/peervenv/verl-openrlhf/bin/python tools/probe_holes_score.py

verl's agent loop puts the score on the last token of the response (``agent_loop.py``:
``rm_scores[-1] = reward_score``; the naive reward manager: ``valid_response_length − 1`` of the
attention mask), which is a tool-output token (``response_mask = 0``) when the episode stops after a
tool call. ``core_algos.compute_gae_advantage_return`` never reads a reward at a masked position, so
the score is lost. A dump cannot show this (its mask ends at the last valid token); the probe prints
the advantages of one row with V = 0, γ = λ = 1, score 1: on the trailing tool token vs on the last
valid token. Measured: ``[0.0, 0.0, 0.0]`` vs ``[1.0, 1.0, 1.0]``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    import torch
    from peer_makers.common import install_stubs, mount

    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
    install_stubs()
    mount("verl")
    from verl.trainer.ppo import core_algos as ca  # type: ignore[import-not-found]  # side venv only

    ca.verl_F.masked_whiten = lambda a, m: a  # the raw advantages (whitening is not the point)
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)  # ends with 2 tool tokens
    v = torch.zeros(1, 5, dtype=torch.float64)
    for where, slot in (("the trailing tool token", 4), ("the last valid token", 2)):
        r = torch.zeros(1, 5, dtype=torch.float64)
        r[0, slot] = 1.0
        adv, _ = ca.compute_gae_advantage_return(r, v, m, 1.0, 1.0)
        print(f"score on {where}: advantages of the valid tokens {adv[0, :3].tolist()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
