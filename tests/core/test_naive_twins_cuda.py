"""The naive loss twins on CUDA inputs (rev6 BUG-3).

``aggregate_loss_naive`` and ``normalize_naive`` check that their tensors share the mask's device;
the naive twins built their per-token loss matrix (and ``ppo_naive._whiten_mask_naive`` its
whitening mask) on the CPU, so with CUDA inputs they raised "expected device cuda:0, got cpu" on
a tensor the user never passed. Each twin is called here on CUDA tensors and compared with the
core called directly on the same tensors. CPU-only machines skip these (``gpu`` marker): no CPU
tensor can show the bug, since the naive twins read their inputs as Python lists (a ``meta``
tensor cannot be read) and the CPU is the default device the old code used.
"""

from __future__ import annotations

import math

import pytest
import torch

from refppo.conventions import WhitenHoles
from refppo.core.gspo import gspo_policy_loss, gspo_policy_loss_naive
from refppo.core.normalize import normalize, normalize_naive
from refppo.core.policy import clipped_policy_loss, clipped_policy_loss_naive
from refppo.core.value import value_loss, value_loss_naive
from refppo.pipeline.naive import _whiten_mask_naive

pytestmark = pytest.mark.gpu
F64 = torch.float64
TOL = 1e-12


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    old = -torch.rand(3, 4, generator=g, dtype=F64) - 0.1
    cpu = {
        "new": old + 0.3 * torch.randn(3, 4, generator=g, dtype=F64),
        "old": old,
        "target": torch.randn(3, 4, generator=g, dtype=F64),
        "mask": mask,
    }
    return {k: v.to("cuda") for k, v in cpu.items()}


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_policy_loss_naive_on_cuda_matches_core(agg: str) -> None:
    x = _inputs()
    args = (x["new"], x["old"], x["target"], x["mask"])
    want = float(clipped_policy_loss(*args, clip_low=0.1, agg=agg).loss)
    got = clipped_policy_loss_naive(*args, clip_low=0.1, agg=agg).loss
    assert math.isclose(got, want, rel_tol=TOL, abs_tol=TOL), (got, want)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_gspo_loss_naive_on_cuda_matches_core(agg: str) -> None:
    x = _inputs()
    args = (x["new"], x["old"], x["target"], x["mask"])
    want = float(gspo_policy_loss(*args, clip_low=0.1, agg=agg).loss)
    got = gspo_policy_loss_naive(*args, clip_low=0.1, agg=agg).loss
    assert math.isclose(got, want, rel_tol=TOL, abs_tol=TOL), (got, want)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_value_loss_naive_on_cuda_matches_core(agg: str) -> None:
    x = _inputs()
    args = (x["new"], x["old"], x["target"], x["mask"])
    want = float(value_loss(*args, clip=0.1, agg=agg).loss)
    got = value_loss_naive(*args, clip=0.1, agg=agg).loss
    assert math.isclose(got, want, rel_tol=TOL, abs_tol=TOL), (got, want)


def test_whiten_mask_naive_include_holes_on_cuda_feeds_normalize_naive() -> None:
    x = _inputs()
    wm = _whiten_mask_naive(x["mask"], WhitenHoles.INCLUDE)
    assert wm.device == x["mask"].device
    # row 1 has a hole at t=1 (included) and padding after its last valid token (excluded)
    want_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(wm.cpu(), want_mask)
    got = normalize_naive(x["target"], wm)
    want = normalize(x["target"], wm)
    assert got.device == want.device
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
