"""Issue #23 item 1 (memory): after a returns step nothing reproduces, the groups on equal value
masks read one copy of the dumped returns (``carry_dumped_returns``), equal to the dump's returns on
the mask and zero off it; a group on another mask gets its own."""

from __future__ import annotations

import torch

from refppo.conventions import KLPlacement
from refppo.oracle.detect.groups import Group
from refppo.oracle.detect.rollout import carry_dumped_returns
from refppo.oracle.detect.states import Carried, ReturnsState


def _group(vm: torch.Tensor, seed: int) -> Group[ReturnsState]:
    g = torch.Generator().manual_seed(seed)
    ret = torch.randn(vm.shape, generator=g)
    carried = Carried(b"k", {}, KLPlacement.REWARD, vm, ret, bytes([seed]))
    return Group([{"seed": seed}], 1, ReturnsState(carried, torch.randn(vm.shape, generator=g), None))


def test_equal_masks_share_one_copy_of_the_dumped_returns() -> None:
    dumped = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 1.0
    vm = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    other = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    groups = [_group(vm.clone(), 1), _group(vm.clone(), 2), _group(other, 3)]
    raw = [g.state.adv_raw for g in groups]
    carry_dumped_returns(groups, dumped)
    got = [g.state.carried.returns for g in groups]
    hand = torch.tensor([[1.0, 2.0, 3.0, 0.0], [5.0, 6.0, 0.0, 0.0], [9.0, 10.0, 11.0, 12.0]])
    assert torch.equal(got[0], hand) and torch.equal(got[1], hand)
    assert got[0] is got[1]  # one [B, T] tensor for both groups
    assert torch.equal(got[2], torch.tensor([[1.0, 0, 0, 0], [5.0, 6.0, 0, 0], [9.0, 10.0, 11.0, 12.0]]))
    assert got[2] is not got[0]
    for g, r in zip(groups, raw, strict=True):  # nothing else of the state changes
        assert g.state.adv_raw is r
