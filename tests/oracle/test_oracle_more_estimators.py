"""The oracle on dumps of verl's ``opo``/``gpg``/``grpo_passk`` and OpenRLHF's ``flash_reinforce``
steps (issue #13 item 3): ``refppo diff --preset PEER --set advantage=EST`` reproduces a dump whose
advantages come from the naive twins (KL folded into the score by plain loops, or added as its
return-to-go), and a neighbouring estimator does not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from oracle_helpers import HP, make_inputs

from refppo.core.group_naive import group_advantages_naive
from refppo.dump.write import write_dump
from refppo.oracle.cli import main

B, T, BETA = 8, 10, 0.1
GROUPS = torch.tensor([3, 1, 3, 1, 3, 1, 3, 1])


def _dump(est: str, *, folded: bool, beta: float = BETA) -> dict[str, torch.Tensor]:
    x = make_inputs(B=B, T=T, seed=4)
    for k in ("old_values", "values", "entropy"):
        x.pop(k)
    x["scores"][GROUPS == 1] = torch.tensor([0.0, 1.0, 0.0, 0.5], dtype=x["scores"].dtype)  # gpg: zeros
    m = x["response_mask"].bool()
    o, r = x["old_logprobs"].tolist(), x["ref_logprobs"].tolist()
    kl = [[o[i][t] - r[i][t] if m[i, t] else 0.0 for t in range(T)] for i in range(B)]
    s = [float(v) for v in x["scores"]]
    if folded:  # verl: the token rewards summed (score − β·Σ KL), then grouped
        fs = torch.tensor([s[i] - beta * sum(kl[i]) for i in range(B)], dtype=torch.float64)
        adv = group_advantages_naive(fs, GROUPS, m, estimator=est, singleton="score")
    else:  # OpenRLHF: the score grouped alone, −β·KL as its return-to-go
        pen = torch.tensor([[-beta * v for v in row] for row in kl], dtype=torch.float64)
        adv = group_advantages_naive(x["scores"], GROUPS, m, estimator=est, token_penalty=pen)
    kl_t = torch.tensor(kl, dtype=torch.float64)
    return {**x, "kl": kl_t, "group_index": GROUPS.clone(), "advantages": adv, "returns": adv.clone()}


def _diff(
    tmp: Path, d: dict[str, torch.Tensor], capsys: pytest.CaptureFixture[str], *argv: str, beta: float = BETA
) -> int:
    path = tmp / "step.safetensors"
    write_dump(path, d, hparams={**HP, "kl_coef": beta})
    rc = main([str(path), *argv])
    capsys.readouterr()
    return rc


@pytest.mark.parametrize(("est", "other"), [("opo", "dr-grpo"), ("gpg", "dr-grpo"), ("grpo-passk", "grpo")])
def test_verl_variants_reproduce_and_a_neighbour_does_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], est: str, other: str
) -> None:
    beta = 0.0 if est == "gpg" else BETA  # gpg counts the zero scores: 0/1 outcomes, no KL folded in
    d = _dump(est, folded=True, beta=beta)
    assert _diff(tmp_path, d, capsys, "--preset", "verl", "--set", f"advantage={est}", beta=beta) == 0
    assert _diff(tmp_path, d, capsys, "--preset", "verl", "--set", f"advantage={other}", beta=beta) == 1


def test_openrlhf_flash_reinforce_needs_no_group_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The batch-mean baseline reads no ``group_index``: a dump without it is checked (it was
    refused as a group estimator's), and the group baseline of Dr. GRPO does not reproduce it."""
    d = _dump("flash-reinforce", folded=False)
    d.pop("group_index")
    argv = ("--preset", "openrlhf", "--set", "kl_estimator=k1")
    assert _diff(tmp_path, d, capsys, *argv, "--set", "advantage=flash-reinforce") == 0
    d["group_index"] = GROUPS.clone()
    assert _diff(tmp_path, d, capsys, *argv, "--set", "advantage=dr-grpo") == 1
