"""verl 0.9.1 keeps the rows its rollout rejection empties in GRPO's group statistics (issue #22),
against verl's OWN installed code (side venv ``verl-openrlhf``; skipped with the reason without it).

:mod:`peers.makers.verl_rollout_rs_grpo` runs verl's ``compute_rollout_correction_and_rejection_mask``
(``seq_mean_k3`` at 0.5, rejecting one row whole) and ``compute_grpo_outcome_advantage`` on the reduced
mask. refppo's core ``group_advantages`` over EVERY row's score (the emptied one included), times the
reduced mask, reproduces verl's advantages; the control, the statistics over the kept rows only (what
the stage walk would compute after taking the emptied row out), must not. refppo's pipeline therefore
refuses such a gate under a group estimator in one line (``pipeline.correction._none_left``) rather
than computing the kept-rows statistics; the gate's mask itself is refppo's ``rejection_mask``.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
from _peers import REPO, TOOLS, require

from refppo.core.group import group_advantages
from refppo.core.rollout_correction import rejection_mask
from refppo.errors import ConventionError
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.stages import BY_NAME


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    py = require("verl-openrlhf")
    out = tmp_path_factory.mktemp("verl_rollout_rs_grpo")
    code = "import sys; from pathlib import Path; from peers.makers.verl_rollout_rs_grpo import make; "
    code += "make(Path(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": str(TOOLS)}
    subprocess.run([str(py), "-c", code, str(out)], check=True, cwd=REPO, env=env, timeout=600)
    got: dict[str, torch.Tensor] = torch.load(out / "verl_rollout_rs_grpo.pt", weights_only=True)
    return got


def _grpo(x: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """refppo's core GRPO (σ unbiased, ε = 1e-6 added: verl's) on ``rows`` of the batch, times the
    reduced mask, scattered back (0 elsewhere)."""
    m2 = x["mask_gated"].bool()
    a = group_advantages(x["scores"][rows].double(), x["group_index"][rows], x["mask"].bool()[rows], eps=1e-6)
    out = torch.zeros(m2.shape, dtype=torch.float64)
    out[rows] = a
    return torch.where(m2, out, 0.0)


def test_verl_grpo_keeps_emptied_rows_in_the_group_statistics(made: dict[str, torch.Tensor]) -> None:
    m2 = made["mask_gated"].bool()
    kept = m2.any(dim=1)
    assert int((~kept).sum()) == 1  # the gate empties one row, keeps the others
    verl = made["advantages"].double()
    every = (_grpo(made, torch.ones_like(kept)) - verl).abs().max().item()
    kept_only = (_grpo(made, kept) - verl).abs().max().item()
    print(f"verl 0.9.1 GRPO under seq_mean_k3: every row {every:.2e}, kept rows only {kept_only:.3f}")
    assert every <= 1e-6, every  # float32 verl
    assert kept_only > 0.1, kept_only  # the control mismatches


def test_refppos_gate_is_verls_and_the_pipeline_refuses_the_kept_rows_statistics(
    made: dict[str, torch.Tensor],
) -> None:
    m = made["mask"].bool()
    keep = rejection_mask(
        made["old"].double(), made["beh"].double(), m, stat="k3", order="behaviour", level="sequence",
        reduce="mean", high=0.5,
    )  # fmt: skip
    assert torch.equal(m & keep, made["mask_gated"].bool())
    conv = Convention.of(
        advantage="grpo", rollout_rs="sequence", rollout_rs_stat="k3", rollout_rs_order="behaviour",
        rollout_rs_high=0.5, rollout_rs_effect="drop_mask",
    )  # fmt: skip
    q = {"old_logprobs": made["old"].double(), "rollout_logprobs": made["beh"].double(), "mask": m,
         "value_mask": m}  # fmt: skip
    with pytest.raises(ConventionError, match="keeps them in the group statistics"):
        BY_NAME["rollout_gate"].run(q, conv, Hyperparams())
