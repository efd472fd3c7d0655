"""verl 0.9.1 keeps the rows its rollout rejection empties in GRPO's group statistics (issue #22), against
verl's OWN installed code (side venv ``verl-openrlhf``; skipped with the reason without it).

:mod:`peers.makers.verl_rollout_rs_grpo` runs verl's ``compute_rollout_correction_and_rejection_mask``
(``seq_mean_k3`` at 0.5, rejecting one row whole) and ``compute_grpo_outcome_advantage`` on the reduced
mask. refppo's core ``group_advantages`` over EVERY row's score (the emptied one included), times the
reduced mask, reproduces verl's advantages; the control, the statistics over the kept rows only, must
not. refppo's stage walk computes the former (``pipeline.row_subset.group_advantages_on_every_row``): its
rollout stages reproduce verl's advantages, and whole-step dumps made with verl's own GRPO and policy
loss (and its Dr.GRPO and RLOO) under such a gate (``make_dumps``: v1 and v2) match under ``--preset
verl`` + their ``--set`` keys, the control ``rollout_rs_effect=weight`` mismatching.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from _peers import REPO, TOOLS, require

from refppo.core.group import group_advantages
from refppo.core.rollout_correction import rejection_mask
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import rollout_quantities


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


def test_refppos_gate_is_verls_and_the_stage_walk_gives_verls_advantages(
    made: dict[str, torch.Tensor],
) -> None:
    m = made["mask"].bool()
    keep = rejection_mask(
        made["old"].double(), made["beh"].double(), m, stat="k3", order="behaviour", level="sequence",
        reduce="mean", high=0.5,
    )  # fmt: skip
    assert torch.equal(m & keep, made["mask_gated"].bool())
    conv = Convention.of(
        advantage="grpo", group_eps=1e-6, whiten_advantages="none", kl_in="loss", rollout_rs="sequence",
        rollout_rs_stat="k3", rollout_rs_order="behaviour", rollout_rs_high=0.5,
        rollout_rs_effect="drop_mask",
    )  # fmt: skip
    ro = rollout_quantities(
        scores=made["scores"].double(), old_logprobs=made["old"].double(), ref_logprobs=None, old_values=None,
        mask=m, hp=Hyperparams(kl_coef=0.0), conv=conv, group_index=made["group_index"],
        rollout_logprobs=made["beh"].double(),
    )  # fmt: skip
    err = (ro.advantages - made["advantages"].double()).abs().max().item()
    print(f"verl 0.9.1 GRPO under seq_mean_k3: refppo's stage walk {err:.2e}")
    assert err <= 1e-6, err  # float32 verl


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    py = require("verl-openrlhf")
    out = tmp_path_factory.mktemp("verl_rollout_rs_grpo_dumps")
    code = "import sys; from pathlib import Path; from peers.makers.verl_rollout_rs_grpo import make_dumps; "
    code += "make_dumps(Path(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": str(TOOLS)}
    subprocess.run([str(py), "-c", code, str(out)], check=True, cwd=REPO, env=env, timeout=600)
    return out


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("case", ["token_mean", "seq_mean", "rloo", "dr_grpo"])
def test_verl_grpo_under_a_row_emptying_gate_matches_and_not_as_a_weight(
    dumps: Path, case: str, version: str
) -> None:
    from peers.checks import preset_case

    c = preset_case("verl", dumps, f"verl_rollout_rs_grpo_{case}_{version}", "verl", verbose=True)
    assert c.info["verdict"] == "MATCH", c.notes
    errs = {q: v[0] for q, v in c.info["quantities"].items()}
    print(case, version, errs)
    assert {"advantages", "pg_loss"} <= set(errs) and max(errs.values()) <= 1e-7, errs
    assert ("grad_logprobs" in errs) == (version == "v2")
    assert [ctl.ok for ctl in c.controls] == [True], c.controls  # rollout_rs_effect=weight mismatches
