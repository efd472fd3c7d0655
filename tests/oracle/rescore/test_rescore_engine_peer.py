"""The engine-vs-trainer gate statistics against verl 0.9.1's own code
(``verl/trainer/ppo/rollout_corr_helper.py::compute_offpolicy_metrics``), run in its side venv
(skipped, with the reason, where the venv is not built). Control: the two roles swapped must differ."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from refppo.oracle.rescore.engine_math import gate_stats

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[3]
TOOLS = REPO / "tools"
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

from peers.harness import not_built, peers_python  # noqa: E402  (tools/ is not a package)

VERL_SIDE = """
import json, sys
from peers.stubs import install_stubs
install_stubs()
import importlib.metadata as md
import torch
from verl.trainer.ppo.rollout_corr_helper import compute_offpolicy_metrics
t = torch.load(sys.argv[1], weights_only=True)
out = {"version": md.version("verl")}
for name, (old, rollout) in {"right": ("trainer", "engine"), "swapped": ("engine", "trainer")}.items():
    out[name] = compute_offpolicy_metrics(t[old], t[rollout], t["mask"])
print(json.dumps(out))
"""
PAIRS = {"kl": "kl_k1", "k3_kl": "kl_k3", "chi2_token": "chi2_token", "chi2_seq": "chi2_seq"}


def test_gate_stats_equal_verls_offpolicy_metrics(tmp_path: Path) -> None:
    py = peers_python("verl-openrlhf")
    if py is None:
        pytest.skip(not_built("verl-openrlhf"))
    g = torch.Generator().manual_seed(0)
    B, T = 6, 9
    trainer = -5 * torch.rand(B, T, generator=g, dtype=torch.float64)
    engine = trainer + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.tensor([9, 1, 4, 7, 2, 5])
    mask = (torch.arange(T) < lengths[:, None]).to(torch.float64)
    torch.save({"trainer": trainer, "engine": engine, "mask": mask}, tmp_path / "t.pt")
    proc = subprocess.run(
        [str(py), "-c", VERL_SIDE, str(tmp_path / "t.pt")],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(TOOLS), "PATH": "/usr/bin:/bin"},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["version"] == "0.9.1"
    ours = gate_stats(engine, trainer, mask, delta=0.2)
    worst = max(abs(doc["right"][k] - ours[v]) / max(1.0, abs(ours[v])) for k, v in PAIRS.items())
    assert worst < 1e-8, (doc["right"], ours)  # verl's masked mean divides by (count + 1e-8)
    assert abs(doc["swapped"]["kl"] - ours["kl_k1"]) > 1e-3  # the control: roles swapped
    assert abs(doc["swapped"]["chi2_token"] - ours["chi2_token"]) > 1e-3
