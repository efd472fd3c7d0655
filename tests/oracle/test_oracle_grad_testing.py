"""``refppo.testing.assert_step_matches`` and ``refppo.oracle.run.check_step``: the oracle in CI."""

from __future__ import annotations

from pathlib import Path

import pytest
from grad_helpers import HP, TWO_RANKS_TWO_MB, Bugs, save_step, step_dump

from refppo.errors import RefPPOError
from refppo.oracle.run import check_step
from refppo.testing import assert_step_matches

SIDECAR = {**HP, **TWO_RANKS_TWO_MB.sidecar()}


def test_tensors_of_a_correct_step_pass() -> None:
    outcome = assert_step_matches(step_dump(logged_losses=True), hparams=SIDECAR)
    assert outcome.match and "grad_logprobs" in outcome.result.quantities
    assert {"pg_loss", "vf_loss", "loss"} <= set(outcome.result.quantities)


def test_a_buggy_step_raises_with_the_report_as_message() -> None:
    with pytest.raises(AssertionError) as exc:
        assert_step_matches(
            step_dump(bugs=Bugs(local_norm=True)), hparams=SIDECAR, require=("grad_logprobs", "grad_values")
        )
    msg = str(exc.value)
    assert "MISMATCH: first divergence at grad_logprobs." in msg
    assert "micro-batch 0 of rank 0: factor 1.2" in msg  # 48 tokens / (2·2·10)
    assert msg.startswith("refppo diff: <tensors>")


def test_a_path_and_conventions_as_keywords(tmp_path: Path) -> None:
    conv = {"loss_agg": "seq-mean-token-mean"}
    path = save_step(tmp_path, step_dump(conv, logged_losses=True), None)  # the sidecar does not say the mode
    with pytest.raises(AssertionError, match="MISMATCH: first divergence at pg_loss"):
        assert_step_matches(path)
    assert assert_step_matches(path, loss_agg="seq-mean-token-mean").match
    assert check_step(path, overrides=conv).match


def test_bad_input_is_not_an_assertion() -> None:
    d = step_dump()
    d.pop("old_logprobs")
    with pytest.raises(RefPPOError, match="missing required keys"):
        assert_step_matches(d, hparams=SIDECAR)
    with pytest.raises(RefPPOError, match="unknown key 'kl_estimatr'"):
        assert_step_matches(step_dump(), hparams=SIDECAR, kl_estimatr="k3")


def test_hparams_with_a_path_are_laid_over_its_sidecar_never_dropped(tmp_path: Path) -> None:
    # the file's sidecar holds the step's true hyperparameters; hparams given beside the path
    # must change the check (before, check_step(path, hparams=...) silently ignored them)
    path = save_step(tmp_path, step_dump())
    assert check_step(path).match
    assert not check_step(path, hparams={"vf_coef": 5.0}).match
    with pytest.raises(AssertionError, match="MISMATCH: first divergence at grad_values"):
        assert_step_matches(path, hparams={"vf_coef": 5.0}, require=())
    # step keys reach the sidecar too (they are not --set keys): world_size 1 makes rank 1 invalid
    with pytest.raises(RefPPOError, match="rank"):
        assert_step_matches(path, hparams={"world_size": 1})
