"""Cross-check: the oracle's reference gradient (autograd through the pipeline) equals the closed
form of ``refppo.core.grad`` (gradcore's naive twin, per-token loops over Python floats)."""

from __future__ import annotations

from typing import Any

import pytest
from grad_helpers import HP, TWO_RANKS_TWO_MB, step_dump

from refppo.oracle.check.recompute import recompute
from refppo.oracle.run import as_dump, check_step
from refppo.pipeline.grad_naive import objective_grads_naive

CONVS: list[dict[str, Any]] = [
    {"loss_agg": a}
    for a in (
        "token-mean",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
        "token-sum",
    )
] + [
    {"kl_in": "loss", "kl_estimator": "k3"},
    {"dual_clip": 1.3, "value_loss": "unclipped"},
    {"score_at": "after_last_valid", "value_clip_form": "delta"},
]


@pytest.mark.parametrize("conv", CONVS, ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in CONVS])
def test_reference_gradient_equals_the_closed_form(conv: dict[str, Any]) -> None:
    hp = {**HP, **TWO_RANKS_TWO_MB.sidecar(), **conv}
    dump = as_dump(step_dump(conv), hparams=hp)
    setup = check_step(dump).result.setup
    ref = recompute(dump, setup)
    inp = ref.update_inputs
    assert inp is not None
    g_lp, g_v = objective_grads_naive(
        logprobs=inp.logprobs,
        values=inp.values,
        old_logprobs=inp.old_logprobs,
        old_values=inp.old_values,
        advantages=inp.advantages,
        returns=inp.returns,
        mask=inp.mask,
        value_mask_=inp.value_mask,
        ref_logprobs=inp.ref_logprobs,
        hp=setup.hp,
        conv=setup.conv,
    )
    for name, closed in (("grad_logprobs", g_lp), ("grad_values", g_v)):
        auto = ref.values[name]
        scale = float(closed.abs().max())
        assert scale > 0
        assert float((auto - closed).abs().max()) <= 1e-12 * scale, name
