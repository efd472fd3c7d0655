"""Issue #9 (memory): ``update_quantities`` frees the policy loss's per-token ``[B, T]`` tensor
(not returned) before the value loss allocates its own."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from oracle_helpers import make_inputs, setup_for

from refppo.core.policy import clipped_policy_token_loss
from refppo.core.value import value_token_loss
from refppo.pipeline import blocks as m_blocks
from refppo.pipeline import update as m_update
from refppo.pipeline.step import rollout_quantities, update_quantities


def test_policy_per_token_loss_is_freed_before_the_value_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    policy, value = clipped_policy_token_loss, value_token_loss

    def recording_policy(*a: Any, **k: Any) -> Any:
        out = policy(*a, **k)
        seen["per_token"] = weakref.ref(out.per_token)
        return out

    def checking_value(*a: Any, **k: Any) -> Any:
        seen["alive_at_value_loss"] = seen["per_token"]() is not None
        return value(*a, **k)

    monkeypatch.setattr(m_update, "clipped_policy_token_loss", recording_policy)
    monkeypatch.setattr(m_update, "value_token_loss", checking_value)
    inp = make_inputs()
    s = setup_for("trl")
    m = inp["response_mask"].bool()
    rq = rollout_quantities(
        scores=inp["scores"], old_logprobs=inp["old_logprobs"], ref_logprobs=inp["ref_logprobs"],
        old_values=inp["old_values"], mask=m, hp=s.hp, conv=s.conv,
    )  # fmt: skip
    with torch.no_grad():
        uq = update_quantities(
            logprobs=inp["logprobs"], values=inp["values"], old_logprobs=inp["old_logprobs"],
            old_values=inp["old_values"], advantages=rq.advantages, returns=rq.returns, mask=m,
            value_mask_=rq.value_mask, hp=s.hp, conv=s.conv,
        )  # fmt: skip
    assert seen["alive_at_value_loss"] is False
    assert bool(torch.isfinite(uq.loss))


class _BigOutputs(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every op whose output has at least ``numel`` elements: name, and whether it is a
    view or an in-place op (no new allocation)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel = numel
        self.allocating: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for o in outs:
            if isinstance(o, torch.Tensor) and o.numel() >= self.numel:
                in_place = str(func.overloadpacket.__name__).endswith("_")
                view = func.is_view if hasattr(func, "is_view") else False
                if not (in_place or view or name.startswith(("detach", "alias", "slice", "view"))):
                    self.allocating.append(str(func))
        return out


@pytest.mark.parametrize(
    "preset, conv",
    [("verl", {}), ("openrlhf", {"kl_in": "loss"}), ("verl", {"policy_loss": "gspo", "dual_clip": "none"})],
)
def test_update_without_a_graph_allocates_only_its_output_buffers(
    preset: str, conv: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #9: without autograd the update stage's only ``[B, T]``-sized allocations are its
    output buffers (policy ``ℓ`` and ``ρ``, value ``ℓ^v``, entropy and KL-loss terms): every other
    per-token temporary is one block of rows. The whole-batch evaluation (the old code) allocates
    about eight ``[B, T]`` temporaries per loss and fails this."""
    inp = make_inputs(B=6, T=12)
    s = setup_for(preset, conv)
    m = inp["response_mask"].bool()
    rq = rollout_quantities(
        scores=inp["scores"], old_logprobs=inp["old_logprobs"], ref_logprobs=inp["ref_logprobs"],
        old_values=inp["old_values"], mask=m, hp=s.hp, conv=s.conv,
    )  # fmt: skip
    ent = torch.rand(6, 12, dtype=inp["logprobs"].dtype)
    monkeypatch.setattr(m_blocks, "ROW_BLOCK_ELEMENTS", 24)  # two rows per block
    rec = _BigOutputs(6 * 12)
    with rec:
        uq = update_quantities(
            logprobs=inp["logprobs"], values=inp["values"], old_logprobs=inp["old_logprobs"],
            old_values=inp["old_values"], advantages=rq.advantages, returns=rq.returns, mask=m,
            value_mask_=rq.value_mask, ref_logprobs=inp["ref_logprobs"], entropy=ent, hp=s.hp, conv=s.conv,
        )  # fmt: skip
    n_buffers = 5 if s.conv.kl.placement.value == "loss" else 4
    assert rec.allocating == ["aten.empty_like.default"] * n_buffers
    assert bool(torch.isfinite(uq.loss))
