"""Issue #9 (memory): ``update_quantities`` frees the policy loss's per-token ``[B, T]`` tensor
(not returned) before the value loss allocates its own."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from oracle_helpers import make_inputs, setup_for

import refppo.pipeline as pl


def test_policy_per_token_loss_is_freed_before_the_value_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    policy, value = pl.clipped_policy_loss, pl.value_loss

    def recording_policy(*a: Any, **k: Any) -> Any:
        out = policy(*a, **k)
        seen["per_token"] = weakref.ref(out.per_token)
        return out

    def checking_value(*a: Any, **k: Any) -> Any:
        seen["alive_at_value_loss"] = seen["per_token"]() is not None
        return value(*a, **k)

    monkeypatch.setattr(pl, "clipped_policy_loss", recording_policy)
    monkeypatch.setattr(pl, "value_loss", checking_value)
    inp = make_inputs()
    s = setup_for("trl")
    m = inp["response_mask"].bool()
    rq = pl.rollout_quantities(
        scores=inp["scores"], old_logprobs=inp["old_logprobs"], ref_logprobs=inp["ref_logprobs"],
        old_values=inp["old_values"], mask=m, hp=s.hp, conv=s.conv,
    )  # fmt: skip
    with torch.no_grad():
        uq = pl.update_quantities(
            logprobs=inp["logprobs"], values=inp["values"], old_logprobs=inp["old_logprobs"],
            old_values=inp["old_values"], advantages=rq.advantages, returns=rq.returns, mask=m,
            value_mask_=rq.value_mask, hp=s.hp, conv=s.conv,
        )  # fmt: skip
    assert seen["alive_at_value_loss"] is False
    assert bool(torch.isfinite(uq.loss))
