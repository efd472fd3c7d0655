"""Issue #9: with ``kl_in=loss`` the oracle's recompute estimates the per-token KL once (it used to
call ``token_kl`` twice: in the pipeline, which then zeroes it, and again for the dump's ``kl``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from oracle_helpers import make_inputs, setup_for

import refppo.oracle.check.recompute as rc
from refppo.core.kl import token_kl
from refppo.dump.load import validate
from refppo.pipeline import rollout as m_rollout


@pytest.mark.parametrize("kl_in", ["loss", "reward"])
@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_is_estimated_once_and_is_the_core_estimate(
    kl_in: str, estimator: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def counting(*a: Any, **k: Any) -> torch.Tensor:
        calls.append(1)
        return token_kl(*a, **k)

    monkeypatch.setattr(m_rollout, "token_kl", counting)
    inp = make_inputs()
    dump = validate(Path("<memory>"), dict(inp))
    setup = setup_for(conv={"kl_in": kl_in, "kl_estimator": estimator})
    ref = rc.recompute(dump, setup, rollout_only=True)
    assert len(calls) == 1
    c = setup.conv
    want = token_kl(
        inp["old_logprobs"], inp["ref_logprobs"], dump.mask, c.kl.estimator,
        log_ratio_clamp=c.kl.log_ratio_clamp, value_clamp=c.kl.value_clamp,
    )  # fmt: skip
    assert torch.equal(ref.values["kl"], want)
    assert bool(want[dump.mask].abs().sum() > 0)  # a real estimate, not the pipeline's zeros
