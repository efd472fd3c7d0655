"""The oracle's gradient check with a straight-through KL in the loss (verl ``kl_loss_type: k3+``;
issue #13 item 3): a step whose KL-in-loss gradient is ``½d²``'s is reproduced under
``kl_estimator=k3+``, fails under ``k3`` at ``grad_logprobs`` (the values are the same), and the
diagnosis names ``kl_estimator=k3+``. Dumps from the hand-written trainer of ``grad_helpers``."""

from __future__ import annotations

from pathlib import Path

import pytest
from grad_helpers import Bugs, step_dump
from test_oracle_grad import run


@pytest.mark.parametrize("est", ["k1+", "k3+", "abs+"])
def test_straight_through_kl_loss_step_is_reproduced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], est: str
) -> None:
    conv = {"kl_in": "loss", "kl_estimator": est}
    rc, rep = run(tmp_path, step_dump(conv), capsys, conv)
    assert rc == 0, rep["diagnosis"]


def test_base_estimator_fails_on_the_gradient_and_names_the_straight_through_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every estimator whose gradient is ``d`` explains it (k2, k1+, k3+, abs+). Without the dumped
    ``kl_loss``/``loss`` nothing else tells them apart (``kl`` is no evidence: a trainer may estimate
    the rollout KL apart from its loss's), so all four are named; with them, see below."""
    conv = {"kl_in": "loss", "kl_estimator": "k3"}
    rc, rep = run(tmp_path, step_dump(conv, Bugs(kl_estimator="k3+")), capsys, conv)
    assert rc == 1
    assert rep["first_divergence"] == "grad_logprobs"  # every value quantity matched
    assert sorted(e["bug"] for e in rep["explained_by"]) == [
        f"kl_estimator={e}" for e in ("abs+", "k1+", "k2", "k3+")
    ], rep["diagnosis"]


@pytest.mark.parametrize(
    "values", [("kl_loss", "loss"), ("kl_loss",), ("loss",), ()], ids=["both", "kl_loss", "loss", "neither"]
)
def test_the_value_check_singles_out_k3_plus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], values: tuple[str, ...]
) -> None:
    """A ``k3+`` step checked under ``k3``: the dumped ``kl_loss``, or ``loss``, rules out k2, k1+ and
    abs+ (their KL terms ``½d²``, ``d``, ``|d|``), and the report says so. Control: with neither in
    the dump only the gradient speaks, and all four are named."""
    conv = {"kl_in": "loss", "kl_estimator": "k3"}
    d = step_dump(conv, Bugs(kl_estimator="k3+"), keep_scalars=True)
    assert d["kl_loss"].dim() == 0 and d["loss"].dim() == 0
    d = {k: v for k, v in d.items() if v.dim() > 0 or k in values}
    rc, rep = run(tmp_path, d, capsys, conv)
    assert rc == 1
    assert rep["first_divergence"] == "grad_logprobs"  # kl_loss and loss matched under k3
    named = sorted(e["bug"] for e in rep["explained_by"])
    text = "\n".join(rep["diagnosis"])
    if not values:
        assert named == [f"kl_estimator={e}" for e in ("abs+", "k1+", "k2", "k3+")], text
        assert "ruled out" not in text
        return
    assert named == ["kl_estimator=k3+"], text
    for est in ("k2", "k1+", "abs+"):
        assert f"kl_estimator={est} (its {values[0]}" in text, text
    assert "ruled out by the dumped values" in text
