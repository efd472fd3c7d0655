"""The rejection gates ``rollout_rs*`` as stage-table keys, checked by the oracle (issue #22 item 2).

v1: dumps from the naive twins (``oracle_helpers.naive_dump``: the gate by ``rejection_mask_naive``
multiplied into the weight, token by token) match under their keys and mismatch at ``pg_loss`` under
one flipped key (the control) and without the gate. v2: a hand-written step (torch ops, not refppo's)
whose gate is restated here, ``∂loss/∂logprobs`` by autograd, matches under its keys through the
update's gradient; with the gate not applied to the gradient path it is caught.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from oracle_helpers import HP, make_inputs, naive_dump, setup_for, with_behaviour
from torch import Tensor

from refppo.dump.load import load_dump
from refppo.dump.write import write_dump
from refppo.errors import ConventionError
from refppo.oracle.check.diagnose import CheckResult, check
from refppo.train.config.sections import ConfigError

CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # (the gate, the control's flipped key)
    "verl-seq-mean-k3": (
        {"rollout_rs": "sequence", "rollout_rs_stat": "k3", "rollout_rs_order": "behaviour",
         "rollout_rs_reduce": "mean", "rollout_rs_high": 0.07},
        {"rollout_rs_reduce": "sum"},
    ),
    "verl-token-k1-band": (
        {"rollout_rs": "token", "rollout_rs_stat": "ratio", "rollout_rs_order": "behaviour",
         "rollout_rs_low": 0.6, "rollout_rs_high": 1.5},
        {"rollout_rs_order": "proximal"},
    ),
    "areal-token-k2-raw-ratio": (
        {"rollout_is": "token", "rollout_rs": "token", "rollout_rs_stat": "k2", "rollout_rs_high": 0.3},
        {"rollout_rs_stat": "k3"},
    ),
    "areal-seq-k1-sum-signed": (
        {"rollout_is": "token", "rollout_rs": "sequence", "rollout_rs_stat": "k1",
         "rollout_rs_reduce": "sum", "rollout_rs_low": -0.5, "rollout_rs_high": 0.5},
        {"rollout_rs_reduce": "mean"},
    ),
    "openrlhf-seq-gate": (
        {"rollout_is": "token", "rollout_rs": "sequence", "rollout_rs_reduce": "mean",
         "rollout_rs_low": 0.8, "rollout_rs_high": 1.25},
        {"rollout_rs_reduce": "sum"},
    ),
    "veto-max": (
        {"rollout_rs": "sequence", "rollout_rs_order": "behaviour", "rollout_rs_reduce": "max",
         "rollout_rs_high": 2.0},
        {"rollout_rs_reduce": "mean"},
    ),
    "gate-and-tis": (
        {"rollout_is": "token", "rollout_is_high": 2.0, "rollout_rs": "token", "rollout_rs_stat": "k3",
         "rollout_rs_high": 0.2},
        {"rollout_rs_stat": "k2"},
    ),
}  # fmt: skip


def _inputs() -> dict[str, Tensor]:
    return with_behaviour(make_inputs(B=8, T=12, seed=5))


def _save(tmp: Path, d: dict[str, Tensor], conv: dict[str, Any], **extra: int) -> CheckResult:
    s = setup_for(None, conv)
    hp = {k: v for k, v in s.hparams_dict().items() if v is not None}
    path = tmp / "step.safetensors"
    write_dump(path, d, hparams={**hp, **extra})
    return check(load_dump(path), s)


@pytest.mark.parametrize("case", list(CASES))
def test_a_gated_naive_dump_matches_under_its_keys_and_not_under_the_control(
    tmp_path: Path, case: str
) -> None:
    conv, flip = CASES[case]
    d = naive_dump(_inputs(), setup_for(None, conv))
    res = _save(tmp_path, d, conv)
    assert res.match, (case, res.first_divergence, res.diagnosis)
    for other in ({**conv, **flip}, {k: v for k, v in conv.items() if not k.startswith("rollout_rs")}):
        ctl = _save(tmp_path, d, other)
        assert not ctl.match and ctl.first_divergence == "pg_loss", (case, other, ctl.first_divergence)


def _gated_step(apply_gate_to_grad: bool) -> dict[str, Tensor]:
    """One hand-written step under AReaL's ``kl_k2`` token gate on the raw ratio (torch ops, not
    refppo's): ``d = l^prox − l^beh``, ``keep = [½d² ≤ 0.3]``, ``w = e^d·keep`` (detached),
    ``pg = Σ w·max(−Aρ, −A·clip(ρ, 0.8, 1.2)) / N`` over every valid token. ``apply_gate_to_grad``
    False: the gradient is taken with the ungated weight ``e^d`` (the values stay the gated ones)."""
    x = _inputs()
    conv = CASES["areal-token-k2-raw-ratio"][0]
    d = naive_dump(x, setup_for(None, conv))
    m = d["response_mask"].bool()
    lr = torch.where(m, d["old_logprobs"] - d["rollout_logprobs"], 0.0)
    keep = m & (0.5 * lr * lr <= 0.3)
    w_grad = torch.where(keep if apply_gate_to_grad else m, torch.exp(lr), 0.0)
    lp = d["logprobs"].clone().requires_grad_(True)
    v = d["values"].clone().requires_grad_(True)
    eps, adv = HP["cliprange"], d["advantages"]
    rho = torch.exp(torch.where(m, lp - d["old_logprobs"], 0.0))
    pg_tok = torch.maximum(-adv * rho, -adv * torch.clamp(rho, 1 - eps, 1 + eps))
    eps_v = HP["cliprange_value"]
    v_clip = torch.clamp(v, d["old_values"] - eps_v, d["old_values"] + eps_v)
    vf_tok = 0.5 * torch.maximum((v - d["returns"]) ** 2, (v_clip - d["returns"]) ** 2)
    n = m.sum()
    pg = torch.where(m, w_grad * pg_tok, 0.0).sum() / n
    g_lp, g_v = torch.autograd.grad(pg + HP["vf_coef"] * torch.where(m, vf_tok, 0.0).sum() / n, (lp, v))
    return {**d, "grad_logprobs": torch.where(m, g_lp, 0.0), "grad_values": torch.where(m, g_v, 0.0)}


def test_the_gated_gradient_is_checked_through_the_update(tmp_path: Path) -> None:
    """v2: the hand-written gated step's gradient matches under its keys; under the control (k3 for
    k2) ``pg_loss`` already differs."""
    conv, flip = CASES["areal-token-k2-raw-ratio"]
    d = _gated_step(apply_gate_to_grad=True)
    res = _save(tmp_path, d, conv, world_size=1, micro_batches=1)
    assert res.match and "grad_logprobs" in res.quantities, (res.first_divergence, res.diagnosis)
    ctl = _save(tmp_path, d, {**conv, **flip}, world_size=1, micro_batches=1)
    assert not ctl.match and ctl.first_divergence == "pg_loss"


def test_a_gate_missing_from_the_gradient_is_caught_at_the_gradient(tmp_path: Path) -> None:
    conv, _ = CASES["areal-token-k2-raw-ratio"]
    res = _save(tmp_path, _gated_step(apply_gate_to_grad=False), conv, world_size=1, micro_batches=1)
    assert not res.match and res.first_divergence == "grad_logprobs", (res.first_divergence, res.diagnosis)
    assert res.quantities["pg_loss"].ok


def test_the_cases_gates_reject_some_tokens_and_keep_others() -> None:
    """Else a match would prove nothing: each case's gate changes ``pg_loss``."""
    x = _inputs()
    for conv, _ in CASES.values():
        off = {k: v for k, v in conv.items() if not k.startswith("rollout_rs")}
        assert float(naive_dump(x, setup_for(None, conv))["pg_loss"]) != float(
            naive_dump(x, setup_for(None, off))["pg_loss"]
        )


