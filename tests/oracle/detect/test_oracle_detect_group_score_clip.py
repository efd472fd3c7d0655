"""``--detect`` on a GRPO dump whose scores were scaled and clipped before the group normalisation.

AReaL 1.0.4 ``PPOActor._compute_advantages`` maps the score ``clip(s·k, ±C)`` (``reward_scaling``,
``reward_clip``) and then ``Normalization`` (``mean_level = std_level = "group"``, unbiased std,
``eps = 1e-5``) gives ``a_i = (s'_i − mean_G)/(std_G + eps)`` on every valid token (GAE over zero
values, γ = λ = 1). The dump is built here by plain Python loops from those equations, not by
refppo's pipeline (``tools/peers grpo_peers --venv skyrl-areal`` runs AReaL's own code). The
scale cancels in ``(s' − μ)/σ`` up to ε; the binding clip does not, and ``--detect`` must solve it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from oracle_helpers import make_inputs

from refppo.dump.write import write_dump
from refppo.oracle.cli import main

B, T, N = 8, 10, 4
SCALE, CLIP, EPS = 2.0, 0.9, 1e-5


def _dump() -> dict[str, torch.Tensor]:
    x = make_inputs(B=B, T=T, seed=11)
    for k in ("old_values", "values", "entropy"):
        x.pop(k)
    x["scores"] = torch.tensor([0.1, -0.2, 0.8, 0.3, -0.9, 0.05, 0.25, -0.15], dtype=torch.float64)
    y = [min(max(float(v) * SCALE, -CLIP), CLIP) for v in x["scores"]]
    assert any(abs(v) == CLIP for v in y) and any(abs(v) < CLIP for v in y)  # the clip binds on some
    a = []
    for i in range(B):
        g = y[(i // N) * N : (i // N + 1) * N]
        mu = sum(g) / N
        sd = math.sqrt(sum((v - mu) ** 2 for v in g) / (N - 1))
        a.append((y[i] - mu) / (sd + EPS))
    m = x["response_mask"].bool().tolist()
    ret = torch.tensor([[a[i] if m[i][t] else 0.0 for t in range(T)] for i in range(B)], dtype=torch.float64)
    keep = {k: x[k] for k in ("scores", "response_mask", "old_logprobs", "ref_logprobs")}
    return {**keep, "group_index": torch.arange(B, dtype=torch.int64) // N, "returns": ret}


def test_detect_solves_the_score_clip_of_a_grpo_dump(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = tmp_path / "d.pt"
    write_dump(p, _dump())
    capsys.readouterr()
    rc = main([str(p), "--preset", "areal", "--set", "advantage=grpo", "--detect", "--json"])
    rep = json.loads(capsys.readouterr().out)
    found = [c for c in rep["detected"] if c["advantage"] == "grpo"]
    assert found, rep
    hit = [c for c in found if c["score_scale"] == SCALE and c["score_clip"] == CLIP]
    assert hit, found  # the generating map, not only its ε-near twin score_scale=1 score_clip=0.45
    assert rc == 1  # the checked setting (score_clip=20, scale 1) does not reproduce the dump


def test_a_checked_group_eps_of_zero_still_tries_the_peers_eps(tmp_path: Path) -> None:
    """rev2 NIT-3: the scale is read as ``r = ε/ε_read`` for the checked ``group_eps`` and each of
    ``PEER_GROUP_EPS``. A checked ``group_eps = 0`` gives no ratio; before, it ended the loop
    (``break``), so AReaL's ε = 1e-5 was never tried and only the ε-near twin ``(1, 0.45)`` came out."""
    from oracle_helpers import setup_for

    from refppo.dump.load import load_dump
    from refppo.oracle.detect.search import Search
    from refppo.oracle.detect.solve_score import solve_group_score_clip

    p = tmp_path / "d.pt"
    write_dump(p, _dump())
    for eps in (0.0, 1e-6):
        base = setup_for("areal", {"advantage": "grpo", "group_eps": eps}, {"kl_coef": 0.0})
        assert base.conv.adv.group_eps == eps
        maps = solve_group_score_clip(Search(load_dump(p), base), [])
        assert (SCALE, CLIP) in maps, (eps, maps)
