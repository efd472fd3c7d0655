"""The README's "Check your trainer in CI" example, run as written: a user's own micro-batch loop
gains a recorder (4 lines), a dump and an assertion; the same loop with a per-micro-batch
token-mean fails with the oracle's report as the assertion message."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _capture_trainer as ct  # the tiny models and batch of the 2-rank capture test

from refppo.pipeline.blocks import Normalisers
from refppo.pipeline.settings import Convention
from refppo.pipeline.step import update_quantities

pytestmark = pytest.mark.e2e


def my_training_step(tmp_path: Path, per_micro_batch_mean: bool) -> Path:
    """Stands for the user's trainer: one optimizer step over 2 micro-batches, ONE process."""
    from refppo.capture.recorder import StepRecorder  # + user line 1

    policy, critic, b = ct.setup()
    conv = Convention()
    q = ct.quantities(b, conv)
    opt = torch.optim.SGD([*policy.parameters(), *critic.parameters()], lr=0.1)
    n_tok, n_vtok = float(b.mask.sum()), float(q.value_mask.sum())
    rec = StepRecorder(hparams=ct.HP, conventions=conv)  # + user line 2
    for k, rows in enumerate(([0, 1, 2, 3], [4, 5, 6, 7])):
        idx = torch.tensor(rows)
        logprobs, values = policy(b.ids[idx]), critic(b.ids[idx])
        norm = None if per_micro_batch_mean else Normalisers(n_tok, 8.0, n_vtok)
        uq = update_quantities(
            logprobs=logprobs, values=values, old_logprobs=b.old_logprobs[idx], old_values=b.old_values[idx],
            advantages=q.advantages[idx], returns=q.returns[idx], mask=b.mask[idx], hp=ct.HP, conv=conv,
            norm=norm, value_mask_=q.value_mask[idx],
        )  # fmt: skip
        s = 0.5 if per_micro_batch_mean else 1.0  # the bug: each micro-batch's own mean, averaged
        rec.record(  # + user line 3 (one call): every output, the losses as passed to backward
            micro_batch=k, logprobs=logprobs, values=values, response_mask=b.mask[idx],
            old_logprobs=b.old_logprobs[idx], ref_logprobs=b.ref_logprobs[idx], old_values=b.old_values[idx],
            scores=b.scores[idx], kl=q.kl[idx], token_rewards=q.token_rewards[idx],
            advantages=q.advantages[idx], returns=q.returns[idx],
            pg_loss=s * uq.pg_loss, vf_loss=s * uq.vf_loss, loss=s * uq.loss,
        )  # fmt: skip
        (s * uq.loss).backward()
    rec.write(tmp_path / "step.safetensors")  # + user line 4
    opt.step()
    return tmp_path / "step.safetensors"


def test_readme_ci_example_passes_on_a_correct_step(tmp_path: Path) -> None:
    from refppo.testing import assert_step_matches

    assert_step_matches(my_training_step(tmp_path, per_micro_batch_mean=False))


def test_readme_ci_example_fails_with_the_diagnosis(tmp_path: Path) -> None:
    from refppo.testing import assert_step_matches

    with pytest.raises(AssertionError) as err:
        assert_step_matches(my_training_step(tmp_path, per_micro_batch_mean=True))
    text = str(err.value)
    assert "grad_logprobs" in text and "per-micro-batch normaliser" in text, text
    assert "micro-batch 0" in text and "micro-batch 1" in text, text
    # issue #21 item 3: the losses it logs are those of the same bug, so nothing else is blamed
    assert "with it every quantity in the dump matches" in text and "still differ" not in text, text


def test_readme_ci_example_without_the_losses_fails_by_default(tmp_path: Path) -> None:
    """A gate never passes on what it did not compare: a dump without outputs its inputs allow
    fails unless ``require`` names what must be compared."""
    from refppo.capture.recorder import StepRecorder
    from refppo.testing import assert_step_matches

    policy, critic, b = ct.setup()
    conv = Convention()
    q = ct.quantities(b, conv)
    rec = StepRecorder(hparams=ct.HP, conventions=conv)
    logprobs, values = policy(b.ids), critic(b.ids)
    rec.record(
        logprobs=logprobs, values=values, response_mask=b.mask, old_logprobs=b.old_logprobs,
        ref_logprobs=b.ref_logprobs, old_values=b.old_values, scores=b.scores,
        advantages=q.advantages, returns=q.returns,
    )  # fmt: skip
    uq = update_quantities(
        logprobs=logprobs, values=values, old_logprobs=b.old_logprobs, old_values=b.old_values,
        advantages=q.advantages, returns=q.returns, mask=b.mask, hp=ct.HP, conv=conv,
        value_mask_=q.value_mask,
    )  # fmt: skip
    uq.loss.backward()
    path = rec.write(tmp_path / "step.safetensors")
    assert path is not None
    dump = tmp_path / "step.safetensors"
    with pytest.raises(AssertionError, match=r"kl, token_rewards, pg_loss, vf_loss, loss were not compared"):
        assert_step_matches(dump)
    assert assert_step_matches(dump, require=("grad_logprobs", "grad_values", "advantages")).match