def test_a_gate_with_gspo_is_refused_in_one_line() -> None:
    with pytest.raises(ConventionError, match="rollout_rs with policy_loss=gspo"):
        setup_for(None, {"policy_loss": "gspo", "rollout_rs": "token", "rollout_rs_high": 2.0})


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("ppo.rollout_rs_high=-1", "rollout_rs_high: expected a ratio bound >= 0, got -1"),
        ("ppo.rollout_rs_low=3", "expected low <= high"),
        ("ppo.rollout_rs=tok", "rollout_rs"),
    ],
)
def test_bad_gate_keys_are_refused_in_one_line(item: str, message: str) -> None:
    from refppo.train.config.schema import load_config

    extra = ["ppo.rollout_rs=token", "ppo.rollout_rs_high=2.0"] if "low" in item else ["ppo.rollout_rs=token"]
    with pytest.raises((ConfigError, ConventionError)) as err:
        load_config(None, [*extra, item, "seam.enabled=true"])
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_trainer_refuses_a_gate_without_the_seam() -> None:
    from refppo.train.config.schema import load_config

    with pytest.raises(
        ConfigError, match=r"^ppo\.rollout_rs=token reads the behaviour log-probs .*seam\.enabled=true$"
    ):
        load_config(None, ["ppo.rollout_rs=token", "ppo.rollout_rs_high=2.0"])
    cfg = load_config(None, ["ppo.rollout_rs=token", "ppo.rollout_rs_high=2.0", "seam.enabled=true"])
    assert cfg.ppo.convention.gate.on
