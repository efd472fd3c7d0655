"""``StepRecorder`` records a step whose truncated rows are masked out of the loss but kept in the
row count (issue #23 item 5, ``truncated_rows=mask_in_loss``, TRL ``mask_truncated_completions``):
the ``truncated`` [b] flags with the rows' generated tokens in ``response_mask``; the recorded dump
matches under the recorder's ``truncated_rows=mask_in_loss`` and not under ``keep``.

The recorded ``pg_loss`` is TRL's ``grpo`` formula written out here over the zeroed mask
(``mean_b(Σ_t m'ℓ / max(Σ_t m', 1))``) of the core's per-token clipped loss; the advantages are the
naive twins' GRPO advantages over every row (the rollout sees the truncated rows)."""

from __future__ import annotations

from pathlib import Path

import torch
from oracle_helpers import make_inputs, naive_dump, setup_for

from refppo.capture.recorder import StepRecorder
from refppo.core.policy import clipped_policy_token_loss
from refppo.oracle.run import check_step

B, T = 6, 8
LENGTHS = [T, 5, T, 3, 6, T]
TRUNCATED = torch.tensor([True, False, True, False, False, False])
CONV = {"advantage": "grpo", "kl_in": "loss", "loss_agg": "seq-mean-token-mean"}


def test_recorded_step_with_rows_out_of_the_loss(tmp_path: Path) -> None:
    x = make_inputs(B=B, T=T, seed=11, lengths=LENGTHS)
    for k in ("old_values", "values", "entropy"):
        x.pop(k)
    x["group_index"] = torch.tensor([0, 0, 0, 1, 1, 1])
    setup = setup_for(None, CONV, {"kl_coef": 0.0})
    adv = naive_dump(x, setup, keep=("advantages",))["advantages"]
    m = x["response_mask"].bool()
    per_token = clipped_policy_token_loss(x["logprobs"], x["old_logprobs"], adv, m, clip_low=0.2).per_token
    mz = (m & ~TRUNCATED.unsqueeze(1)).to(torch.float64)
    pg = (torch.where(mz.bool(), per_token, 0.0).sum(-1) / mz.sum(-1).clamp(min=1.0)).mean()
    hp = {k: v for k, v in setup.hparams_dict().items() if v is not None}
    rec = StepRecorder(hparams=hp, conventions={**CONV, "truncated_rows": "mask_in_loss"}, grads=False)
    rec.record(
        micro_batch=0, response_mask=x["response_mask"], old_logprobs=x["old_logprobs"],
        ref_logprobs=x["ref_logprobs"], scores=x["scores"], logprobs=x["logprobs"], advantages=adv,
        group_index=x["group_index"], truncated=TRUNCATED, pg_loss=pg,
    )  # fmt: skip
    path = tmp_path / "step.safetensors"
    assert rec.write(path) is not None
    res = check_step(path)
    assert res.match, res.text()
    assert res.result.quantities["pg_loss"].max_abs_err <= 1e-12
    assert not check_step(path, overrides={"truncated_rows": "keep"}).result.quantities["pg_loss"].ok
