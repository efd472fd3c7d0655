"""The value check of a ``kl_estimator`` gradient hypothesis uses the reference's own ``loss``
(review rev2 BUG-1). Before, :func:`refppo.oracle.check.grad_notes.kl_values_differ` rebuilt ``loss`` with
``update_quantities`` over the gradient's inputs, which adds ``vf_coef·vf_loss`` where the checked
reference has none: a ``separate_critic`` dump's ``loss`` (the actor's objective) and a critic-free
dump (zero stand-ins for the values). The TRUE estimator (k3+) was then "ruled out by the dumped
values" and nothing was named. Now it comes from ``recompute`` under the candidate (one path).

Dumps: a ``k3+`` step checked under ``k3`` (same values, different gradient); the gradient from the
hand-written trainer of ``grad_helpers`` (it never calls the pipeline)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from grad_helpers import LENGTHS, Bugs, step_dump, trainer_grads
from oracle_helpers import HP, make_inputs, refppo_dump, setup_for
from test_oracle_grad import run


def _named(rep: dict[str, Any]) -> list[str]:
    return sorted(e["bug"] for e in rep["explained_by"])


@pytest.mark.parametrize("separate_critic", [False, True], ids=["shared", "separate_critic"])
def test_separate_critic_loss_names_k3_plus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], separate_critic: bool
) -> None:
    """A separate critic's ``loss`` holds no value term (spec/dump-format.md ``separate_critic``)."""
    conv = {"kl_in": "loss", "kl_estimator": "k3"}
    d = step_dump(conv, Bugs(kl_estimator="k3+"), keep_scalars=True)
    extra: dict[str, Any] = {}
    if separate_critic:
        d["loss"] = d["loss"] - HP["vf_coef"] * d["vf_loss"]
        extra["separate_critic"] = True
    rc, rep = run(tmp_path, d, capsys, conv, **extra)
    text = "\n".join(rep["diagnosis"])
    assert rc == 1
    assert rep["first_divergence"] == "grad_logprobs", text  # loss and kl_loss matched under k3
    assert _named(rep) == ["kl_estimator=k3+"], text
    assert "kl_estimator=k3+ (its" not in text, text  # the true estimator is not ruled out
    assert "kl_estimator=k2 (its" in text, text  # k2's ½d² value is


def _critic_free_k3_plus_step() -> dict[str, torch.Tensor]:
    """A GRPO step without a critic: values from refppo's critic-free path (no value term in
    ``loss``), ``grad_logprobs`` from the hand-written trainer with a k3+ KL in the loss."""
    made = {"kl_in": "loss", "kl_estimator": "k3+", "advantage": "grpo"}
    inputs = make_inputs(B=len(LENGTHS), T=max(LENGTHS), seed=3, lengths=LENGTHS)
    for k in ("values", "old_values"):
        del inputs[k]
    inputs["group_index"] = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])  # a group stays on its rank
    d = refppo_dump(inputs, setup_for(conv=made))
    assert "loss" in d and "vf_loss" not in d and d["loss"].dim() == 0
    zeros = torch.zeros_like(d["logprobs"])  # the trainer's value leaves: grad_logprobs ignores them
    t = {**d, "values": zeros, "old_values": zeros, "returns": d.get("returns", zeros)}
    d["grad_logprobs"] = trainer_grads(t, made, Bugs())["grad_logprobs"]
    d["rank"] = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    d["micro_batch"] = torch.tensor([0, 1, 1, 1, 0, 0, 1, 1])
    return d


@pytest.mark.parametrize("checked", ["k3+", "k3"])
def test_critic_free_grpo_names_k3_plus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], checked: str
) -> None:
    """Critic-free GRPO with the KL in the loss (the main kl_in=loss use): checked under k3+ it
    matches; under k3 only the gradient differs and k3+ is the one estimator named."""
    conv = {"kl_in": "loss", "kl_estimator": checked, "advantage": "grpo"}
    rc, rep = run(tmp_path, _critic_free_k3_plus_step(), capsys, conv)
    text = "\n".join(rep["diagnosis"])
    if checked == "k3+":
        assert rc == 0, text
        return
    assert rc == 1
    assert rep["first_divergence"] == "grad_logprobs", text
    assert _named(rep) == ["kl_estimator=k3+"], text
    assert "kl_estimator=k3+ (its" not in text, text
