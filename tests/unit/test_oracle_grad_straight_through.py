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
    """Every estimator whose gradient is ``d`` explains it (k2, k1+, k3+, abs+): the diagnosis swaps
    the gradient only, so it names all four (the dumped values, k3's, single out ``k3+``)."""
    conv = {"kl_in": "loss", "kl_estimator": "k3"}
    rc, rep = run(tmp_path, step_dump(conv, Bugs(kl_estimator="k3+")), capsys, conv)
    assert rc == 1
    assert rep["first_divergence"] == "grad_logprobs"  # every value quantity matched
    assert sorted(e["bug"] for e in rep["explained_by"]) == [
        f"kl_estimator={e}" for e in ("abs+", "k1+", "k2", "k3+")
    ], rep["diagnosis"]
